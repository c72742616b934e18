"""Worker of tests/models/test_trainer_loss.py, run by torchrun in 2 processes (gloo, CPU): fine-tunes a
tiny DEQ language model and a tiny IGNN graph classifier with transformers' Trainer at learning rate 0 (the
model stays what it was, so its own loss on the data is the reference), with gradient accumulation 1 and 2,
and writes, per process, the losses Trainer logged and the model's own loss on each micro-batch this
process trained on (the collator records them)."""

from __future__ import annotations

import json
import sys

import torch
from transformers import Trainer, TrainingArguments

torch.set_num_threads(1)
SAMPLES = 16  # 2 processes x 2 per device x accumulation 2 x 2 steps: one epoch
DEQ = {"f_max_iter": 4, "f_tol": 1e-12}  # a fixed number of steps whatever the batch


def lm():
    from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM

    torch.manual_seed(0)
    config = DEQTransformerConfig(vocab_size=40, d_model=16, n_head=2, d_head=8, d_inner=24, tgt_len=6,
                                  mem_len=0, deq=DEQ)
    model = DEQTransformerForCausalLM(config)
    ids = torch.randint(0, 40, (SAMPLES, 6), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def collate(rows):
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]} | {"use_cache": False}

    return model, data, collate


def ignn():
    from deqzoo.models.ignn import IGNNConfig, IGNNForGraphClassification

    torch.manual_seed(0)
    # kappa=None: no projection of W before each forward (it would change the weights at learning rate 0)
    config = IGNNConfig(in_features=3, hidden_size=6, num_labels=2, num_layers=2, graph_head_hidden=6,
                        dropout=0.0, kappa=None, deq=DEQ)
    model = IGNNForGraphClassification(config)
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(4, 3, generator=g), "edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]]),
             "labels": torch.tensor(i % 2)} for i in range(SAMPLES)]

    def collate(rows):  # a batch of graphs is one block-diagonal graph with a batch vector
        offsets = [4 * i for i in range(len(rows))]
        return {"x": torch.cat([r["x"] for r in rows]),
                "edge_index": torch.cat([r["edge_index"] + o for r, o in zip(rows, offsets)], dim=1),
                "batch": torch.repeat_interleave(torch.arange(len(rows)), 4),
                "labels": torch.stack([r["labels"] for r in rows])}

    return model, data, collate


def run(build, accumulation: int, out: str) -> dict:
    model, data, collate = build()
    seen: list[list[int]] = []

    def recording(rows):  # the micro-batches this process trains on, in order
        seen.append([int(r["index"]) for r in rows])
        return collate([{k: v for k, v in r.items() if k != "index"} for r in rows])

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation,
                             max_steps=SAMPLES // (4 * accumulation),
                             learning_rate=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
                             remove_unused_columns=False)
    indexed = [{**row, "index": i} for i, row in enumerate(data)]
    trainer = Trainer(model=model, args=args, train_dataset=indexed, data_collator=recording)
    result = trainer.train()
    # learning rate 0: the model is the one that trained; its own mean loss per batch, computed as in training
    # (with autograd on, a DEQ attaches its backward with one more f step at z*)
    own = [float(model.train()(**collate([data[i] for i in batch])).loss.detach()) for batch in seen]
    return {"seen": seen, "own": own, "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "training_loss": result.training_loss, "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs}


def main() -> None:
    out = sys.argv[1]
    results = {f"{name}-ga{ga}": run(build, ga, f"{out}/{name}-ga{ga}")
               for name, build in (("lm", lm), ("ignn", ignn)) for ga in (1, 2)}
    rank = torch.distributed.get_rank()
    with open(f"{out}/losses-rank{rank}.json", "w") as handle:
        json.dump({"world_size": torch.distributed.get_world_size(), **results}, handle)


if __name__ == "__main__":
    main()
