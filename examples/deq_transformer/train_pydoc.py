"""Train the tiny DEQ-Transformer (or its explicit baseline) on Python's pydoc topics.

Reproduces ``model_cards/deq-transformer-tiny-pydoc`` (Bai et al.'s pre-LN block, implicit differentiation):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --pre-lnorm \\
        --out model_cards/deq-transformer-tiny-pydoc

The explicit baseline (2 untied blocks with d_inner shrunk to match the DEQ's parameter count, same steps,
batch and segment length, so the same tokens):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --explicit \\
        --out /tmp/explicit-pydoc

Jacobian regularization (one Hutchinson sample per step):

    python examples/deq_transformer/train_pydoc.py --steps 800 --dropout 0.1 --pre-lnorm --jac-reg 0.03 \\
        --out /tmp/deq-jr-pydoc

The byte-level BPE tokenizer (``tokenizers``, 1024 tokens) is trained on the training topics only and saved
into the checkpoint, so ``AutoTokenizer`` and ``pipeline("text-generation")`` load it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM
from deqzoo.tasks import pydoc_lm

EOS = "<|endoftext|>"
TRAIN_DEQ = {"f_solver": "anderson", "f_max_iter": 14, "f_tol": 1e-3, "b_mode": "ift", "b_solver": "anderson",
             "b_max_iter": 10, "b_tol": 1e-3}
EVAL_DEQ = {"f_max_iter": 30, "f_tol": 1e-3}


def train_tokenizer(vocab_size: int):
    """Byte-level BPE on the training topics, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([pydoc_lm.split_text("train")], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=1_000_000)


def build_config(args, tokenizer) -> DEQTransformerConfig:
    common = dict(vocab_size=len(tokenizer), d_model=128, n_head=4, d_head=32, tgt_len=args.seg,
                  mem_len=args.seg, dropout=args.dropout, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                  architectures=["DEQTransformerForCausalLM"])
    if args.explicit:
        # 2 untied blocks; d_inner chosen so the parameter count matches the DEQ (see the card)
        return DEQTransformerConfig(**common, d_inner=args.explicit_d_inner, explicit_layers=2, deq=TRAIN_DEQ)
    deq = {**TRAIN_DEQ, "f_max_iter": args.train_f_iter, "jac_reg_samples": 1 if args.jac_reg > 0 else 0}
    if args.b_mode == "phantom":  # phantom gradient (Geng et al. 2021): k damped unrolled steps from z*
        deq.update(b_mode="phantom", b_mode_kwargs={"k": args.phantom_k, "tau": args.phantom_tau})
    if args.b_mode == "unrolled":  # TorchDEQ deq-lm's recipe: backprop through the fixed-point iterations
        deq.update(f_solver="fixed_point", b_mode="unrolled")
    return DEQTransformerConfig(**common, d_inner=512, variant=args.variant, pre_lnorm=args.pre_lnorm,
                                jac_reg_weight=args.jac_reg, deq=deq)


def batches(ids: torch.Tensor, batch: int, seg: int):
    """Endless (x, y, new_epoch) over `batch` parallel streams, consecutive segments (memory carries over)."""
    n = (ids.numel() - 1) // batch
    xs = ids[: n * batch].view(batch, n)
    ys = ids[1: n * batch + 1].view(batch, n)
    while True:
        for i, s in enumerate(range(0, n - seg + 1, seg)):
            yield xs[:, s:s + seg], ys[:, s:s + seg], i == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--explicit", action="store_true", help="train the explicit (untied) baseline")
    p.add_argument("--explicit-d-inner", type=int, default=96)
    p.add_argument("--jac-reg", type=float, default=0.0, help="Jacobian regularization weight (0 = off)")
    p.add_argument("--b-mode", choices=("ift", "phantom", "unrolled"), default="ift", help="backward mode")
    p.add_argument("--variant", choices=("bai2019", "torchdeq"), default="bai2019")
    p.add_argument("--pre-lnorm", action="store_true", help="bai2019 with LayerNorm before each sublayer")
    p.add_argument("--phantom-k", type=int, default=5)
    p.add_argument("--phantom-tau", type=float, default=0.6)
    p.add_argument("--train-f-iter", type=int, default=14, help="forward solver iterations in training")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seg", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log", default=None, help="write the per-step log (JSON) here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = train_tokenizer(args.vocab)
    config = build_config(args, tokenizer)
    model = DEQTransformerForCausalLM(config)
    n_params = sum(t.numel() for t in model.parameters())
    ids = pydoc_lm.token_stream(tokenizer, "train")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup = max(1, args.steps // 20)
    def lr_factor(s: int) -> float:  # linear warmup, cosine decay
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    cache, start, log = None, time.time(), []
    data = batches(ids, args.batch, args.seg)
    bar = tqdm(range(args.steps), desc="train " + ("explicit" if args.explicit else "deq"))
    for step in bar:
        x, y, new_epoch = next(data)
        out = model(x, past_key_values=None if new_epoch else cache)
        cache = out.past_key_values
        cache.z_last = None
        nll = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        loss = nll
        if out.jac_loss is not None and args.jac_reg > 0:
            loss = loss + args.jac_reg * out.jac_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        sched.step()
        log.append({"step": step, "nll": float(nll), "nfe": int(out.deq_stats.nfe),
                    "jac": float(out.jac_loss) if out.jac_loss is not None else None})
        bar.set_postfix(nll=f"{float(nll):.3f}", nfe=int(out.deq_stats.nfe))

    if args.b_mode == "unrolled":  # evaluate with the iterations it was trained for
        model.set_deq(f_solver="fixed_point", f_max_iter=args.train_f_iter, f_tol=1e-3, jac_reg_samples=0)
    else:
        model.set_deq(**EVAL_DEQ, jac_reg_samples=0)
    model.eval()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"args": vars(args), "params": n_params, "train_tokens": args.steps * args.batch * args.seg,
            "train_seconds": round(time.time() - start, 1),
            "final_nll": sum(r["nll"] for r in log[-20:]) / max(1, len(log[-20:]))}
    if args.log:
        Path(args.log).write_text(json.dumps({"meta": meta, "log": log}))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
