"""Train a recursive reasoner (TRM / HRM) or its explicit one-pass twin on generated puzzles.

Deep supervision as TRM trains: a batch of `batch_size` puzzle slots, each carrying its state (y, z) from one
optimizer step to the next; one step runs ONE segment on every slot (gradient by the config's grad_mode,
the carry detached), then a slot is refilled with a fresh puzzle when it has run ``halt_max_steps``
segments or its Q-head halts it (halt logit > 0, with the originals' exploration: with probability
halt_exploration_prob a slot first draws a minimum of 2..halt_max_steps segments). The twin
(`--model twin`, :func:`deqzoo.models.reasoner.one_pass_twin`) is the same network applied once (one segment,
one cycle, one latent update, full backpropagation): the same parameters, no recursion.

Data: a pool of puzzles generated from `--seed` (cached in the run folder), augmented on the fly (digit
relabelling, row / column / band / stack permutations); held-out puzzles come from data/*.npz (other seeds)
and are never in the pool.

Resumable: every `--checkpoint-every` steps the run folder gets `checkpoint/` (save_pretrained) and
`trainer_state.safetensors` (optimizer moments, the slots' puzzles and carries, RNG state) written next to
the old ones and swapped in; ``--resume`` continues from them. The data stream is a function of
(seed, step), so a resumed run draws what an uninterrupted one would. Logs are JSON lines in
`<out>/log.jsonl`; `--cpu-hours` stops at a process CPU-time budget (equal-compute comparisons).

    PYTHONPATH=. nice -n 19 python examples/reasoner/train.py --out /work/runs/reasoner-pilot --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from deqzoo.models.reasoner import (
    ARCHITECTURES,
    ReasonerConfig,
    ReasonerForGridClassification,
    exact_solved,
    grid_groups,
    one_pass_twin,
)
from examples.reasoner.puzzles import BOXES, augment_sudoku, generate_maze, generate_sudoku, load_heldout

TASKS = {"sudoku6": ("sudoku", 6, "sudoku6_heldout"), "sudoku4": ("sudoku", 4, None),
         "sudoku9": ("sudoku", 9, "sudoku9_heldout"), "maze9": ("maze", 9, "maze9_heldout")}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run folder (created; outside the repository)")
    p.add_argument("--task", default="sudoku6", choices=sorted(TASKS))
    p.add_argument("--model", default="reasoner", choices=["reasoner", "twin"])
    p.add_argument("--preset", default="trm-sudoku6-mlp", choices=sorted(ARCHITECTURES))
    p.add_argument("--config", default="{}", help="JSON overrides of the preset's config")
    p.add_argument("--steps", type=int, default=1_000_000, help="optimizer steps (segments)")
    p.add_argument("--cpu-hours", type=float, default=None, help="stop after this much process CPU time")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                   help="lr after warmup: constant, or cosine-annealed to 0 at --cpu-hours (if given) or "
                        "--steps")
    p.add_argument("--init-from", default=None,
                   help="start from these weights (a save_pretrained folder of the same network) with a "
                        "fresh optimizer: a continuation whose trainer state is gone, or a second stage "
                        "under another gradient mode or halting rule")
    p.add_argument("--pool", type=int, default=5000, help="puzzles generated for training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=0, help="raise the process's niceness by this much")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-size", type=int, default=1000, help="held-out puzzles scored at each eval")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_config(args) -> ReasonerConfig:
    preset = dict(ARCHITECTURES[args.preset]["config"])
    kind, n, _ = TASKS[args.task]
    task = ({"vocab_size": n + 1, "num_labels": n + 1, "seq_len": n * n} if kind == "sudoku"
            else {"vocab_size": 5, "num_labels": 2, "seq_len": n * n})
    overrides = json.loads(args.config)
    if overrides.get("mixer", preset.get("mixer")) == "groups" and "token_groups" not in overrides:
        # the task's constraint structure: a Sudoku's rows, columns and boxes; a maze's rows and columns
        task["token_groups"] = grid_groups(n, box=BOXES[n] if kind == "sudoku" else None)
    cfg = ReasonerConfig(**{**preset, **task, **overrides, "on_nonconvergence": "ignore"})
    return one_pass_twin(cfg) if args.model == "twin" else cfg


def training_pool(args, out: Path) -> dict[str, np.ndarray]:
    """The training puzzles (cached in the run folder), drawn from `--seed`, held-out puzzles removed."""
    kind, n, heldout = TASKS[args.task]
    path = out / f"pool_{args.task}_{args.pool}_{args.seed}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as d:
            return {"inputs": d["inputs"], "labels": d["labels"]}
    rng = random.Random(args.seed)
    pairs = []
    for _ in tqdm(range(args.pool), desc="generating training puzzles", disable=args.no_progress):
        pairs.append(generate_sudoku(n, rng) if kind == "sudoku" else generate_maze(n, rng))
    inputs, labels = np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])
    if heldout:
        held = {bytes(row) for row in load_heldout(heldout)["inputs"]}
        keep = np.array([bytes(row) not in held for row in inputs])
        inputs, labels = inputs[keep], labels[keep]
    np.savez_compressed(path, inputs=inputs, labels=labels)
    return {"inputs": inputs, "labels": labels}


def draw(pool, args, step: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` augmented puzzles, a function of (seed, step) only (resumable)."""
    kind, n, _ = TASKS[args.task]
    rng = np.random.default_rng([args.seed, step])
    idx = rng.integers(0, len(pool["inputs"]), count)
    xs, ys = [], []
    for i in idx:
        x, y = pool["inputs"][i], pool["labels"][i]
        if kind == "sudoku":
            x, y = augment_sudoku(x, y, n, rng)
        xs.append(x)
        ys.append(y)
    return torch.from_numpy(np.stack(xs).astype(np.int64)), torch.from_numpy(np.stack(ys).astype(np.int64))


