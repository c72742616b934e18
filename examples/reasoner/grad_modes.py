"""Gradient-mode table (issue #56, scope 6): the same reasoner preset on the same task, trained for the SAME
process CPU time under each gradient mode, then scored on the stored held-out puzzles.

Modes (all through ``ReasonerModel.segment``; the "deq" ones through deqzoo.core.DEQ with the cycle
(y, z) -> (y', z') as the fixed-point map, at most ``h_cycles`` cycles forward, so every mode runs the same
forward schedule):

| name | what the gradient is |
| --- | --- |
| one_step | HRM's 1-step gradient: only the last latent and the last answer update carry a graph |
| last_cycle | TRM's deep supervision: the last cycle of each segment with a graph, the carry detached |
| full | backpropagation through every cycle of the segment (the carry still detached between segments) |
| ift | implicit-function backward at the segment's end point (adjoint solved by fixed-point iteration) |
| phantom | phantom gradient: k damped unrolled steps from the end point (UPG, k=2, tau=0.5) |
| reversible | RevDEQ's coupled reversible iteration, backward by exact reversal |

Every mode gets the same CPU-second budget (``--cpu-seconds``, process CPU time as train.py counts it), one
thread, run one after the other (one process), from the same seed, pool and data stream. The table gives
exact-solve and cell accuracy at the trained budget (halting off) on the first ``--eval-size`` puzzles of
``data/sudoku6_heldout.npz``, the optimizer steps (segments) each mode fitted into its budget, and the CPU
seconds used. A small-budget table: it ranks the modes early in training, not at convergence.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 19 python examples/reasoner/grad_modes.py \\
        --out /work/runs/grad-modes --cpu-seconds 120

``--warm-start-seconds S`` runs the table as DEQs are usually trained (MDEQ and DEQ-Transformer pretrain
with unrolled iterations before switching to the implicit backward): one shared ``last_cycle`` run for S
CPU-seconds (scored as the row ``warm-up``), then every mode continues from its weights with a fresh
optimizer for the remaining ``--cpu-seconds`` minus S, so each row has spent the same CPU time in all.
``--deq-max-iter N`` lets the "deq" modes' forward solve run up to N cycles (default: ``h_cycles``, the
other modes' schedule); their rows then also report how many of the scored puzzles' last segments reached
the solve's tolerance, and the mean f calls of that segment.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the clone's root first, so `examples.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from deqzoo.core.solvers import SOLVERS
from deqzoo.models.reasoner import ReasonerForGridClassification
from examples.reasoner import train
from examples.reasoner.evaluate import solve_rates
from examples.reasoner.puzzles import load_heldout

# name -> (grad_mode, deq overrides or None). The deq solves run at most h_cycles cycles forward (the
# other modes' schedule) with a loose tolerance, so a converged segment may stop earlier.
MODES: dict[str, tuple[str, dict | None]] = {
    "one_step": ("one_step", None),
    "last_cycle": ("last_cycle", None),
    "full": ("full", None),
    "ift": ("deq", {"f_solver": "fixed_point", "f_tol": 1e-3, "b_mode": "ift", "b_solver": "fixed_point",
                    "b_max_iter": 8, "b_tol": 1e-4}),
    "phantom": ("deq", {"f_solver": "fixed_point", "f_tol": 1e-3, "b_mode": "phantom",
                        "b_mode_kwargs": {"k": 2, "tau": 0.5}}),
    "reversible": ("deq", {"f_solver": "fixed_point", "b_mode": "reversible"}),
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the runs and the table (outside the repository)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--cpu-seconds", type=float, default=120.0, help="training CPU time per mode")
    p.add_argument("--preset", default="trm-sudoku6-mlp")
    p.add_argument("--config", default='{"h_cycles": 2, "l_cycles": 2}',
                   help="JSON overrides of the preset (h_cycles >= 2 and l_cycles >= 2 keep the modes apart)")
    p.add_argument("--pool", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--warm-start-seconds", type=float, default=0.0,
                   help="train last_cycle for this many CPU-s first and start every mode from it")
    p.add_argument("--deq-max-iter", type=int, default=None,
                   help="the deq modes' forward cycles at most (default: h_cycles)")
    p.add_argument("--ift-adjoint", default=None, metavar="SOLVER:MAX_ITER",
                   help="IFT's adjoint solve (default: fixed_point:8, to 1e-4)")
    args = p.parse_args(argv)
    if args.ift_adjoint is not None:
        try:
            adjoint_solve(args.ift_adjoint)
        except ValueError as e:
            p.error(f"--ift-adjoint: {e}")
    if not 0 <= args.warm_start_seconds < args.cpu_seconds:
        p.error(f"--warm-start-seconds must be in [0, --cpu-seconds={args.cpu_seconds:g}), got "
                f"{args.warm_start_seconds:g}")
    return args


def adjoint_solve(spec: str) -> tuple[str, int]:
    """"SOLVER:MAX_ITER" (``--ift-adjoint``) as (solver, max_iter), the solver one the engine registers."""
    solver, _, max_iter = spec.partition(":")
    if solver not in SOLVERS or not max_iter.isdigit() or int(max_iter) < 1:
        raise ValueError(f"expected SOLVER:MAX_ITER, SOLVER one of {', '.join(sorted(SOLVERS))} and "
                         f"MAX_ITER >= 1, got {spec!r}")
    return solver, int(max_iter)


def mode_config(base: dict, mode: str, deq_max_iter: int | None = None,
                ift_adjoint: str | None = None) -> dict:
    """The preset overrides for one mode of the table."""
    grad_mode, deq = MODES[mode]
    cfg = {**base, "grad_mode": grad_mode}
    if deq is not None:
        cfg["deq"] = {**deq, "f_max_iter": deq_max_iter or int(base.get("h_cycles", 3))}
    if mode == "ift" and ift_adjoint:
        solver, max_iter = adjoint_solve(ift_adjoint)
        cfg["deq"].update(b_solver=solver, b_max_iter=max_iter)
    return cfg


def final_record(out: Path) -> dict:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()][-1]


def train_run(args, out: Path, cfg: dict, cpu_seconds: float, pool_file: Path,
              init_from: Path | None = None) -> dict:
    """train.py for `cpu_seconds` of process CPU time (resuming a finished or interrupted run); its log's
    final record."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / pool_file.name).exists():
        shutil.copy(pool_file, out / pool_file.name)  # one generated pool for every mode
    argv = ["--out", str(out), "--task", "sudoku6", "--preset", args.preset, "--config", json.dumps(cfg),
            "--cpu-hours", str(cpu_seconds / 3600), "--threads", "1", "--seed", str(args.seed),
            "--pool", str(args.pool), "--eval-every", str(10**9), "--checkpoint-every", "200",
            "--no-progress"]
    if (out / "checkpoint").exists():
        argv.append("--resume")
    elif init_from is not None:
        argv += ["--init-from", str(init_from)]
    train.main(argv)
    return final_record(out)


