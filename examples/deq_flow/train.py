"""Train DEQ-Flow (or its explicit RAFT twin) on the synthetic FlyingChairs-like pairs of `flow.py`.

The recipe follows DEQ-Flow's Algorithm (Bai et al., 2022) at CPU scale: the forward solve by plain
fixed-point iteration (f_max_iter 24), a one-step phantom gradient, fixed-point correction on 3 states
(iterations 8, 16, 24) with RAFT's γ = 0.8 weighting; the explicit RAFT baseline unrolls the same update block
12 times with RAFT's sequence loss. Both: AdamW, one-cycle learning rate (5% warm-up, linear decay), gradient
clipping 1.0, batch 8 of 64x64 pairs; training pair i of step s is `synthetic_pair(s * batch + i)`, so both
models see the same data.

Resumable: every --save-every steps OUT/checkpoint/ holds the weights (model.safetensors), the optimizer state
(optimizer.safetensors) and the step (state.json), written to a temporary folder and renamed; rerunning the
same command continues from there. The final model is saved with save_pretrained into OUT/model/.
With --keep-every N, every N steps (and at step 0) OUT/snapshots/step-XXXXXX/ also keeps the weights then
(save_pretrained: config.json + model.safetensors, a few MB, plus snapshot.json with the training seconds so
far), written to a temporary folder and renamed; a snapshot that exists is never overwritten and none is ever
deleted, so a long run leaves the points of its held-out EPE-vs-steps curve (examples/deq_flow/curves.py).

    PYTHONPATH=. python examples/deq_flow/train.py --model deq-flow-cpu-synth --out runs/deq_flow --steps 3500
    PYTHONPATH=. python examples/deq_flow/train.py --model deq-flow-cpu-raft-baseline --out runs/raft \
        --steps 3500
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import deqzoo
from deqzoo.models.deq_flow import two_stage_backward

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_flow.flow import epe, synthetic_batch


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer state as flat tensors (safetensors) plus its JSON-able remainder."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(out: Path, model, opt, step: int, log: list[dict]) -> None:
    tmp, final = out / "checkpoint.tmp", out / "checkpoint"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    tensors, meta = _optimizer_tensors(opt)
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "optimizer": meta, "log": log}))
    old = out / "checkpoint.old"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def keep_snapshot(out: Path, model, step: int, seconds: dict[str, float]) -> Path:
    """Keep the weights at `step` in OUT/snapshots/step-XXXXXX/ with the training seconds so far (atomic
    rename; an existing one is kept as is: a resumed run recomputes the same step from the same checkpoint and
    data)."""
    final = out / "snapshots" / f"step-{step:06d}"
    if final.exists():
        return final
    tmp = final.with_name(f".{final.name}.tmp")  # our own unfinished write from a killed process
    if tmp.exists():
        shutil.rmtree(tmp)
    was_training = model.training
    model.eval()
    model.save_pretrained(tmp)
    model.train(was_training)
    meta = {"step": step, **{k: round(v, 2) for k, v in seconds.items()}}
    (tmp / "snapshot.json").write_text(json.dumps(meta))
    tmp.rename(final)
    return final


# config keys that train.py's own options set (--config may not set them a second way)
_FLAG_KEYS = {"jac_loss_weight", "residual_loss_weight", "flow_residual_weight", "detach_flow_input", "deq"}

# options that do not change what is trained (the rest must match when a run resumes)
_SESSION_OPTIONS = ("out", "save_every", "keep_every", "log_every", "stop_after", "threads", "progress")


def check_recipe(out: Path, args: argparse.Namespace) -> None:
    """OUT/run.json holds the recipe of the run's first start; a rerun with other options (a different
    --steps changes the one-cycle schedule, for example) is refused instead of silently mixing recipes."""
    recipe = {k: v for k, v in vars(args).items() if k not in _SESSION_OPTIONS}
    recipe = json.loads(json.dumps(recipe, default=str))
    path = out / "run.json"
    if path.is_file():
        first = json.loads(path.read_text())
        diff = sorted(k for k in set(first) | set(recipe) if first.get(k) != recipe.get(k))
        if diff:
            was = ", ".join(f"{k}: {first.get(k)!r}" for k in diff)
            now = ", ".join(f"{k}: {recipe.get(k)!r}" for k in diff)
            raise SystemExit(
                f"{path}: this run was started with other options ({was}; now {now}); rerun it with the same "
                "options or choose another --out"
            )
    else:
        path.write_text(json.dumps(recipe, indent=1) + "\n")


def lr_at(step: int, total: int, peak: float, warmup: float = 0.05) -> float:
    """One-cycle (linear warm-up over `warmup` of the steps, then linear decay to 0), as the original."""
    w = max(1, int(total * warmup))
    return peak * (step + 1) / w if step < w else peak * max(0.0, (total - step) / max(1, total - w))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deq-flow-cpu-synth",
                   help="preset name (deq-flow-cpu-synth or deq-flow-cpu-raft-baseline)")
    p.add_argument("--out", type=Path, required=True, help="run folder (checkpoint/, model/, log.jsonl)")
    p.add_argument("--steps", type=int, default=3500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--size", type=int, nargs=2, default=[64, 64], metavar=("H", "W"))
    p.add_argument(
        "--max-shift", type=float, default=None,
        help="largest translation of the training pairs, pixels (default: a tenth of the smaller side)",
    )
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="parameter init seed")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument(
        "--keep-every", type=int, default=0, help="also keep a weights-only snapshot every N steps (0: none)"
    )
    p.add_argument("--log-every", type=int, default=25, help="log.jsonl line every N steps")
    p.add_argument(
        "--stop-after", type=int, default=0, help="end this process after this step (rerun resumes)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deq", type=json.loads, default={}, help='DEQConfig overrides, JSON: {"f_max_iter": 36}')
    p.add_argument(
        "--config",
        type=json.loads,
        default={},
        help="model config overrides, JSON, the same for both networks of a pair (a wider update block, as "
        'the original\'s --huge: {"hidden_dim": 96, ...}); the loss weights have their own options',
    )
    p.add_argument("--jac-loss-weight", type=float, default=0.0, help="Jacobian regularizer weight")
    p.add_argument("--residual-loss-weight", type=float, default=0.0, help="equilibrium residual weight")
    p.add_argument(
        "--residual-ramp", type=float, default=0.0, help="fraction of steps to ramp it up"
    )
    p.add_argument("--flow-residual-weight", type=float, default=0.0, help="flow drift weight (px)")
    p.add_argument("--init", type=Path, help="start from this model folder's weights (fine-tuning)")
    p.add_argument(
        "--all-grad",
        action="store_true",
        help="gradient through f's flow input (--all_grad); only backwards that differentiate f in its state "
        "see it (phantom k > 1, ift, unrolled, the Jacobian regularizer): one phantom step starts detached",
    )
    p.add_argument(
        "--two-stage",
        action="store_true",
        help="DEQ-Flow: two-stage backward (deqzoo.models.deq_flow.two_stage_backward; same gradients, one "
        "supervised state's graph at a time)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "save_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.keep_every < 0 or args.stop_after < 0:
        p.error(f"--keep-every and --stop-after must be >= 0, got {args.keep_every} and {args.stop_after}")
    if args.max_shift is not None and not 0 <= args.max_shift < min(args.size):
        p.error(f"--max-shift must be in [0, {min(args.size)}) for --size {args.size}, got {args.max_shift}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    extra = {"jac_loss_weight": args.jac_loss_weight} if args.jac_loss_weight else {}
    if args.residual_loss_weight:
        extra["residual_loss_weight"] = args.residual_loss_weight
    if args.flow_residual_weight:
        extra["flow_residual_weight"] = args.flow_residual_weight
    if args.all_grad:
        extra["detach_flow_input"] = False
    if not isinstance(args.config, dict) or set(args.config) & _FLAG_KEYS:
        p.error(f"--config must be a JSON object without the keys that have their own options "
                f"({', '.join(sorted(_FLAG_KEYS))}), got {args.config!r}")
    model = deqzoo.create_model(args.model, **extra, **args.config)  # a wrong key or value: ConfigError
    if args.deq:
        model.set_deq(**args.deq)
    if args.init is not None:
        model.load_state_dict(load_file(args.init / "model.safetensors"))
    model.set_deq(on_nonconvergence="ignore")  # training iterates to f_max_iter by design
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, eps=1e-8)
    args.out.mkdir(parents=True, exist_ok=True)
    check_recipe(args.out, args)
    start, log = 0, []
    ckpt = args.out / "checkpoint"
    if ckpt.exists():
        model.load_state_dict(load_file(ckpt / "model.safetensors"))
        state = json.loads((ckpt / "state.json").read_text())
        _load_optimizer(opt, load_file(ckpt / "optimizer.safetensors"), state["optimizer"])
        start, log = state["step"], state["log"]
        print(f"resumed from step {start}", file=sys.stderr)
    model.train()
    model_seconds = sum(e["sec_per_step"] * e["n"] for e in log)
    if args.keep_every and start == 0:
        keep_snapshot(args.out, model, 0, {"elapsed": 0.0, "model_seconds": 0.0, "cpu_seconds": 0.0})
    end = min(args.steps, args.stop_after) if args.stop_after else args.steps
    bar = tqdm(
        range(start, end),
        initial=start,
        total=args.steps,
        desc=args.model,
        disable=not args.progress,
        mininterval=10,
    )
    size, bs = tuple(args.size), args.batch_size
    window: list[tuple[float, float, float]] = []
    t_run, c_run = time.time(), time.process_time()
    # wall clock and this process's CPU time (all of it: data, steps, saving) over the kept history: a killed
    # session's steps after the last checkpoint are recomputed and counted once; on a shared machine at nice
    # 19 the CPU seconds, not the wall clock, are the training budget spent
    elapsed0 = log[-1]["elapsed"] if log else 0.0
    cpu0 = log[-1].get("cpu_seconds", 0.0) if log else 0.0
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        if args.residual_loss_weight and args.residual_ramp:  # linear ramp: first learn to move, then to stop
            ramp = min(1.0, (step + 1) / max(1, args.residual_ramp * args.steps))
            model.config.residual_loss_weight = args.residual_loss_weight * ramp
        image1, image2, flow, valid = synthetic_batch(
            range(step * bs, (step + 1) * bs), size, "train", max_shift=args.max_shift
        )
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        if args.two_stage:  # same gradients as below, one supervised state's graph alive at a time
            out = two_stage_backward(model, image1, image2, flow, valid.float())
        else:
            out = model(image1, image2, flow_gt=flow, valid=valid.float())
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        nfe = out.deq_stats.nfe if out.deq_stats is not None else model.config.num_flow_updates
        jac = getattr(out.deq_stats, "jac_loss", None)
        window.append(
            (
                float(out.loss.detach()),
                epe(out.flow.detach(), flow, valid),
                time.time() - t0,
                float(jac.detach()) if jac is not None else 0.0,
                float(out.deq_stats.rel_residual.mean()) if out.deq_stats is not None else 0.0,
            )
        )
        model_seconds += window[-1][2]
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            loss, err, sec, jac_mean, residual = (sum(v[i] for v in window) / len(window) for i in range(5))
            log.append(
                {
                    "step": step + 1,
                    "n": len(window),
                    "loss": loss,
                    "train_epe": err,
                    "sec_per_step": sec,
                    "nfe": nfe,
                    "jac_loss": jac_mean,
                    "rel_residual": residual,
                    "lr": opt.param_groups[0]["lr"],
                    "elapsed": elapsed0 + time.time() - t_run,
                    "cpu_seconds": cpu0 + time.process_time() - c_run,
                }
            )
            with (args.out / "log.jsonl").open("a") as fh:
                fh.write(json.dumps(log[-1]) + "\n")
            bar.set_postfix(loss=f"{loss:.3f}", epe=f"{err:.3f}", s=f"{sec:.2f}")
            window = []
        if args.keep_every and (step + 1) % args.keep_every == 0:
            seconds = {"elapsed": elapsed0 + time.time() - t_run, "model_seconds": model_seconds,
                       "cpu_seconds": cpu0 + time.process_time() - c_run}
            keep_snapshot(args.out, model, step + 1, seconds)
        if (step + 1) % args.save_every == 0 or step + 1 in (args.steps, end):
            save_checkpoint(args.out, model, opt, step + 1, log)
    if end < args.steps:
        print(f"stopped after step {end} of {args.steps}; rerun the same command to go on", file=sys.stderr)
        return 0
    model.eval()
    final = args.out / "model"
    model.save_pretrained(final)
    train_s = sum(e["sec_per_step"] * e["n"] for e in log)
    (args.out / "summary.json").write_text(
        json.dumps(
            {
                "model": args.model,
                "steps": args.steps,
                "batch_size": bs,
                "size": list(size),
                "lr": args.lr,
                "max_shift": args.max_shift,
                "seed": args.seed,
                "deq": args.deq,
                "jac_loss_weight": args.jac_loss_weight,
                "residual_loss_weight": args.residual_loss_weight,
                "residual_ramp": args.residual_ramp,
                "flow_residual_weight": args.flow_residual_weight,
                "all_grad": args.all_grad,
                "init": str(args.init) if args.init else None,
                "model_seconds": round(train_s, 1),
                "wall_seconds": round(log[-1]["elapsed"], 1) if log else 0.0,
                "cpu_seconds": round(log[-1].get("cpu_seconds", 0.0), 1) if log else 0.0,
                "final_train_epe": log[-1]["train_epe"] if log else math.nan,
            },
            indent=1,
        )
    )
    print(f"saved {final}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
