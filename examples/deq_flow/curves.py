"""Held-out EPE-vs-steps curves of two (or more) train.py runs from their --keep-every snapshots.

    PYTHONPATH=. python examples/deq_flow/curves.py /work/runs/deq_flow/deq /work/runs/deq_flow/raft \
        --out examples/deq_flow/results/curves_issue32

Every OUT/snapshots/step-XXXXXX/ of every run is evaluated with `deqzoo.tasks.flow.evaluate` at its card's
settings (DEQ-Flow: make_cards.INFERENCE_DEQ, the solver settings `deqzoo/deq-flow-cpu-synth` ships with;
the explicit RAFT twin as trained, 12 updates) on the held-out pairs and the motorcycle pair. The result is
cached in the snapshot as eval.json, keyed by the settings, so a rerun only evaluates new snapshots (a
snapshot that a running training is still writing is a hidden temporary folder and is not listed). Writes
OUT.json (every run's points) and OUT.png (held-out EPE vs step, vs training wall clock and vs the training
process's CPU time, from each snapshot's snapshot.json) and prints the table at the steps every run has
reached.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import deqzoo
from deqzoo.tasks.flow import evaluate

if __package__ in (None, ""):  # run as a script: make_cards is next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_cards import INFERENCE_DEQ
else:
    from .make_cards import INFERENCE_DEQ

CACHE = "eval.json"


def snapshots(run: Path) -> list[Path]:
    """The finished snapshots of a run folder, by step."""
    folder = run / "snapshots"
    if not folder.is_dir():
        raise FileNotFoundError(f"{run}: no snapshots/ folder (train with --keep-every N)")
    return sorted(p for p in folder.glob("step-*") if p.is_dir() and (p / "snapshot.json").is_file())


def card_settings(snapshot: Path, deq: dict | None = None) -> dict | None:
    """The solver settings the model's card uses, updated by `deq` (None for the explicit twin: it runs as
    trained)."""
    config = json.loads((snapshot / "config.json").read_text())
    return {**INFERENCE_DEQ, **(deq or {})} if config.get("implicit", True) else None


def evaluate_snapshot(snapshot: Path, limit: int | None = None, deq: dict | None = None) -> dict:
    """`evaluate` of one snapshot at its card settings, cached in snapshot/eval.json per settings."""
    settings = card_settings(snapshot, deq)
    key = json.dumps({"deq": settings, "limit": limit}, sort_keys=True)
    cache_path = snapshot / CACHE
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if key not in cache:
        model = deqzoo.from_pretrained(snapshot, deq=settings)
        cache[key] = evaluate(model, limit=limit, progress=False, baselines=False)
        tmp = cache_path.with_name(f".{CACHE}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.rename(cache_path)
    meta = json.loads((snapshot / "snapshot.json").read_text())
    return {**meta, **cache[key]}


def run_curve(run: Path, limit: int | None = None, deq: dict | None = None) -> list[dict]:
    return [evaluate_snapshot(s, limit, deq) for s in snapshots(run)]


def common_table(curves: dict[str, list[dict]]) -> list[dict]:
    """Rows at the steps every run has a snapshot of: step, then each run's held-out EPE."""
    steps = set.intersection(*({p["step"] for p in pts} for pts in curves.values()))
    rows = []
    for step in sorted(steps):
        row: dict = {"step": step}
        for name, pts in curves.items():
            point = next(p for p in pts if p["step"] == step)
            row[name] = point["epe_held_out"]
        rows.append(row)
    return rows


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, pts in curves.items():
        epes = [p["epe_held_out"] for p in pts]
        axes[0].plot([p["step"] for p in pts], epes, marker=".", label=name)
        axes[1].plot([p["elapsed"] / 3600 for p in pts], epes, marker=".", label=name)
        axes[2].plot([p.get("cpu_seconds", math.nan) / 3600 for p in pts], epes, marker=".", label=name)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("training wall clock (h, 1 thread at nice 19 on a shared machine)")
    axes[2].set_xlabel("training process CPU time (h)")
    for ax in axes:
        ax.set_ylabel("held-out EPE (px, 100 pairs)")
        ax.set_yscale("log")  # step 0 (EPE ~10) and the end (~2.7) on one axis
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="train.py run folders (with snapshots/)")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    p.add_argument("--names", nargs="+", help="one label per run (default: the folder names)")
    p.add_argument("--limit", type=int, help="score only the first N held-out pairs (quick looks)")
    p.add_argument(
        "--deq", type=json.loads, default={}, help='DEQ-Flow solver overrides, JSON: {"f_max_iter": 36}'
    )
    args = p.parse_args(argv)
    names = args.names or [r.name for r in args.runs]
    if len(names) != len(args.runs) or len(set(names)) != len(names):
        p.error(f"--names needs {len(args.runs)} distinct labels, got {names}")
    report_path = args.out.with_suffix(".json")
    if report_path.exists() and "curves" not in json.loads(report_path.read_text()):
        p.error(f"{report_path} exists and is not a curves report; choose another --out")
    curves = {name: run_curve(run, args.limit, args.deq) for name, run in zip(names, args.runs)}
    rows = common_table(curves)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"runs": {n: str(r) for n, r in zip(names, args.runs)}, "limit": args.limit,
              "deq": {**INFERENCE_DEQ, **args.deq}, "curves": curves,
              "common_steps": rows}
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(curves, args.out.with_suffix(".png"))
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for row in rows:
        print(f"| {row['step']} | " + " | ".join(f"{row[n]:.4f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