def score(args, checkpoint: Path) -> dict:
    """Exact-solve and cell accuracy on the first --eval-size held-out puzzles at the trained budget; for a
    "deq" mode also the last segment's solve: the share of puzzles at the tolerance and its mean f calls."""
    model = ReasonerForGridClassification.from_pretrained(checkpoint)
    data = load_heldout("sudoku6_heldout")
    inputs, labels = data["inputs"][:args.eval_size], data["labels"][:args.eval_size]
    deq = model.config.grad_mode == "deq"
    if deq:
        model.set_deq(on_nonconvergence="ignore")  # measured here, not warned about
    t, solves = time.process_time(), []
    rates, _, _ = solve_rates(model, inputs, labels, model.config.halt_max_steps, "budget", solves=solves)
    row = {"exact": rates["exact"], "cells": rates["cells"]}
    if deq:  # per batch; nfe_per_sample is None where a solve keeps no per-sample count (reversible)
        calls = [s.nfe_per_sample.float() if s.nfe_per_sample is not None
                 else torch.full(s.converged.shape, float(s.nfe)) for s in solves]
        row.update(converged=round(float(torch.cat([s.converged for s in solves]).float().mean()), 4),
                   f_calls=round(float(torch.cat(calls).mean()), 2))
    return {**row, "eval_cpu_s": round(time.process_time() - t, 1)}


