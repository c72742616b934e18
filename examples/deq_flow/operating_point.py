"""DEQ-Flow's operating point against its explicit RAFT twin at the long runs' snapshots (issue #32, item 1).

    PYTHONPATH=. python examples/deq_flow/operating_point.py runs/deq_flow/deq-flow-i32 \
        runs/deq_flow/raft-i32 --out examples/deq_flow/results/operating_point_issue32

Issue #32 asks for the iterations (or tolerance) at which DEQ-Flow costs no more time than its twin for no
worse EPE. At every snapshot step both runs have (from --min-step), DEQ-Flow is evaluated with at most k
fixed-point steps for each k of --iters (the card's tolerance otherwise, `make_cards.INFERENCE_DEQ`; its
solves rarely stop before the cap) and the twin as trained (12 updates), on

* validation pairs, which choose k: --val-pairs training-distribution pairs
  (`synthetic_pair(seed, split="train")`, seeds from 10**7: training draws pair i of step s as seed
  8 s + i < 160,000, so it never sees them);
* the held-out pairs and the motorcycle pair (`examples.deq_flow.flow.evaluate`, what the cards report), which
  do not: choosing k on the pairs that are then reported would flatter the DEQ.

Time per pair of each k and of the twin is measured at the last common snapshot: batches of 25 validation
pairs, one thread, --rounds interleaved rounds (the order alternates), medians. The operating point is the k
with the lowest mean validation EPE over the evaluated steps among those whose time is at most the twin's.
Results are cached per snapshot (validation.json beside curves.py's eval.json), so a rerun evaluates only
new snapshots and settings. Writes OUT.json and OUT.png (validation EPE against k at the last step;
held-out EPE against step at the operating point, at the card's 24 steps and of the twin) and prints the
table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import deqzoo
from deqzoo.hub.saving import write_whole

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_flow.flow import epe, model_flow, synthetic_batch

if __package__ in (None, ""):  # run as a script: its neighbours are importable from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from curves import evaluate_snapshot, snapshots
    from make_cards import INFERENCE_DEQ
else:
    from .curves import evaluate_snapshot, snapshots
    from .make_cards import INFERENCE_DEQ

VAL_SEED = 10**7  # far beyond any training pair's seed (8 * 20,000 steps)
VAL_CACHE = "validation.json"
CARD_ITERS = INFERENCE_DEQ["f_max_iter"]


def validation_set(n: int) -> tuple[torch.Tensor, ...]:
    """image1, image2, flow, valid of the n validation pairs."""
    return synthetic_batch(range(VAL_SEED, VAL_SEED + n), (64, 64), "train")


def settings(iters: int | None) -> dict | None:
    """DEQ-Flow's solver settings with at most `iters` steps; None (the twin, as trained) for None."""
    return None if iters is None else {**INFERENCE_DEQ, "f_max_iter": iters}


def load(snapshot: Path, iters: int | None):
    return deqzoo.from_pretrained(snapshot, deq=settings(iters))


def validation_epe(snapshot: Path, iters: int | None, val: tuple[torch.Tensor, ...]) -> float:
    """Validation EPE of one snapshot at `iters`, cached in snapshot/validation.json per settings and set."""
    key = json.dumps({"deq": settings(iters), "seeds": [VAL_SEED, len(val[0])]}, sort_keys=True)
    path = snapshot / VAL_CACHE
    cache = json.loads(path.read_text()) if path.is_file() else {}
    if key not in cache:
        pred, _ = model_flow(load(snapshot, iters), val[0], val[1])
        cache[key] = epe(pred, val[2], val[3])
        write_whole(path, json.dumps(cache, indent=1))
    return cache[key]


def seconds_per_pair(models: dict[str, torch.nn.Module], val: tuple[torch.Tensor, ...], rounds: int
                     ) -> dict[str, float]:
    """Median seconds per pair of each model over `rounds` interleaved rounds (order alternating)."""
    names, times = list(models), {name: [] for name in models}
    batch = (val[0][:25], val[1][:25])
    with torch.no_grad():
        for name in names:  # warm-up: first calls allocate
            models[name].eval()(*batch)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                models[name](*batch)
                times[name].append((time.perf_counter() - start) / len(batch[0]))
    return {name: statistics.median(t) for name, t in times.items()}


def choose(val_epe: dict[int, float], time_ratio: dict[int, float]) -> int | None:
    """The k of lowest validation EPE among those costing at most the twin's time (None: no k does)."""
    affordable = [k for k in val_epe if time_ratio[k] <= 1.0]
    return min(affordable, key=lambda k: (val_epe[k], k)) if affordable else None


