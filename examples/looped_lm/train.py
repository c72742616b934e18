"""Train a small HRM-Text (transformers' ``HrmTextForCausalLM``) on Python's ``pydoc_data.topics``.

The model is trained as HRM-Text trains (its own loop, ``H_cycles`` x ``L_cycles``, with its ``L_bp_cycles``
gradient); `deqzoo.integrations.looped_lm.LoopedLM` then evaluates it with its own loop, solved to a fixed
point with Anderson, and with per-token halting (``evaluate.py``-style comparisons are left to the card).

Data: the help topics sorted by name; a topic is held out when the first byte of sha256(name) is below 26
(about 10%); each split is its topics' texts in name order, each followed by a blank line. A byte-level BPE
tokenizer (``tokenizers``, ``--vocab`` tokens) is trained on the training split and saved with the model.
Training samples random windows of ``--seq`` tokens from the training stream.

Random depth (``--H-min``): each step runs the model's own forward with ``H_cycles`` drawn uniformly from
``[--H-min, --H]`` (the generator is part of the resumable state), as Huginn trains with a random number of
recurrences; the saved config keeps ``H_cycles = --H``, the model's own loop. A model trained this way must
give its answer at any depth in that range, which asks its state to settle rather than to pass through a
fixed schedule: the property a fixed-point solve and per-token halting need. ``--H-min`` equal to ``--H``
(the default) is HRM-Text's fixed-depth training.

Resumable: every ``--save-every`` steps the run writes ``state.safetensors`` (weights, AdamW moments, RNG
states) and ``state.json`` (step, log, CPU seconds spent) under ``--out``; rerunning the same command
continues from there. ``--max-cpu-hours`` bounds the CPU time of all runs together (the run is meant to go at
nice 19 on a shared machine, where wall time says little). At the end (or at each save) the model
is written with ``save_pretrained`` into ``--out/model`` (config.json, model.safetensors, tokenizer).

    nice -n 19 python examples/looped_lm/train.py --out /work/runs/looped-lm --max-cpu-hours 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def split_text(split: str) -> str:
    """The concatenated text of one split ("train" or "held_out") of pydoc_data.topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = [n for n in names if hashlib.sha256(n.encode()).digest()[0] < 26]
    chosen = held if split == "held_out" else [n for n in names if n not in set(held)]
    return "".join(topics[n].strip() + "\n\n" for n in chosen)


def train_tokenizer(vocab_size: int):
    """Byte-level BPE on the training split, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([split_text("train")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS)  # fmt: skip


def build_model(args, tokenizer):
    from transformers import HrmTextConfig, HrmTextForCausalLM

    cfg = HrmTextConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32, head_dim=32,
        H_cycles=args.H, L_cycles=args.L, max_position_embeddings=args.seq, prefix_lm=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return HrmTextForCausalLM(cfg)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% (a pure function of the step: nothing to resume)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save_state(out: Path, model, opt, gen: torch.Generator, step: int, log: list, seconds: float,
               wall: float) -> None:
    """Tensors in safetensors, the rest in JSON (no pickles); each file replaced only once complete."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = torch.as_tensor(v).clone().contiguous()
    tensors["rng.gen"], tensors["rng.torch"] = gen.get_state(), torch.get_rng_state()
    save_file(tensors, str(out / "state.safetensors.tmp"))
    meta = {"step": step, "seconds": seconds, "wall_seconds": wall, "log": log,
            "param_groups": opt.state_dict()["param_groups"]}  # fmt: skip
    (out / "state.json.tmp").write_text(json.dumps(meta))
    (out / "state.safetensors.tmp").replace(out / "state.safetensors")
    (out / "state.json.tmp").replace(out / "state.json")