def run_mode(args, mode: str, pool_file: Path, warm: dict | None = None) -> dict:
    """Train one mode for the CPU budget (after the warm-up run `warm`, if any), then score it."""
    out = Path(args.out) / mode
    cfg = mode_config(json.loads(args.config), mode, args.deq_max_iter, args.ift_adjoint)
    if warm is None:
        final = train_run(args, out, cfg, args.cpu_seconds, pool_file)
        steps, cpu_s, wall_s = final["step"], final["cpu_s"], final["wall_s"]
    else:
        final = train_run(args, out, cfg, args.cpu_seconds - args.warm_start_seconds, pool_file,
                          init_from=Path(args.out) / "warm-up" / "checkpoint")
        steps, cpu_s, wall_s = (warm["step"] + final["step"], warm["cpu_s"] + final["cpu_s"],
                                warm["wall_s"] + final["wall_s"])
    return {"mode": mode, "grad_mode": cfg["grad_mode"], "deq": cfg.get("deq"),
            **score(args, out / "checkpoint"), "steps": steps, "cpu_s": round(cpu_s, 1),
            "wall_s": round(wall_s, 1)}


def markdown(table: dict) -> str:
    """The table as Markdown (the docs and README paste this)."""
    warm, solved = table.get("warm_start_seconds"), any("converged" in r for r in table["rows"])
    head = (f"Preset `{table['preset']}` with `{table['config']}`, 6×6 Sudoku, {table['cpu_seconds']:.0f} "
            f"training CPU-s per mode (one thread)")
    if warm:
        head += (f", of which the first {warm:g} are one shared `last_cycle` run (row `warm-up`, scored at "
                 f"its end) that every mode continues with a fresh optimizer")
    if table.get("deq_max_iter"):
        head += f"; the deq modes' forward solves run up to {table['deq_max_iter']} cycles"
    if table.get("ift_adjoint"):
        solver, max_iter = adjoint_solve(table["ift_adjoint"])
        head += f"; IFT's adjoint solve runs up to {max_iter} {solver} steps"
    sep = "; " if warm or table.get("deq_max_iter") or table.get("ift_adjoint") else ", "
    lines = [head + f"{sep}scored on the first {table['eval_size']} held-out puzzles at the trained budget "
             f"(halting off).", "",
             "| mode | exact-solve % | cell accuracy % | optimizer steps | training CPU-s |"
             + (" last segment at tolerance % | its f calls |" if solved else ""),
             "| --- | --- | --- | --- | --- |" + (" --- | --- |" if solved else "")]
    for r in table["rows"]:
        line = (f"| {r['mode']} | {100 * r['exact']:.1f} | {100 * r['cells']:.1f} | {r['steps']} | "
                f"{r['cpu_s']:.0f} |")
        if solved:
            line += (f" {100 * r['converged']:.1f} | {r['f_calls']:.1f} |" if "converged" in r
                     else " – | – |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; expected some of {list(MODES)}")
    # the training pool, generated once (train.py's own cache file name) and copied into each mode's folder
    pool_args = argparse.Namespace(task="sudoku6", pool=args.pool, seed=args.seed, no_progress=True)
    train.training_pool(pool_args, out)
    pool_file = out / f"pool_sudoku6_{args.pool}_{args.seed}.npz"
    rows, warm = [], None
    if args.warm_start_seconds:
        cfg = mode_config(json.loads(args.config), "last_cycle")
        warm = train_run(args, out / "warm-up", cfg, args.warm_start_seconds, pool_file)
        rows.append({"mode": "warm-up", "grad_mode": "last_cycle", "deq": None,
                     **score(args, out / "warm-up" / "checkpoint"), "steps": warm["step"],
                     "cpu_s": round(warm["cpu_s"], 1), "wall_s": round(warm["wall_s"], 1)})
        print(json.dumps(rows[-1]), flush=True)
    for mode in modes:
        rows.append(run_mode(args, mode, pool_file, warm))
        print(json.dumps(rows[-1]), flush=True)
        table = {"preset": args.preset, "config": args.config, "cpu_seconds": args.cpu_seconds,
                 "warm_start_seconds": args.warm_start_seconds, "deq_max_iter": args.deq_max_iter,
                 "ift_adjoint": args.ift_adjoint,
                 "eval_size": args.eval_size, "seed": args.seed, "rows": rows,
                 "command": None if argv is not None else
                 "PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 19 python examples/reasoner/grad_modes.py "
                 + " ".join(sys.argv[1:])}
        (out / "grad_modes.json").write_text(json.dumps(table, indent=1))
        (out / "grad_modes.md").write_text(markdown(table))
    print(markdown(table))
    return table


if __name__ == "__main__":
    main()
