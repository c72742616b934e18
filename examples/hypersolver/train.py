"""Training a hypersolver against a FROZEN model (Bai et al. 2022, Algorithm 3 / section 6.2), without labels.

1. Capture: run the model on its own training inputs; every DEQ solve is recorded (`record_problems`) and
   answered by a long classic solve (Anderson, `gt_iter` steps, `gt_tol`): the cached ground truth z*.
2. Train h_φ and s_ξ by backpropagation through K unrolled HyperAnderson steps (`problems.unroll`)
   on the recorded problems, f_θ frozen, with three losses:
   L_conv = Σ_k w_k |z_k - z*| / |z*| (w_k ∝ k, increasing in k), L_init = |z_0 - z*| / |z*| (the
   initializer alone) and L_α = Σ_k |G_k α_k| / |g_k| (Anderson's least-squares objective for the predicted
   weights; its weight decays linearly to 0 over the first half of training).

Run from a clone (training is not part of the installed package)::

    deqzoo train-hypersolver deqzoo/mdeq-tiny-mnist --out my-hypersolver
    python examples/hypersolver/train.py deqzoo/mdeq-tiny-mnist --out my-hypersolver   # the same
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from deqzoo.core.solvers import get_solver
from deqzoo.hypersolver.configuration import HyperSolverConfig
from deqzoo.hypersolver.modeling import HyperSolver

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.hypersolver._problems import Problem, default_config, initial_flat, record_problems, unroll

__all__ = ["TrainResult", "collect_problems", "default_config", "model_batches", "train_hypersolver"]


def _gt_solver(gt_iter: int, gt_tol: float) -> Callable[[Problem], tuple]:
    anderson = get_solver("anderson")

    def solve(p: Problem):
        return anderson(p.g, p.x0, max_iter=gt_iter, tol=gt_tol, stop_mode="rel")

    return solve


@torch.no_grad()
def collect_problems(
    model: nn.Module,
    batches: Iterable[Callable[[], object]],
    *,
    gt_iter: int = 60,
    gt_tol: float = 1e-5,
    progress: bool = True,
) -> list[Problem]:
    """Run the model on each batch (each item is a callable running one forward) with every DEQ solve
    answered by a long Anderson solve; returns the recorded problems with their ground truth."""
    import warnings

    from tqdm.auto import tqdm

    model.eval()
    with record_problems(model, solve=_gt_solver(gt_iter, gt_tol)) as problems, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the residual reached is recorded in the config
        for run in tqdm(list(batches), desc="ground truth", disable=not progress):
            run()
    return problems


def model_batches(
    model: nn.Module, task: str, split: str, *, batch_size: int, n_batches: int, seed: int = 0
) -> list[Callable[[], object]]:
    """Forward calls over a task's own inputs: ``mnist`` image batches (split "train"/"test"), ``pydoc_lm``
    token chunks of the model's tgt_len with the memory carried over (split "train"/"held_out";
    `batch_size` parallel streams)."""
    if task == "mnist":
        import numpy as np

        from examples.mdeq import mnist

        x, _ = mnist.load_split(split)
        order = np.random.default_rng(seed).permutation(len(x)) if split == "train" else np.arange(len(x))
        out = []
        for i in range(n_batches):
            idx = order[i * batch_size : (i + 1) * batch_size]
            if len(idx) == 0:
                break
            pixels = mnist.to_pixel_values(x[idx], model)
            out.append(lambda pixels=pixels: model(pixel_values=pixels))
        return out
    if task == "pydoc_lm":
        from examples.deq_transformer import pydoc_lm

        ids = pydoc_lm.token_stream(pydoc_lm.load_tokenizer(model), split)
        seg = model.config.tgt_len
        per = ids.numel() // batch_size
        streams = ids[: per * batch_size].view(batch_size, per)
        n = min(n_batches, per // seg)
        state: dict = {"cache": None}

        def run(i):
            out = model(streams[:, i * seg : (i + 1) * seg], past_key_values=state["cache"])
            state["cache"] = out.past_key_values
            return out

        return [lambda i=i: run(i) for i in range(n)]
    raise ValueError(f"no hypersolver inputs for task {task!r}; known: mnist, pydoc_lm")


@dataclass
class TrainResult:
    hypersolver: HyperSolver
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _rel_err(x: torch.Tensor, x_star: torch.Tensor) -> torch.Tensor:
    return (
        torch.linalg.vector_norm(x - x_star, dim=1) / torch.linalg.vector_norm(x_star, dim=1).clamp_min(1e-12)
    ).mean()


def train_hypersolver(
    problems: list[Problem],
    config: HyperSolverConfig,
    *,
    steps: int = 200,
    lr: float = 3e-3,
    seed: int = 0,
    init_weight: float = 0.5,
    alpha_weight: float = 1.0,
    max_seconds: float | None = None,
    progress: bool = True,
    hypersolver: HyperSolver | None = None,
) -> TrainResult:
    """Train a hypersolver on recorded problems (each with its ground truth x_star); see the module docstring.
    Stops after `steps` optimizer steps or `max_seconds` (whichever first)."""
    from tqdm.auto import tqdm

    if not problems or any(p.x_star is None for p in problems):
        raise ValueError("train_hypersolver needs recorded problems with ground truth (collect_problems)")
    torch.manual_seed(seed)
    hs = hypersolver if hypersolver is not None else HyperSolver(config)
    hs.train()
    opt = torch.optim.Adam(hs.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    K, c = config.unroll_steps, config
    weights = torch.arange(1, K + 1, dtype=torch.float32)
    weights = weights / weights.sum()
    order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed))
    log: list[dict] = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train hypersolver", disable=not progress)
    for step in bar:
        p = problems[int(order[step % len(problems)])]
        shapes = p.packer.shapes
        x_star = p.x_star
        if hs.has_initializer and p.injection is not None:
            x0 = initial_flat(hs, p)
        else:
            x0 = p.x0
        records, x_last = unroll(p.g, x0, hs.bind(shapes), K, m=c.m, form=c.form, base=c.alpha_base)
        iterates = [r.x for r in records[1:]] + [x_last]  # x_1 .. x_K
        l_conv = sum(w * _rel_err(x, x_star) for w, x in zip(weights, iterates))
        l_init = _rel_err(x0, x_star)
        l_alpha = (
            sum(
                (
                    torch.linalg.vector_norm(torch.bmm(r.alpha.unsqueeze(1), r.G).squeeze(1), dim=1)
                    / torch.linalg.vector_norm(r.g, dim=1).clamp_min(1e-12)
                ).mean()
                for r in records
            )
            / K
        )
        a_w = alpha_weight * max(0.0, 1.0 - step / (0.5 * steps))
        loss = l_conv + init_weight * l_init + a_w * l_alpha
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hs.parameters(), 1.0)
        opt.step()
        sched.step()
        entry = {
            "step": step,
            "loss": loss.item(),
            "conv": float(l_conv.detach()),
            "init": float(l_init.detach()),
            "alpha": float(l_alpha.detach()),
            "final_rel_err": float(_rel_err(x_last.detach(), x_star)),
            "seconds": round(time.perf_counter() - start, 2),
        }
        log.append(entry)
        bar.set_postfix(
            conv=f"{entry['conv']:.3f}", init=f"{entry['init']:.3f}", last=f"{entry['final_rel_err']:.3f}"
        )
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    hs.eval()
    return TrainResult(hypersolver=hs, log=log, seconds=time.perf_counter() - start)


# model task -> (inputs per ground-truth batch, number of batches): the defaults of `deqzoo train-hypersolver`
DEFAULT_DATA = {"mnist": (16, 16), "pydoc_lm": (8, 12)}


def run_cli(args) -> int:
    """`deqzoo train-hypersolver MODEL --out DIR`: record problems on the model's training inputs (no labels),
    solve them for the ground truth, train, save; prints the summary as JSON."""
    import json
    from pathlib import Path

    from deqzoo import from_pretrained
    from deqzoo.hub import resolve
    from deqzoo.hub.cards import read_model_card
    from deqzoo.hypersolver.io import save_hypersolver

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = from_pretrained(args.model).eval()
    model.requires_grad_(False)  # f_θ is frozen: gradients flow only to the hypersolver
    meta, _ = read_model_card(resolve(args.model))
    task = meta.get("deqzoo_task")
    bs, nb = DEFAULT_DATA.get(task, (None, None))
    bs, nb = args.batch_size or bs, args.batches or nb
    if bs is None:
        raise ValueError(f"{args.model}: no hypersolver training inputs for task {task!r}")
    split = "train"
    problems = collect_problems(
        model,
        model_batches(model, task, split, batch_size=bs, n_batches=nb, seed=args.seed),
        gt_iter=args.gt_iter,
        gt_tol=args.gt_tol,
        progress=not args.no_progress,
    )
    gt_seconds = time.perf_counter() - t0
    config = default_config(
        model, args.model, m=args.memory, unroll_steps=args.unroll, form=args.form,
        alpha_base=args.alpha_base, use=args.use,
    )
    result = train_hypersolver(
        problems,
        config,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        max_seconds=None if args.max_seconds is None else args.max_seconds - gt_seconds,
        progress=not args.no_progress,
    )
    total = time.perf_counter() - t0
    hs = result.hypersolver
    hs.config.training = {
        "command": "deqzoo train-hypersolver " + " ".join(args.argv or [args.model, "--out", args.out]),
        "data": f"task {task}, split {split}: {len(problems)} problems x {bs} inputs, no labels",
        "ground_truth": f"anderson, {args.gt_iter} iterations, rel tol {args.gt_tol}",
        "ground_truth_max_rel_residual": max(float(p.stats.rel_residual.max()) for p in problems),
        "steps": len(result.log),
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "seconds_ground_truth": round(gt_seconds, 1),
        "seconds_total": round(total, 1),
        "final_loss": result.log[-1]["loss"],
        "final_rel_err_at_K": result.log[-1]["final_rel_err"],
        "parameters": hs.num_parameters(),
    }
    out = save_hypersolver(hs, args.out)
    (Path(out) / "train_log.json").write_text(json.dumps(result.log) + "\n")
    print(json.dumps(hs.config.training, indent=2))
    return 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="train a HyperDEQ hypersolver for a frozen checkpoint")
    p.add_argument("model", help="checkpoint id or directory (e.g. deqzoo/mdeq-tiny-mnist)")
    p.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--max-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--unroll", type=int, default=6, help="K, the unrolled HyperAnderson steps")
    p.add_argument("--memory", type=int, default=5, help="m (the window holds m + 1 iterates)")
    p.add_argument("--form", choices=["anderson", "simplified"], default="anderson")
    p.add_argument("--alpha-base", choices=["none", "anderson"], default="none",
                   help="none: the paper's HyperAnderson; anderson: learned correction to Anderson's weights")
    p.add_argument("--use", choices=["hyperanderson", "initializer"], default="hyperanderson",
                   help="what attaching it does (HyperSolverConfig.use): the learned mixing, or the "
                        "initializer and the model's own solver (choose from `deqzoo bench hypersolver`)")
    p.add_argument("--batch-size", type=int, default=None, help="inputs per recorded problem")
    p.add_argument("--batches", type=int, default=None, help="recorded problems (training inputs)")
    p.add_argument("--gt-iter", type=int, default=60, help="ground truth: Anderson iterations")
    p.add_argument("--gt-tol", type=float, default=1e-5, help="ground truth: relative tolerance")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    return run_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