def load_state(out: Path, model, opt, gen: torch.Generator) -> tuple[int, list, float, float]:
    from safetensors.torch import load_file

    tensors = load_file(str(out / "state.safetensors"))
    meta = json.loads((out / "state.json").read_text())
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    gen.set_state(tensors["rng.gen"])
    torch.set_rng_state(tensors["rng.torch"])
    return meta["step"], meta["log"], meta["seconds"], meta.get("wall_seconds", 0.0)


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq: int, max_windows: int) -> float:
    """Mean next-token NLL over consecutive windows of the held-out stream (the model's own loop)."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq)
    x = stream[: n * seq + 1]
    total, count = 0.0, 0
    for i in range(0, n, 8):
        rows = torch.stack([x[j * seq : (j + 1) * seq + 1] for j in range(i, min(n, i + 8))])
        out = model(rows[:, :-1], labels=rows[:, :-1], use_cache=False)  # labels shift inside
        total += float(out.loss) * rows.shape[0] * (seq - 1)
        count += rows.shape[0] * (seq - 1)
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/work/runs/looped-lm"))
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1, help="transformer blocks per H / L stack")
    ap.add_argument("--H", type=int, default=2, help="H_cycles")
    ap.add_argument("--H-min", type=int, default=None, help="random depth: H_cycles drawn from [H-min, H] "
                    "per step (default: H, fixed depth)")
    ap.add_argument("--L", type=int, default=2, help="L_cycles")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--max-cpu-hours", type=float, default=4.0, help="CPU-time budget of all runs together")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.H_min = args.H if args.H_min is None else args.H_min
    if not 1 <= args.H_min <= args.H:
        ap.error(f"--H-min must be in [1, --H={args.H}], got {args.H_min}")

    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    run_file = args.out / "run.json"
    if run_file.is_file():  # a resumed run keeps its settings: a different command is an error
        saved = json.loads(run_file.read_text())
        mine = {k: str(v) for k, v in vars(args).items() if k not in ("max_cpu_hours", "threads")}
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            raise SystemExit(f"{run_file} was written with other settings (saved, given): {diff}")
    else:
        run_file.write_text(json.dumps({k: str(v) for k, v in vars(args).items()
                                        if k not in ("max_cpu_hours", "threads")}, indent=1))  # fmt: skip
    torch.manual_seed(args.seed)
    if (args.out / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(args.out)
    else:
        tokenizer = train_tokenizer(args.vocab)
        tokenizer.save_pretrained(args.out)
    train = torch.tensor(tokenizer(split_text("train"))["input_ids"], dtype=torch.long)
    held = torch.tensor(tokenizer(split_text("held_out"))["input_ids"], dtype=torch.long)
    model = build_model(args, tokenizer).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    step, log, seconds, wall = 0, [], 0.0, 0.0
    if (args.out / "state.safetensors").is_file():
        step, log, seconds, wall = load_state(args.out, model, opt, gen)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {train.numel()} tokens, held-out {held.numel()}, {n_params} parameters, from step {step} "
          f"({seconds / 3600:.2f} CPU hours spent)", flush=True)  # fmt: skip
    bar = tqdm(total=args.steps, initial=step, desc="train hrm-text", mininterval=30)
    t0, recent = time.process_time() - seconds, []  # CPU seconds of this process, plus earlier runs'
    w0 = time.time() - wall
    while step < args.steps and (time.process_time() - t0) < args.max_cpu_hours * 3600:
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=gen)
        rows = torch.stack([train[s : s + args.seq] for s in starts.tolist()])
        depth = args.H
        if args.H_min < args.H:  # drawn only then, so fixed-depth runs keep their random stream
            depth = int(torch.randint(args.H_min, args.H + 1, (1,), generator=gen))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        model.config.H_cycles = depth  # read by the forward's loop; nothing else uses it without a cache
        try:
            loss = model(rows, labels=rows, use_cache=False).loss
        finally:
            model.config.H_cycles = args.H
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(float(loss.detach()))
        bar.update(1)
        if step % args.eval_every == 0 or step == args.steps:
            entry = {"step": step, "train_loss": sum(recent) / len(recent),
                     "cpu_hours": (time.process_time() - t0) / 3600,
                     "wall_hours": (time.time() - w0) / 3600, "time": time.strftime("%H:%M:%S"),
                     "held_out_loss": held_out_loss(model, held, args.seq, 64)}  # fmt: skip
            recent = []
            log.append(entry)
            bar.write(json.dumps(entry))
        if step % args.save_every == 0 or step == args.steps:
            save_state(args.out, model, opt, gen, step, log, time.process_time() - t0, time.time() - w0)
            model.save_pretrained(args.out / "model")
            tokenizer.save_pretrained(args.out / "model")
    save_state(args.out, model, opt, gen, step, log, time.process_time() - t0, time.time() - w0)
    model.save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")
    bar.close()
    print(f"stopped at step {step} after {(time.process_time() - t0) / 3600:.3f} CPU hours, "
          f"{(time.time() - w0) / 3600:.3f} wall hours", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