def analyse(deq_run: Path, twin_run: Path, iters: list[int], *, min_step: int = 0, val_pairs: int = 200,
            rounds: int = 5, limit: int | None = None) -> dict:
    """Every number of the report (see the module docstring)."""
    deq_snaps = {int(s.name[5:]): s for s in snapshots(deq_run)}
    twin_snaps = {int(s.name[5:]): s for s in snapshots(twin_run)}
    steps = sorted(s for s in deq_snaps.keys() & twin_snaps.keys() if s >= min_step)
    if not steps:
        raise ValueError(f"{deq_run} and {twin_run} have no snapshot step >= {min_step} in common")
    iters = sorted(set(iters) | {CARD_ITERS})
    val = validation_set(val_pairs)
    rows = []
    for step in steps:
        row = {"step": step, "twin": {"val": validation_epe(twin_snaps[step], None, val),
                                      **_held_out(evaluate_snapshot(twin_snaps[step], limit))}, "deq": {}}
        for k in iters:
            held = evaluate_snapshot(deq_snaps[step], limit, deq={"f_max_iter": k})
            row["deq"][str(k)] = {"val": validation_epe(deq_snaps[step], k, val), **_held_out(held)}
        rows.append(row)
    last = steps[-1]
    models = {"twin": load(twin_snaps[last], None), **{str(k): load(deq_snaps[last], k) for k in iters}}
    per_pair = seconds_per_pair(models, val, rounds)
    ratio = {k: per_pair[str(k)] / per_pair["twin"] for k in iters}
    mean_val = {k: statistics.fmean(r["deq"][str(k)]["val"] for r in rows) for k in iters}
    best = choose(mean_val, ratio)
    twin_val = statistics.fmean(r["twin"]["val"] for r in rows)
    return {
        "runs": {"deq": str(deq_run), "twin": str(twin_run)}, "iters": iters, "steps": steps,
        "validation": {"seed": VAL_SEED, "pairs": val_pairs}, "held_out_limit": limit,
        "card_deq": INFERENCE_DEQ, "rows": rows,
        "timing": {"step": last, "rounds": rounds, "seconds_per_pair": per_pair,
                   "ratio_to_twin": {str(k): v for k, v in ratio.items()}},
        "mean_val_epe": {"twin": twin_val, **{str(k): v for k, v in mean_val.items()}},
        "operating_point": best,
        "no_worse_on_validation": None if best is None else mean_val[best] <= twin_val,
        "steps_at_or_below_twin_held_out": [] if best is None else [
            r["step"] for r in rows if r["deq"][str(best)]["held_out"] <= r["twin"]["held_out"]],
        "steps_at_or_below_twin_val": [] if best is None else [
            r["step"] for r in rows if r["deq"][str(best)]["val"] <= r["twin"]["val"]],
    }


def _held_out(result: dict) -> dict:
    return {"held_out": result["epe_held_out"], "motorcycle": result["epe_motorcycle"],
            "converged": result.get("converged_held_out")}