@torch.no_grad()
def evaluate(model, data, size: int, batch: int = 250) -> dict:
    """Exact-solve rate and cell accuracy on the first `size` held-out puzzles at the trained budget, without
    halting and with ACT halting (mean segments)."""
    model.eval()
    x = torch.from_numpy(data["inputs"][:size].astype(np.int64))
    y = torch.from_numpy(data["labels"][:size].astype(np.int64))
    result = {}
    for rule in ("budget", "act"):
        solved, cells, steps = [], [], []
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch], halting=rule)
            solved.append(exact_solved(out.logits, y[i:i + batch]))
            cells.append((out.logits.argmax(-1) == y[i:i + batch]).float().mean(1))
            steps.append(out.steps.float())
        result[rule] = {"exact": float(torch.cat(solved).float().mean()),
                        "cells": float(torch.cat(cells).mean()), "segments": float(torch.cat(steps).mean())}
    model.train()
    return result


def learning_rate(args, step: int, cpu_s: float = 0.0) -> float:
    """Linear warmup, then constant, or a cosine to 0 at the run's end: at `--cpu-hours` of process CPU time
    when that budget is given (equal-compute runs end annealed whatever the machine's speed), else at
    `--steps` (a function of the step alone: such a run resumes exactly)."""
    lr = args.lr * min(1.0, (step + 1) / max(args.warmup, 1))
    if args.schedule == "cosine" and step >= args.warmup:
        if args.cpu_hours is not None:
            progress = cpu_s / (3600 * args.cpu_hours)
        else:
            progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return lr


def save_state(out: Path, model, opt, slots: dict, step: int, info: dict) -> None:
    """checkpoint/ and trainer_state.safetensors, written to temporary names and then swapped in, so the
    previous checkpoint stays complete until the new one is."""
    tmp = out / "checkpoint.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tensors = {f"slot.{k}": v.contiguous() for k, v in slots.items()}
    for index, moments in opt.state_dict()["state"].items():  # keyed by parameter index
        for k, v in moments.items():
            tensors[f"opt.{index}.{k}"] = torch.as_tensor(v).contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "trainer_state.safetensors"), metadata={"step": str(step),
                                                                        "info": json.dumps(info)})
    old = out / "checkpoint.old"
    if (out / "checkpoint").exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out / "checkpoint", old)
    os.replace(tmp, out / "checkpoint")
    if old.exists():
        shutil.rmtree(old)


def load_state(out: Path, opt) -> tuple[dict, int, dict]:
    from safetensors import safe_open

    path = out / "checkpoint" / "trainer_state.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    state = opt.state_dict()
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, index, name = key.split(".", 2)
            state["state"].setdefault(int(index), {})[name] = value
    opt.load_state_dict(state)
    torch.set_rng_state(tensors["rng.torch"])
    slots = {k[5:]: v for k, v in tensors.items() if k.startswith("slot.")}
    return slots, int(meta["step"]), json.loads(meta["info"])


# Config keys that do not describe the network: what save_pretrained adds, and how the network is trained
# and halted (a second stage may switch gradient mode, as a DEQ warm-started by unrolled training does).
NOT_THE_NETWORK = frozenset({"dtype", "transformers_version", "_name_or_path", "grad_mode", "deq", "halting",
                             "halt_tol", "halt_patience"})


