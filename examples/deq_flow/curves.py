"""Held-out EPE-vs-steps curves of two (or more) train.py runs from their --keep-every snapshots.

    PYTHONPATH=. python examples/deq_flow/curves.py /work/runs/deq_flow/deq /work/runs/deq_flow/raft \
        --out examples/deq_flow/results/curves_issue32

Every OUT/snapshots/step-XXXXXX/ of every run is evaluated with `flow.evaluate` at its card's
settings (DEQ-Flow: make_cards.INFERENCE_DEQ, the solver settings `deqzoo/deq-flow-cpu-synth` ships with;
the explicit RAFT twin as trained, 12 updates) on the held-out pairs and the motorcycle pair. The result is
cached in the snapshot as eval.json, keyed by the settings, so a rerun only evaluates new snapshots (a
snapshot that a running training is still writing is a hidden temporary folder and is not listed). Writes
OUT.json (every run's points) and OUT.png (held-out EPE vs step, vs training wall clock and vs the training
process's CPU time, from each snapshot's snapshot.json) and prints the table at the steps every run has
reached.

With `--cards DIR...` (two runs: DEQ-Flow first, its explicit twin second) it also puts the curves into those
model cards while the runs are unfinished: one section between the SECTION_START and SECTION_END markers,
inserted once before the card's "## Results" heading and replaced in place by every rerun, and OUT.png copied
to DIR/long_runs.png; nothing else in a card changes (its weights and metrics are not from these runs).
Every card is checked before any is written: a missing card, one without the markers and without that
heading, or a folder whose long_runs.png no such section wrote is refused. `--operating-point REPORT` (with
--cards) adds an `operating_point.py` report to that section: DEQ-Flow at fewer steps against the twin,
chosen on validation pairs. `--stopped WHY` says that the runs ended before their planned steps and will not
resume (instead of "in progress"), `--also REPORT...` adds a table of other pairs' curves reports (each
DEQ-Flow run against the twin of its report at the last step both have), and `--from-report OUT.json` (no run
folders) writes the section from an earlier report of this script, for runs whose folders are gone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import deqzoo
from deqzoo.hub.saving import write_whole

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_flow.flow import EVAL_SIZE, evaluate

if __package__ in (None, ""):  # run as a script: make_cards is next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_cards import INFERENCE_DEQ, ROOT, _curve_section, _deq_recipe
else:
    from .make_cards import INFERENCE_DEQ, ROOT, _curve_section, _deq_recipe

CACHE = "eval.json"
SECTION_START = "<!-- deq-flow-long-runs:start (examples/deq_flow/curves.py --cards; a rerun replaces it) -->"
SECTION_END = "<!-- deq-flow-long-runs:end -->"
SECTION_PNG = "long_runs.png"  # not curves.png: that is the published runs' own plot (make_cards --curves)
ANCHOR = "\n## Results\n"  # write_model_card's heading after the card's own body: the section goes before it


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


def evaluate_snapshot(
    snapshot: Path,
    limit: int | None = None,
    deq: dict | None = None,
    max_shift: float | None = None,
    size: tuple[int, int] | None = None,
) -> dict:
    """`evaluate` of one snapshot at its card settings, cached in snapshot/eval.json per settings (and per
    `max_shift` and `size` of the held-out pairs, when given)."""
    settings = card_settings(snapshot, deq)
    # the held-out pairs' options enter the key only when given, so earlier cached entries still hit
    pairs = {"max_shift": max_shift, "size": list(size) if size else None}
    pairs = {k: v for k, v in pairs.items() if v is not None}
    key = json.dumps({"deq": settings, "limit": limit, **pairs}, sort_keys=True)
    cache_path = snapshot / CACHE
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if key not in cache:
        model = deqzoo.from_pretrained(snapshot, deq=settings)
        cache[key] = evaluate(model, limit=limit, progress=False, baselines=False, max_shift=max_shift,
                              size=tuple(size or EVAL_SIZE))
        write_whole(cache_path, json.dumps(cache, indent=1))
    meta = json.loads((snapshot / "snapshot.json").read_text())
    return {**meta, **cache[key]}


def run_curve(run: Path, **options: Any) -> list[dict]:
    """`evaluate_snapshot(snapshot, **options)` of every snapshot of the run, in step order."""
    return [evaluate_snapshot(s, **options) for s in snapshots(run)]


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
    axes[1].set_xlabel("training wall clock (h, 1 thread, on a shared machine)")
    axes[2].set_xlabel("training process CPU time (h)")
    for ax in axes:
        ax.set_ylabel("held-out EPE (px, 100 pairs)")
        ax.set_yscale("log")  # step 0 (EPE ~10) and the end (~2.7) on one axis
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def recipe(run: Path) -> dict:
    """train.py's options of the run's first start (OUT/run.json; {} for a run without one)."""
    path = run / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _flat(recipe: dict) -> dict:
    """A run.json recipe with its dicts flattened to dotted keys and unset values (None, {}) left out, so
    that a recipe written before an option existed equals one that leaves it unset."""
    flat: dict = {}
    for key, value in recipe.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        elif value is not None:
            flat[key] = value
    return flat


def recipe_changes(recipe: dict, reference: dict) -> dict:
    """The options of `recipe` that differ from `reference`'s (both run.json recipes; the model aside)."""
    a, b = _flat(recipe), _flat(reference)
    return {k: a.get(k) for k in sorted(a.keys() | b.keys()) if k != "model" and a.get(k) != b.get(k)}