def table(report: dict) -> str:
    """Markdown: per step, the twin's and DEQ-Flow's validation / held-out / motorcycle EPE at the operating
    point and at the card's cap."""
    k = report["operating_point"]
    shown = [x for x in (k, CARD_ITERS) if x is not None]
    head = "| step | twin val / held-out / motorcycle | " + " | ".join(
        f"DEQ-Flow {x} steps val / held-out / motorcycle" for x in shown)
    lines = [head + " |", "|---" * (2 + len(shown)) + "|"]

    def cell(d: dict) -> str:
        return f"{d['val']:.4f} / {d['held_out']:.4f} / {d['motorcycle']:.4f}"

    for r in report["rows"]:
        cells = [cell(r["twin"])] + [cell(r["deq"][str(x)]) for x in shown]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def card_subsection(report: dict) -> str:
    """The operating point for the cards' long-run section (`curves.py --operating-point REPORT`): the
    timing, the validation means, the choice and, per step, validation, held-out and motorcycle EPE."""
    k, timing, mean, pairs = (report[x] for x in ("operating_point", "timing", "mean_val_epe", "validation"))
    steps = f"{report['steps'][0]:,}-{report['steps'][-1]:,}"
    costs = ", ".join(f"{x}: {timing['ratio_to_twin'][str(x)]:.2f}" for x in report["iters"])
    means = ", ".join(f"{x} steps {mean[str(x)]:.4f}" for x in report["iters"])
    if k is None:
        verdict = "No k costs at most the twin's time, so there is no operating point."
    else:
        worse = "at or below" if report["no_worse_on_validation"] else "above"
        held = report["steps_at_or_below_twin_held_out"]
        val = report["steps_at_or_below_twin_val"]
        verdict = (
            f"The operating point is **{k} steps**: the lowest mean validation EPE among the k that cost at "
            f"most the twin's time. There DEQ-Flow's mean validation EPE is **{worse}** the twin's "
            f"({mean[str(k)]:.4f} against {mean['twin']:.4f}). Per step, DEQ-Flow at {k} steps is at or "
            f"below the twin at {_steps(val)} on validation and at {_steps(held)} on the held-out pairs."
        )
        rows = report["rows"]
        moto = [r["step"] for r in rows if r["deq"][str(k)]["motorcycle"] <= r["twin"]["motorcycle"]]
        verdict += (
            " On the real motorcycle pair (one pair, larger motion than training) it is at or below the "
            f"twin at {len(moto)} of the {len(rows)} steps ({_steps(moto)})."
        )
    return "\n".join([
        f"### Operating point: DEQ-Flow at fewer steps, chosen on validation pairs (steps {steps})",
        "",
        "`examples/deq_flow/operating_point.py` evaluates DEQ-Flow with at most k fixed-point steps (the "
        f"card's tolerance otherwise) on {pairs['pairs']} validation pairs: training-distribution pairs from "
        f"seed {pairs['seed']:,}, which training never draws. These pairs choose k, and the held-out pairs "
        "are only reported, since choosing k on them would flatter the DEQ. Time "
        f"per pair relative to the twin's 12 updates, at step {timing['step']:,} (one thread, "
        f"{timing['rounds']} interleaved rounds, medians): {costs}. Mean validation EPE: twin "
        f"{mean['twin']:.4f}; DEQ-Flow {means}. {verdict}",
        "",
        table(report),
    ])


def _steps(steps: list[int]) -> str:
    return "no step" if not steps else "step" + ("s " if len(steps) > 1 else " ") + ", ".join(
        f"{s:,}" for s in steps)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    last = report["rows"][-1]
    ks = report["iters"]
    a.plot(ks, [last["deq"][str(k)]["val"] for k in ks], marker="o", label="DEQ-Flow, at most k steps")
    a.axhline(last["twin"]["val"], color="C1", ls="--", label="RAFT twin, 12 updates")
    a.set_xlabel("k (fixed-point steps)")
    a.set_ylabel(f"validation EPE (px, {report['validation']['pairs']} pairs)")
    a.set_title(f"step {last['step']}; time / twin's: " + ", ".join(
        f"{k}: {report['timing']['ratio_to_twin'][str(k)]:.2f}" for k in ks), fontsize=8)
    steps = [r["step"] for r in report["rows"]]
    b.plot(steps, [r["twin"]["held_out"] for r in report["rows"]], "C1--", marker=".", label="RAFT twin")
    for k, style in ((report["operating_point"], "C0-"), (CARD_ITERS, "C2:")):
        if k is not None:
            b.plot(steps, [r["deq"][str(k)]["held_out"] for r in report["rows"]], style, marker=".",
                   label=f"DEQ-Flow, {k} steps")
    b.set_xlabel("training step")
    b.set_ylabel("held-out EPE (px, 100 pairs)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("deq_run", type=Path)
    p.add_argument("twin_run", type=Path)
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    p.add_argument("--iters", type=int, nargs="+", default=[6, 8, 10, 12, 16])
    p.add_argument("--min-step", type=int, default=2000, help="first snapshot step to evaluate")
    p.add_argument("--val-pairs", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--limit", type=int, help="score only the first N held-out pairs (quick looks)")
    args = p.parse_args(argv)
    if any(k < 1 for k in args.iters) or args.val_pairs < 1 or args.rounds < 1:
        p.error("--iters, --val-pairs and --rounds must be >= 1")
    out_json = args.out.with_suffix(".json")
    ours = out_json.exists() and "operating_point" in json.loads(out_json.read_text())
    for existing in (out_json, args.out.with_suffix(".png")):  # its PNG goes with a report of ours only
        if existing.exists() and not ours:
            p.error(f"{existing} exists and is not from an operating_point.py report; choose another --out")
    torch.set_num_threads(1)
    report = analyse(args.deq_run, args.twin_run, args.iters, min_step=args.min_step,
                     val_pairs=args.val_pairs, rounds=args.rounds, limit=args.limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_whole(out_json, json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(table(report))
    print(json.dumps({k: report[k] for k in ("timing", "mean_val_epe", "operating_point",
                                             "no_worse_on_validation", "steps_at_or_below_twin_held_out",
                                             "steps_at_or_below_twin_val")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