def network_keys(config) -> dict:
    """The config's entries that make two checkpoints the same network run on the same schedule."""
    return {k: v for k, v in config.to_dict().items() if k not in NOT_THE_NETWORK}


def main(argv=None) -> None:
    args = parse(argv)
    if args.nice:
        os.nice(args.nice)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(args)
    if args.resume:
        model = ReasonerForGridClassification.from_pretrained(out / "checkpoint")
    else:
        if (out / "checkpoint").exists():
            raise SystemExit(f"{out}/checkpoint exists: pass --resume to continue, or another --out")
        model = ReasonerForGridClassification(cfg)
        if args.init_from:
            start = ReasonerForGridClassification.from_pretrained(args.init_from)
            if network_keys(start.config) != network_keys(cfg):
                raise SystemExit(f"--init-from {args.init_from}: its config.json is not this run's network")
            model.load_state_dict(start.state_dict())
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    pool = training_pool(args, out)
    heldout_name = TASKS[args.task][2]
    heldout = load_heldout(heldout_name) if heldout_name else None
    b = args.batch_size
    if args.resume:
        slots, step, info = load_state(out, opt)
    else:
        x, y = draw(pool, args, 0, b)
        carry = model.reasoner.initial_carry(b)
        slots = {"x": x, "y": y, "cy": carry.y, "cz": carry.z, "steps": torch.zeros(b, dtype=torch.long),
                 "min_steps": torch.zeros(b, dtype=torch.long)}
        step, info = 0, {"cpu_s": 0.0, "wall_s": 0.0, "puzzles": b}
        with open(out / "run.json", "w") as f:
            json.dump({"args": vars(args), "config": cfg.to_dict(), "parameters": n_params}, f, indent=1,
                      default=str)
    log = open(out / "log.jsonl", "a")
    cpu0, wall0 = time.process_time() - info["cpu_s"], time.time() - info["wall_s"]
    bar = tqdm(total=args.steps, initial=step, disable=args.no_progress, desc=f"{args.model} {args.task}")
    n_sup = cfg.halt_max_steps
    running = info.get("loss", 0.0)
    while step < args.steps:
        if args.cpu_hours is not None and time.process_time() - cpu0 >= 3600 * args.cpu_hours:
            break
        lr = learning_rate(args, step, time.process_time() - cpu0)
        for group in opt.param_groups:
            group["lr"] = lr
        out_ = model(slots["x"], labels=slots["y"], carry=(slots["cy"], slots["cz"]), num_segments=1,
                     halting="budget")
        opt.zero_grad(set_to_none=True)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():  # TRM's halting in training: budget, or the Q-head after the drawn minimum
            slots["steps"] += 1
            done = slots["steps"] >= n_sup
            if n_sup > 1:
                done |= (out_.q_halt_logits > 0) & (slots["steps"] >= slots["min_steps"])
            slots["cy"], slots["cz"] = out_.carry
            rows = done.nonzero().flatten()
            if rows.numel():
                x, y = draw(pool, args, step, rows.numel())
                init = model.reasoner.initial_carry(rows.numel())
                slots["x"][rows], slots["y"][rows] = x, y
                slots["cy"][rows], slots["cz"][rows] = init.y, init.z
                slots["steps"][rows] = 0
                explore = torch.rand(rows.numel()) < cfg.halt_exploration_prob
                slots["min_steps"][rows] = explore * torch.randint(2, max(n_sup, 2) + 1, (rows.numel(),))
                info["puzzles"] += rows.numel()
        loss_value = float(out_.loss.detach())
        running = 0.98 * running + 0.02 * loss_value if step > 1 else loss_value
        info["loss"] = running
        bar.update(1)
        bar.set_postfix(loss=f"{running:.3f}")
        record = None
        if heldout is not None and (step % args.eval_every == 0 or step == args.steps):
            record = {"step": step, "loss": running, "eval": evaluate(model, heldout, args.eval_size)}
        if step % args.checkpoint_every == 0 or step == args.steps:
            info.update(cpu_s=time.process_time() - cpu0, wall_s=time.time() - wall0)
            save_state(out, model, opt, slots, step, info)
        if record is not None:
            record.update(cpu_s=time.process_time() - cpu0, wall_s=time.time() - wall0, lr=lr,
                          puzzles=info["puzzles"])
            log.write(json.dumps(record) + "\n")
            log.flush()
            tqdm.write(json.dumps(record))
    info.update(cpu_s=time.process_time() - cpu0, wall_s=time.time() - wall0)
    save_state(out, model, opt, slots, step, info)
    log.write(json.dumps({"step": step, "final": True, "cpu_s": info["cpu_s"], "wall_s": info["wall_s"],
                          "puzzles": info["puzzles"]}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