# train.py options that only DEQ-Flow's training reads: a twin that leaves them at their defaults while its
# DEQ-Flow sets them is still under the same recipe
_DEQ_ONLY = {"jac_loss_weight", "residual_loss_weight", "residual_ramp", "flow_residual_weight", "all_grad",
             "two_stage"}


def _shape(recipe: dict) -> dict:
    """What a twin must share with its DEQ-Flow run beyond the recipe: the model config and pair size."""
    return {k: v for k, v in _flat(recipe).items() if k == "size" or k.startswith("config.")}


def _is_twin(recipe: dict) -> bool:
    """A run of an explicit RAFT preset (``implicit: False``, e.g. deq-flow-cpu-raft-baseline)."""
    from deqzoo.models.deq_flow import ARCHITECTURES

    return ARCHITECTURES.get(recipe.get("model"), {}).get("config", {}).get("implicit") is False


def later_pairs(reports: dict[str, dict], reference: dict) -> list[dict]:
    """Every DEQ-Flow run of `reports` (label: curves report) against the explicit twin of its report that
    has the same model config and pair size, at the last snapshot step both have; a run pair that an earlier
    report already gave is not repeated. Each row names the options changed from `reference` (the long runs'
    DEQ-Flow recipe) for both runs and for DEQ-Flow alone."""
    rows, seen = [], set()
    for label, report in reports.items():
        recipes = report.get("recipes") or {}
        twins = [n for n in report["curves"] if _is_twin(recipes.get(n, {}))]
        for name in report["curves"]:
            if name in twins:
                continue
            same = [t for t in twins if _shape(recipes[t]) == _shape(recipes[name])]
            if len(same) != 1:
                raise ValueError(f"{label}: run {name!r} needs exactly one RAFT twin with its config and "
                                 f"pair size, found {same}")
            twin = same[0]
            key = (report["runs"][name], report["runs"][twin], json.dumps(
                [report.get(k) for k in ("limit", "deq", "max_shift", "size")], sort_keys=True))
            if key in seen:
                continue
            seen.add(key)
            points = {n: {p["step"]: p for p in report["curves"][n]} for n in (name, twin)}
            step = max(points[name].keys() & points[twin].keys())
            deq, explicit = points[name][step], points[twin][step]
            changed = recipe_changes(recipes[name], reference)
            twin_changed = recipe_changes({k: v for k, v in recipes[twin].items() if k != "deq"},
                                          {k: v for k, v in reference.items() if k != "deq"})
            both = {k: v for k, v in changed.items() if k in twin_changed and twin_changed[k] == v}
            if twin_changed.keys() - both.keys() - _DEQ_ONLY:
                extra = sorted(twin_changed.keys() - both.keys())
                raise ValueError(f"{label}: twin {twin!r} changes {extra} that {name!r} does not: not one "
                                 "recipe")
            rows.append({
                "report": label, "deq": name, "twin": twin, "step": step, "planned": recipes[name]["steps"],
                "both": both, "deq_only": {k: v for k, v in changed.items() if k not in both},
                "size": report.get("size"), "max_shift": report.get("max_shift"),
                "epe_deq": deq["epe_held_out"], "epe_twin": explicit["epe_held_out"],
                "cpu_hours": [deq["cpu_seconds"] / 3600, explicit["cpu_seconds"] / 3600],
            })
    return rows


def _changes_text(changes: dict) -> str:
    return ", ".join(f"{k} {json.dumps(v)}" for k, v in changes.items()) or "none"


def later_pairs_section(rows: list[dict]) -> str:
    """The cards' table of `later_pairs` rows."""
    lines = [
        "### Every other pair trained since, each under its own recipe",
        "",
        "Each DEQ-Flow run against the explicit RAFT twin trained beside it on the same pairs, seed and "
        "schedule, at the last snapshot both have (held-out EPE at the cards' settings, 100 pairs; a run "
        "that stopped before its planned steps is compared where it stopped). The options are those changed "
        "from the DEQ-Flow run above (`examples/deq_flow/README.md` says why each was tried).",
        "",
        "| DEQ-Flow run vs twin (report) | options changed for both / for DEQ-Flow alone | held-out pairs "
        "| step (of planned) | DEQ-Flow | twin | DEQ-Flow - twin | CPU hours (DEQ-Flow / twin) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, w = r["size"] or EVAL_SIZE
        pairs = f"{h}x{w}" + (f", shifts up to {r['max_shift']:g} px" if r["max_shift"] is not None else "")
        lines.append(
            f"| {r['deq']} vs {r['twin']} (`{r['report']}`) | {_changes_text(r['both'])} / "
            f"{_changes_text(r['deq_only'])} | {pairs} | {r['step']:,} ({r['planned']:,}) | "
            f"{r['epe_deq']:.4f} | {r['epe_twin']:.4f} | {r['epe_deq'] - r['epe_twin']:+.4f} | "
            f"{r['cpu_hours'][0]:.2f} / {r['cpu_hours'][1]:.2f} |"
        )
    behind = sum(r["epe_deq"] > r["epe_twin"] for r in rows)
    lines += ["", f"DEQ-Flow is behind its twin in {behind} of these {len(rows)} comparisons."]
    return "\n".join(lines)


def progress_section(report: dict, command: str, operating_point: str = "", stopped: str | None = None,
                     also: str = "", from_report: bool = False) -> str:
    """The cards' section on unfinished long runs: what they are (in progress, or `stopped` for the reason
    given), their one recipe, how far each got, the held-out EPE of both at every common snapshot with the
    difference, `operating_point` (the text of `operating_point.card_subsection`, if given), `also` (the
    text of `later_pairs_section`, if given) and the command that rewrites it (`from_report`: from the
    reports alone)."""
    names = list(report["curves"])
    if len(names) != 2:
        raise ValueError(f"the cards' section compares two runs (DEQ-Flow, then its twin), got {names}")
    recipes = report.get("recipes") or {}
    missing = [n for n in names if not recipes.get(n)]
    if missing:
        raise ValueError(f"no run.json recipe in the report for {missing}")
    deq, twin = names
    a, b = recipes[deq], recipes[twin]
    differ = sorted(k for k in a.keys() | b.keys() if k not in ("model", "deq") and a.get(k) != b.get(k))
    if differ:
        raise ValueError(f"runs {deq!r} and {twin!r} differ in {differ}: not one recipe and budget")
    if not report["common_steps"]:
        raise ValueError("the runs have no snapshot step in common yet")
    so_far = "; ".join(
        f"{n}: step {p['step']:,} of {recipes[n]['steps']:,}, {p['elapsed'] / 3600:.2f} h wall clock, "
        f"{p['cpu_seconds'] / 3600:.2f} h CPU"
        for n, p in ((n, report["curves"][n][-1]) for n in names)
    )
    h, w = a["size"]
    question = ("These are the long runs of issue #32 (does DEQ-Flow reach held-out EPE at or below its "
                f"explicit RAFT twin at equal training steps?): {deq} (`{a['model']}`) and {twin} "
                f"(`{b['model']}`), under one recipe and budget")
    status = (f"**Stopped; not this card's weights.** {question}. They stopped before their planned steps "
              f"and will not resume: {stopped.rstrip('.')}." if stopped else
              f"**Still training; not this card's weights.** {question}, still in progress.")
    text = [
        SECTION_START,
        f"## Long runs of issue #32, {'stopped' if stopped else 'in progress'}: held-out EPE vs training "
        "steps",
        "",
        f"{status} The weights and metrics this card publishes are NOT from these runs: they are the "
        "checkpoint described above.",
        "",
        f"**Recipe of both runs.** {_deq_recipe(a)} {twin}: the update block unrolled 12 times, RAFT's "
        f"sequence loss (γ = 0.8). Both: AdamW (lr {a['lr']:g}, weight decay {a['weight_decay']:g}), "
        f"one-cycle schedule (5% warm-up, linear decay), gradient clipping {a['clip']:g}, batch "
        f"{a['batch_size']} of {h}x{w} synthetic pairs (pair i of step s is `synthetic_pair(s * "
        f"{a['batch_size']} + i)`, the same pairs for both), {a['steps']:,} steps planned, parameter seed "
        f"{a['seed']}; 1 thread each at nice 19 (idle CPU only) on a 2-core machine shared with other jobs, "
        "so the CPU time, more than the wall clock, is the budget spent.",
        "",
        f"**{'Where they stopped' if stopped else 'So far'}** (each run's last snapshot; the table stops at "
        f"the last step both have): {so_far}.",
        "",
        _curve_section(report, every=1, heading="### Held-out EPE at every snapshot both runs have",
                       image=SECTION_PNG),
        "",
        *([operating_point, ""] if operating_point else []),
        *([also, ""] if also else []),
        ("Regenerate (from the committed reports, evaluating nothing, rewrites this section in place in both "
         "cards; then `python -m utils.catalog`):" if from_report else
         "Regenerate (evaluates only the snapshots not yet cached and rewrites this section in place in both "
         "cards; then `python -m utils.catalog`):"),
        "",
        "```bash",
        command,
        "```",
        SECTION_END,
    ]
    return "\n".join(text)


def _card_with(card: Path, section: str) -> str:
    """The card's README.md text with `section` in place of its marked one, or inserted before "## Results";
    an error naming the file when the card is missing or cannot take it."""
    readme = card / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(f"{readme}: no model card there")
    text = readme.read_text(encoding="utf-8")
    starts, ends = text.count(SECTION_START), text.count(SECTION_END)
    if (starts, ends) == (1, 1) and text.index(SECTION_START) < text.index(SECTION_END):
        i, j = text.index(SECTION_START), text.index(SECTION_END) + len(SECTION_END)
        return text[:i] + section + text[j:]
    if starts or ends:
        raise ValueError(f"{readme}: {starts} start and {ends} end markers of the long-run section, not one "
                         "pair in order; fix the card by hand")
    if text.count(ANCHOR) != 1:
        raise ValueError(f"{readme}: no long-run section markers and not exactly one '## Results' heading "
                         "to insert the section before")
    if (card / SECTION_PNG).exists():
        raise FileExistsError(f"{card / SECTION_PNG} exists and no long-run section wrote it: not "
                              "overwritten")
    i = text.index(ANCHOR) + 1
    return text[:i] + section + "\n\n" + text[i:]


def write_cards(cards: list[Path], section: str, png: Path) -> None:
    """Put `section` and `png` (as SECTION_PNG) into every card, after checking that all of them take it."""
    if not png.is_file():
        raise FileNotFoundError(f"{png}: no curves plot to copy into the cards")
    texts = [_card_with(card, section) for card in cards]  # every check before any write
    for card, text in zip(cards, texts):
        tmp = card / f".{SECTION_PNG}.part"
        shutil.copyfile(png, tmp)
        os.replace(tmp, card / SECTION_PNG)
        write_whole(card / "README.md", text)


def _shown(path: Path) -> str:
    """A path as the regenerate command shows it: relative to the repository when inside it (as given, or
    once links are resolved: `runs/` may link to a folder outside the clone)."""
    for candidate in (Path(os.path.abspath(path)), path.resolve()):
        try:
            return candidate.relative_to(ROOT).as_posix()
        except ValueError:
            pass
    return str(path)


def _section_words(args: argparse.Namespace) -> list[str]:
    """The options that shape the cards' section, as the regenerate command repeats them."""
    words = []
    if args.stopped:
        words += ["--stopped", args.stopped]
    if args.also:
        words += ["--also", *map(_shown, args.also)]
    if args.operating_point:
        words += ["--operating-point", _shown(args.operating_point)]
    return words + ["--cards", *map(_shown, args.cards)]


def regenerate_command(args: argparse.Namespace, names: list[str]) -> str:
    """The command line that rewrites the cards' section; runs that share a folder are shown under $RUNS."""
    if args.from_report:
        words = ["--from-report", _shown(args.from_report), *_section_words(args)]
        return " ".join(["PYTHONPATH=. python examples/deq_flow/curves.py", *map(shlex.quote, words)])
    parents = {Path(os.path.abspath(r)).parent for r in args.runs}
    shared = len(parents) == 1
    runs = [f"$RUNS/{shlex.quote(Path(os.path.abspath(r)).name)}" if shared else shlex.quote(_shown(r))
            for r in args.runs]  # fmt: skip
    words = ["--names", *names, "--out", _shown(args.out)]
    if args.limit:
        words += ["--limit", str(args.limit)]
    if args.deq:
        words += ["--deq", json.dumps(args.deq)]
    if args.max_shift is not None:
        words += ["--max-shift", f"{args.max_shift:g}"]
    if args.size:
        words += ["--size", *map(str, args.size)]
    words += _section_words(args)
    line = " ".join(["PYTHONPATH=. python examples/deq_flow/curves.py", *runs, *map(shlex.quote, words)])
    if args.operating_point:  # its report first: the section reads it
        op = ["PYTHONPATH=. python examples/deq_flow/operating_point.py", *runs, "--out",
              shlex.quote(_shown(args.operating_point.with_suffix("")))]
        line = " ".join(op) + "\n" + line
    folder = f"RUNS={shlex.quote(_shown(parents.pop()))}  # the runs' folder (long_runs.sh's RUNS)\n"
    return (folder if shared else "") + line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="*", help="train.py run folders (with snapshots/)")
    p.add_argument("--out", type=Path, help="writes OUT.json and OUT.png (with run folders)")
    p.add_argument("--names", nargs="+", help="one label per run (default: the folder names)")
    p.add_argument("--limit", type=int, help="score only the first N held-out pairs (quick looks)")
    p.add_argument(
        "--deq", type=json.loads, default={}, help='DEQ-Flow solver overrides, JSON: {"f_max_iter": 36}'
    )
    p.add_argument("--max-shift", type=float,
                   help="score held-out pairs drawn with this largest translation (px; train.py --max-shift)")
    p.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                   help="score held-out pairs of this size (train.py --size; default 64 64)")
    p.add_argument("--operating-point", type=Path,
                   help="an operating_point.py report (OUT.json) to add to the cards' section")
    p.add_argument("--cards", type=Path, nargs="+", default=[],
                   help="model card folders to put the unfinished runs' curves in (two runs, DEQ-Flow first)")
    p.add_argument("--stopped", metavar="WHY",
                   help="the runs ended before their planned steps and will not resume: the cards' section "
                        "says so, and why, instead of 'in progress'")
    p.add_argument("--also", type=Path, nargs="+", default=[],
                   help="other curves reports (OUT.json) whose DEQ-Flow runs the cards' section lists "
                        "against their twins")
    p.add_argument("--from-report", type=Path,
                   help="write the cards' section from this earlier report (OUT.json; OUT.png beside it) "
                        "instead of evaluating run folders: for runs whose folders are gone")
    args = p.parse_args(argv)
    if args.from_report:
        given = [f"--{k.replace('_', '-')}" for k in ("out", "names", "limit", "max_shift", "size")
                 if getattr(args, k) is not None] + (["--deq"] if args.deq else [])
        if args.runs or given:
            p.error(f"--from-report takes the runs, names and settings of its report: drop "
                    f"{[*map(str, args.runs), *given]}")
        if not args.cards:
            p.error("--from-report writes the cards' section: give --cards")
    elif not args.runs or args.out is None:
        p.error("give run folders and --out (or --from-report REPORT)")
    if (args.operating_point or args.stopped or args.also) and not args.cards:
        p.error("--operating-point, --stopped and --also shape the cards' section: give --cards too")
    if args.cards and len(args.runs) != 2 and not args.from_report:
        p.error(f"--cards compares two runs (DEQ-Flow, then its twin), got {len(args.runs)}")
    for card in args.cards:  # refuse before the evaluations, not after them
        _card_with(card, "")
    op_text = ""
    if args.operating_point:
        if __package__ in (None, ""):
            from operating_point import card_subsection
        else:
            from .operating_point import card_subsection
        op_text = card_subsection(json.loads(args.operating_point.read_text()))
    try:  # every report read, and the later pairs matched, before any evaluation
        if args.from_report:
            report = _curves_report(args.from_report)
            names = list(report["curves"])
            reference = (report.get("recipes") or {}).get(names[0], {})
        else:
            names = args.names or [r.name for r in args.runs]
            reference = recipe(args.runs[0])
            if args.out.with_suffix(".json").exists():
                _curves_report(args.out.with_suffix(".json"))
        also = later_pairs({_shown(r): _curves_report(r) for r in args.also}, reference)
    except ValueError as e:
        p.error(str(e))
    if args.from_report:
        png = args.from_report.with_suffix(".png")
    else:
        if len(names) != len(args.runs) or len(set(names)) != len(names):
            p.error(f"--names needs {len(args.runs)} distinct labels, got {names}")
        report_path, png = args.out.with_suffix(".json"), args.out.with_suffix(".png")
        options = {"limit": args.limit, "deq": args.deq, "max_shift": args.max_shift, "size": args.size}
        curves = {name: run_curve(run, **options) for name, run in zip(names, args.runs)}
        report = {"runs": {n: str(r) for n, r in zip(names, args.runs)}, "limit": args.limit,
                  "max_shift": args.max_shift, "size": args.size,
                  "deq": {**INFERENCE_DEQ, **args.deq}, "curves": curves,
                  "recipes": {n: recipe(r) for n, r in zip(names, args.runs)},
                  "common_steps": common_table(curves)}
    section = ""
    if args.cards:
        section = progress_section(report, regenerate_command(args, names), op_text, args.stopped,
                                   later_pairs_section(also) if also else "", bool(args.from_report))
    if not args.from_report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_whole(report_path, json.dumps(report, indent=1) + "\n")
        plot(report["curves"], png)
    if args.cards:
        write_cards(args.cards, section, png)
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for row in report["common_steps"]:
        print(f"| {row['step']} | " + " | ".join(f"{row[n]:.4f}" for n in names) + " |")
    return 0


def _curves_report(path: Path) -> dict:
    """A report this script wrote (OUT.json), or an error naming the file."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable curves report ({e})") from None
    if not isinstance(report, dict) or not {"curves", "runs", "common_steps"} <= report.keys():
        raise ValueError(f"{path} is not a curves report (no 'curves', 'runs' and 'common_steps'); choose "
                         "another --out or report")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
