"""Write the model cards of a trained reasoner and its one-pass twin (`model_cards/<name>/`, a Hub repository
each: config.json, model.safetensors by save_pretrained, README.md, figures).

Inputs are what the runs leave: each run folder (`train.py --out`: run.json, log.jsonl, checkpoint/ with its
trainer_state.safetensors, whose step / CPU-s / wall-s are the checkpoint's own) and evaluate.py's JSON for
each checkpoint (reasoner: ``--multiples 1,2,4,16 --halting budget,act,stability``; twin: ``--halting
budget``), optionally grad_modes.py's JSON. The card's metrics are taken from evaluate.py's JSON by
:func:`examples.reasoner.sudoku.metrics_from_report`, i.e. what ``deqzoo eval <card folder>`` prints; the JSON
must be of the same checkpoint (its path is checked) and of all 1,000 held-out puzzles.

    PYTHONPATH=. python examples/reasoner/write_card.py --out model_cards \\
        --name trm-sudoku6 --run R/t1n1 --eval R/t1n1_eval.json \\
        --twin-name trm-sudoku6-twin --twin-run R/twin --twin-eval R/twin_eval.json \\
        [--grad-modes /work/runs/grad-modes/grad_modes.json]

Nothing in the run folders is modified; an existing card folder is refused unless ``--replace`` (then only
the files written here are replaced).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the clone's root first, so `examples.*` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors import safe_open

from examples.demo import demo_entry
from examples.reasoner.puzzles import BOXES, load_heldout
from examples.reasoner.puzzles import HELDOUT as HELDOUT_SETS
from examples.reasoner.sudoku import HALTING_RULES, MULTIPLES, metrics_from_report
from utils.cards import write_model_card

HELDOUT_PUZZLES = 1000
CARD_FILES = ("README.md", "config.json", "model.safetensors", "exact_vs_segments.png", "training.png",
              "eval_results.json")

PAPERS = """Published figures, for scale only: they are **a different task** (9×9 Sudoku-Extreme, 1,000
training puzzles with heavy augmentation, GPU-days of training), not comparable with \
{n}×{n} generated puzzles:

| model | parameters | task | exact-solve |
| --- | --- | --- | --- |
| TRM (Jolicoeur-Martineau 2025, arXiv 2510.04871), MLP variant | 5M | Sudoku-Extreme 9×9 | 87.4% |
| HRM (Wang et al. 2025, arXiv 2506.21734) | 27M | Sudoku-Extreme 9×9 | 55.0% |
"""


# ----------------------------------------------------------------------------------------------- inputs
class Run:
    """One training run folder: its arguments, config, log and the checkpoint's own training counters.

    A run started from another run's weights (`train.py --init-from`) is the second stage of one training:
    `earlier_log` is the first stage's log.jsonl (its evaluations and its final record's step / CPU-s /
    wall-s). Then `step`, `cpu_s`, `wall_s` and `curve` count both stages; `stage_*` and `earlier_*` keep
    them apart."""

    def __init__(self, folder: str | Path, checkpoint: str | Path | None = None,
                 earlier_log: str | Path | None = None, counters_from_log: bool = False):
        self.folder = Path(folder)
        self.checkpoint = Path(checkpoint) if checkpoint else self.folder / "checkpoint"
        for need in (self.folder / "run.json", self.checkpoint / "config.json",
                     self.checkpoint / "model.safetensors"):
            if not need.is_file():
                raise FileNotFoundError(f"{need}: missing (a train.py run folder has run.json and "
                                        "checkpoint/{config.json,model.safetensors})")
        self.meta = json.loads((self.folder / "run.json").read_text())
        self.args = self.meta["args"]
        log = self.folder / "log.jsonl"
        records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
        state = self.checkpoint / "trainer_state.safetensors"
        self.puzzles_step = None  # the step of the puzzle count when it is not the checkpoint's own
        if state.is_file():
            with safe_open(str(state), "pt") as f:
                meta = f.metadata()
            self.step = int(meta["step"])
            info = json.loads(meta["info"])
            self.cpu_s, self.wall_s = float(info["cpu_s"]), float(info["wall_s"])
            self.puzzles = info["puzzles"]
        elif counters_from_log:
            self._counters_from_log(log, records)
        else:
            raise FileNotFoundError(f"{state}: missing; the checkpoint's step and CPU time come from it "
                                    "(or, for the weights a finished run ends with, from its log's final "
                                    "record: --counters-from-log)")
        # the curve up to this checkpoint (a later snapshot's records would describe other weights)
        self.curve = [r for r in records if "eval" in r and r["step"] <= self.step]
        self.stage_step, self.stage_cpu_s, self.stage_wall_s = self.step, self.cpu_s, self.wall_s
        self.earlier_step, self.earlier_cpu_s, self.earlier_wall_s = 0, 0.0, 0.0
        if self.args.get("init_from") and earlier_log is None:
            raise ValueError(f"{self.folder}: started from {self.args['init_from']} (--init-from); the card "
                             "needs that first stage's log.jsonl (--init-log / --twin-init-log)")
        if earlier_log is not None:
            self._add_earlier(Path(earlier_log))

    def _counters_from_log(self, log: Path, records: list[dict]) -> None:
        """Step, CPU-s and wall-s from the log's final record (train.py writes it with the last checkpoint,
        the weights a finished run ends with); the puzzle count from that record, or (logs before it held
        one) from the last record that has it, whose step is kept in `puzzles_step`."""
        final = [r for r in records if r.get("final")]
        if not final:
            raise ValueError(f"{log}: no final record; without the checkpoint's trainer_state.safetensors "
                             "only a finished run's log gives its counters")
        end = final[-1]
        self.step, self.cpu_s, self.wall_s = int(end["step"]), float(end["cpu_s"]), float(end["wall_s"])
        if "puzzles" in end:
            self.puzzles = end["puzzles"]
        else:
            counted = [r for r in records if "puzzles" in r and r["step"] <= self.step]
            if not counted:
                raise ValueError(f"{log}: no record counts the puzzles drawn")
            self.puzzles, self.puzzles_step = counted[-1]["puzzles"], counted[-1]["step"]

    def puzzles_text(self) -> str:
        """"N puzzles drawn", saying at which step when the count is not the checkpoint's."""
        at = "" if self.puzzles_step is None else f" by step {self.puzzles_step:,}, the last logged count"
        return f"{self.puzzles:,} puzzles drawn{at}"

    def _add_earlier(self, path: Path) -> None:
        """Prepend the first stage (its log's final record) to the counters and the curve."""
        if not self.args.get("init_from"):
            raise ValueError(f"{path}: {self.folder} did not start from another run's weights "
                             "(no --init-from)")
        records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        final = [r for r in records if r.get("final")]
        if not final:
            raise ValueError(f"{path}: no final record (the first stage's log ends with one)")
        end = final[-1]
        self.earlier_step, self.earlier_cpu_s, self.earlier_wall_s = (int(end["step"]), float(end["cpu_s"]),
                                                                      float(end["wall_s"]))
        shifted = [{**r, "step": r["step"] + self.earlier_step, "cpu_s": r["cpu_s"] + self.earlier_cpu_s,
                    "wall_s": r["wall_s"] + self.earlier_wall_s} for r in self.curve]
        self.curve = [r for r in records if "eval" in r and r["step"] <= self.earlier_step] + shifted
        self.step += self.earlier_step
        self.cpu_s += self.earlier_cpu_s
        self.wall_s += self.earlier_wall_s

    def commands(self, out: str) -> list[str]:
        """The train.py commands of this run, `--out` replaced by `out`: one, or the first stage's (the same
        arguments at a constant lr, to its CPU time) and then this one from its weights."""
        if not self.earlier_step:
            return [self.command(out)]
        # the first stage's budget: its CPU time, or its steps when that rounds to nothing (a short test run)
        hours = round(self.earlier_cpu_s / 3600, 2)
        first = {**self.args, "init_from": None, "schedule": "constant", "cpu_hours": hours or None,
                 "steps": self.earlier_step}
        return [self.command(f"{out}-stage1", first), self.command(out, init_from=f"{out}-stage1/checkpoint")]

    def command(self, out: str, args: dict | None = None, init_from: str | None = None) -> str:
        """The train.py command of these arguments (default: this run's), `--out` replaced by `out`."""
        a = self.args if args is None else args
        parts = ["PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 5 python examples/reasoner/train.py",
                 f"--out {out}", f"--task {a['task']}", f"--model {a['model']}", f"--preset {a['preset']}"]
        if a.get("config", "{}") != "{}":
            parts.append(f"--config '{a['config']}'")
        parts += [f"--batch-size {a['batch_size']}", f"--lr {a['lr']}", f"--weight-decay {a['weight_decay']}",
                  f"--warmup {a['warmup']}", f"--pool {a['pool']}", f"--seed {a['seed']}",
                  f"--threads {a['threads']}"]
        if a.get("schedule", "constant") != "constant":
            parts.append(f"--schedule {a['schedule']}")
        if a.get("init_from"):
            parts.append(f"--init-from {init_from or a['init_from']}")
        if a.get("cpu_hours") is not None:
            parts.append(f"--cpu-hours {a['cpu_hours']}")
        else:
            parts.append(f"--steps {self.stage_step if args is None else a['steps']}")
        parts += [f"--eval-every {a['eval_every']}", f"--eval-size {a['eval_size']}",
                  f"--checkpoint-every {a['checkpoint_every']}", "--no-progress"]
        return " ".join(parts)


def load_report(paths: str | Path | list, run: Run, *, allow_subset: bool = False) -> dict:
    """evaluate.py's JSON, checked to be of `run`'s checkpoint and of the whole held-out set. Several files
    (e.g. a halting-only rerun) merge: a later file's row replaces an earlier one of the same multiple and
    rule."""
    paths = paths if isinstance(paths, list) else [paths]
    report = None
    for path in paths:
        report = _merge(report, _load_one(path, run, allow_subset))
    return report


def _merge(report: dict | None, more: dict) -> dict:
    if report is None:
        return more
    rows = {(r["multiple"], r["halting"]): r for r in report["rows"] + more["rows"]}
    return {**report, "rows": list(rows.values())}


def _load_one(path: str | Path, run: Run, allow_subset: bool) -> dict:
    report = json.loads(Path(path).read_text())
    if Path(report["checkpoint"]).resolve() != run.checkpoint.resolve():
        raise ValueError(f"{path}: evaluates {report['checkpoint']}, not {run.checkpoint}; the card's "
                         "numbers must be of the weights it ships")
    task = run.args["task"]
    if report["heldout"] != f"{task}_heldout":
        raise ValueError(f"{path}: held-out set {report['heldout']!r}; the {task} card needs "
                         f"{task}_heldout")
    if report["puzzles"] != HELDOUT_PUZZLES and not allow_subset:
        raise ValueError(f"{path}: {report['puzzles']} puzzles; the card needs all {HELDOUT_PUZZLES} "
                         "(evaluate.py without --limit)")
    return report


# ---------------------------------------------------------------------------------------------- figures
def plot_segments(path: Path, report: dict, twin_report: dict | None, name: str,
                  twin_name: str | None) -> None:
    """Exact-solve rate against the segment budget (log axis), halting off and on, and the twin."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    apps = report["applications_per_segment"]
    for rule, style in (("budget", "o-"), ("act", "s--"), ("stability", "^--"), ("residual", "v--")):
        rows = sorted((r for r in report["rows"] if r["halting"] == rule), key=lambda r: r["multiple"])
        if not rows:
            continue
        xs = [r["segments_budget"] for r in rows]
        label = f"{name}, halting off" if rule == "budget" else f"{name}, {rule} halting (x: budget)"
        ax.plot(xs, [100 * r["exact"] for r in rows], style, label=label)
    if twin_report is not None:
        rows = sorted(twin_report["rows"], key=lambda r: r["multiple"])
        rows = [r for r in rows if r["halting"] == "budget"]
        ax.plot([r["segments_budget"] for r in rows], [100 * r["exact"] for r in rows], "x:",
                label=f"{twin_name} (one pass per segment)")
    ax.axvline(report["trained_segments"], color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"segment budget at test time (trained: {report['trained_segments']}; "
                  f"{apps} network applications per segment)")
    n = report["heldout"].removeprefix("sudoku").split("_")[0]  # "sudoku9_heldout" -> "9"
    ax.set_ylabel(f"exact-solve % ({report['puzzles']:,} held-out {n}×{n} puzzles)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_training(path: Path, runs: dict[str, Run]) -> None:
    """Held-out exact-solve during training (train.py's periodic eval) and loss, against process CPU time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.6, 3.8))
    ax, bx = fig.subplots(1, 2)
    for label, run in runs.items():
        if not run.curve:
            continue
        hours = [r["cpu_s"] / 3600 for r in run.curve]
        ax.plot(hours, [100 * r["eval"]["budget"]["exact"] for r in run.curve], "o-", ms=3, label=label)
        bx.plot(hours, [r["loss"] for r in run.curve], "-", label=label)
    ax.set_xlabel("training CPU-hours (one thread)")
    ax.set_ylabel("exact-solve % (held-out, eval during training)")
    ax.set_ylim(0, 100)
    bx.set_xlabel("training CPU-hours (one thread)")
    bx.set_ylabel("training loss (running mean)")
    bx.set_yscale("log")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------------------------------------ tables
def iterations_table(report: dict) -> str:
    apps = report["applications_per_segment"]
    lines = ["| budget | halting | exact-solve % | cell acc. % | mean segments | mean f calls "
             "| stopped early | of those, answer = the budget's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(report["rows"], key=lambda r: (r["multiple"], r["halting"] != "budget", r["halting"])):
        early = r.get("stopped_early")
        same = r.get("early_same_as_budget")
        lines.append(f"| {r['multiple']}× ({r['segments_budget']} seg.) | "
                     f"{'off' if r['halting'] == 'budget' else r['halting']} | {100 * r['exact']:.1f} | "
                     f"{100 * r['cells']:.1f} | {r['segments']:.2f} | {r['segments'] * apps:.1f} | "
                     f"{'–' if early is None else f'{100 * early:.1f}%'} | "
                     f"{'–' if same is None else f'{100 * same:.1f}%'} |")
    return "\n".join(lines)


def budgets_table(reports: list[dict], twins: list[dict] = ()) -> str:
    """Exact-solve against test-time segments for reasoners trained at other segment budgets or for longer
    (the bar's amendments and the 3-CPU-hour fallback), and for the twin at each training length: the same
    network and recipe, only `halt_max_steps` and the CPU time differ. Each report carries `trained_cpu_s`
    (the checkpoint's own process CPU time: `read_other`, or the card's own `Run`)."""
    lines = ["| network | trained segments | training CPU-hours | "
             + " | ".join(f"{k}× halting off" for k in MULTIPLES)
             + " | 4× / 16× stability halting (mean segments) |",
             "| --- | --- | --- |" + " --- |" * (len(MULTIPLES) + 1)]
    rows = [("reasoner", rep) for rep in sorted(reports, key=lambda r: (r["trained_segments"],
                                                                         r["trained_cpu_s"]))]
    rows += [("twin (one pass)", rep) for rep in sorted(twins, key=lambda r: r["trained_cpu_s"])]
    for network, rep in rows:
        rate = {(r["multiple"], r["halting"]): r for r in rep["rows"]}
        cells = [f"{100 * rate[(k, 'budget')]['exact']:.1f}" for k in MULTIPLES]
        stab = [rate.get((k, "stability")) for k in (4, 16)]
        cells.append(" / ".join(f"{100 * r['exact']:.1f} ({r['segments']:.2f})" for r in stab if r) or "–")
        lines.append(f"| {network} | {rep['trained_segments']} | {rep['trained_cpu_s'] / 3600:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_other(path: str | Path) -> dict:
    """evaluate.py's JSON at `path` with `trained_cpu_s` read from its checkpoint's trainer state (the run
    folder must exist)."""
    report = json.loads(Path(path).read_text())
    checkpoint = Path(report["checkpoint"])
    run = Run(checkpoint.parent, checkpoint)
    return {**report, "trained_cpu_s": run.cpu_s, "curve": run.curve}


def long_curves_table(reports: list[tuple[str, dict]], every_s: float = 1800.0) -> str:
    """Training curves of the runs longer than `every_s` CPU-seconds: train.py's periodic exact-solve at the
    trained budget (first 200 held-out puzzles) at the last evaluation before each multiple of `every_s`."""
    long = [(label, rep) for label, rep in reports if rep["trained_cpu_s"] > 1.2 * every_s]
    if not long:
        return ""
    marks = [every_s * k for k in range(1, int(max(rep["trained_cpu_s"] for _, rep in long) // every_s) + 1)]
    lines = ["| run | " + " | ".join(f"{m / 3600:.1f} h" for m in marks) + " |",
             "| --- |" + " --- |" * len(marks)]
    for label, rep in long:
        cells = []
        for mark in marks:
            seen = [r for r in rep["curve"] if r["cpu_s"] <= mark]
            cells.append(f"{100 * seen[-1]['eval']['budget']['exact']:.1f}" if seen else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(run: Run) -> str:
    # train.py counts puzzles per process start of --init-from: a second stage's count restarts at 0
    seen = "puzzles seen (this stage)" if run.earlier_step else "puzzles seen"
    lines = [f"| step | CPU-s | wall-s | {seen} | loss | cell acc. % | exact % (trained budget) | "
             "exact % / mean segments, ACT |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in run.curve:
        b, a = r["eval"]["budget"], r["eval"].get("act", {})
        lines.append(f"| {r['step']} | {r['cpu_s']:.0f} | {r['wall_s']:.0f} | {r.get('puzzles', '')} | "
                     f"{r['loss']:.3f} | {100 * b['cells']:.1f} | {100 * b['exact']:.1f} | "
                     + (f"{100 * a['exact']:.1f} / {a['segments']:.2f} |" if a else "– |"))
    return "\n".join(lines)


def bar(report: dict, twin_report: dict | None, run: Run, twin: Run | None,
        min_cpu_hours: float = 0.5) -> str:
    """The README's bar (fixed before the long runs), checked on these numbers; item 5's CPU-hours each are
    `min_cpu_hours` (0.5 in the 6×6 bar's amendment, 6.0 for the 9×9 runs' continuation)."""
    rate = {(r["multiple"], r["halting"]): r for r in report["rows"]}
    x1, x4, x16 = (rate.get((k, "budget"), {}).get("exact") for k in (1, 4, 16))
    out = ["| criterion | value | met |", "| --- | --- | --- |"]

    def row(text, value, ok):
        out.append(f"| {text} | {value} | {'yes' if ok else 'no'} |")

    row("1. exact-solve at the trained budget ≥ 85.0%", f"{100 * x1:.1f}%", x1 >= 0.85)
    if x4 is not None:
        row("2. at 4× ≥ 1× + 5.0 points", f"{100 * (x4 - x1):+.1f} points", x4 - x1 >= 0.05 - 1e-9)
    if x16 is not None and x4 is not None:
        row("3. at 16× no drop (≥ the 4× rate)", f"{100 * x16:.1f}% vs {100 * x4:.1f}%", x16 >= x4)
    if twin_report is not None:
        t1 = next(r["exact"] for r in twin_report["rows"] if r["multiple"] == 1 and r["halting"] == "budget")
        row("4. the twin ≥ 20.0 points below", f"{100 * (x1 - t1):.1f} points", x1 - t1 >= 0.20 - 1e-9)
    if twin is not None:
        low = min(run.cpu_s, twin.cpu_s) / 3600
        row(f"5. same CPU-hours, ≥ {min_cpu_hours:g} each",
            f"{run.cpu_s / 3600:.2f} h / {twin.cpu_s / 3600:.2f} h",
            low >= min_cpu_hours - 1e-3 and abs(run.cpu_s - twin.cpu_s) <= 0.02 * max(run.cpu_s, twin.cpu_s))
    for rule in HALTING_RULES:
        r = rate.get((1, rule))
        if r and r.get("early_same_as_budget") is not None:
            row(f"6. {rule} halting: the budget's answers where it stops early, fewer segments",
                f"{100 * r['early_same_as_budget']:.1f}% same, {r['segments']:.2f} vs "
                f"{report['trained_segments']} segments",
                r["early_same_as_budget"] >= 1.0 and r["segments"] < report["trained_segments"])
    return "\n".join(out)


def grad_mode_section(tables: list[dict]) -> str:
    """grad_modes.py's tables as one card section, each said with how its deq modes ran."""
    if not tables:
        return ""
    from examples.reasoner.grad_modes import markdown

    out = ["## Gradient modes at equal training CPU time", "",
           "`examples/reasoner/grad_modes.py`: the same preset and data stream trained for the same CPU "
           "seconds under each gradient mode, one thread. A table says which modes train this small reasoner "
           "within its budget, not which is best at convergence.", ""]
    for table in tables:
        cycles = table.get("deq_max_iter") or json.loads(table["config"]).get("h_cycles", 3)
        ift = next((r["deq"] for r in table["rows"] if r["mode"] == "ift"), None)
        adjoint = (f"; IFT's adjoint solve: up to {ift['b_max_iter']} {ift['b_solver']} steps to "
                   f"{ift['b_tol']:g}" if ift else "")
        if table.get("warm_start_seconds"):
            how = (f"**Warm-started** ({table['cpu_seconds']:g} CPU-s each): every mode continues one shared "
                   f"`last_cycle` run of {table['warm_start_seconds']:g} CPU-s, as DEQs are usually trained, "
                   f"the \"deq\" modes solving up to {cycles} cycles forward{adjoint}.")
        else:
            how = (f"**From a random start** ({table['cpu_seconds']:g} CPU-s each): the \"deq\" modes (IFT, "
                   f"phantom, reversible) solve up to {cycles} cycles forward, so IFT's gradient is taken "
                   f"far from a fixed point{adjoint}.")
        out += [how, "", markdown(table)]
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------------------- card
def _schedule_text(args: dict) -> str:
    if args.get("schedule", "constant") == "constant":
        return "constant after warmup"
    end = (f"{args['cpu_hours']:g} CPU-hours" if args.get("cpu_hours") is not None
           else f"{args['steps']:,} steps")
    return f"annealed by a cosine to 0 at {end} (`--schedule cosine`)"


def describe_model(cfg, parameters: int) -> str:
    arch = "TRM (one network for the latent and the answer)" if cfg.architecture == "trm" else \
        "HRM (an L network for the latent, an H network for the answer)"
    mixer = {"mlp": "MLP-mixer (TRM's mlp_t, a SwiGLU across positions)", "attention": "self-attention",
             "groups": "group mixer (each cell gets the means of its row, column and box: deqzoo's addition)",
             }[cfg.mixer]
    return (f"{arch}; {cfg.num_layers} post-norm blocks of {mixer} + SwiGLU, width {cfg.hidden_size}, "
            f"{cfg.pos_encodings} positions; T = h_cycles = {cfg.h_cycles} cycles of n = l_cycles = "
            f"{cfg.l_cycles} latent updates and one answer update per segment "
            f"({cfg.applications_per_segment} network applications), {cfg.halt_max_steps} segments; "
            f"{parameters:,} parameters.")


GRAD_MODE_TEXT = {
    "last_cycle": "TRM's deep supervision: each segment's loss backpropagates through the last cycle of that "
                  "segment only (the earlier cycles without a graph), the carry (y, z) detached between "
                  "segments",
    "one_step": "HRM's 1-step gradient: only the last latent and the last answer update carry a graph",
    "full": "backpropagation through every cycle of the segment (the carry detached between segments)",
    "deq": "the cycle as a fixed-point map solved by deqzoo.core.DEQ, differentiated by its backward mode",
}


def write_one(dest: Path, *, name: str, run: Run, report: dict, role: str, other_name: str | None,
              other_run: Run | None, other_report: dict | None, grad_modes: list[dict],
              other_budgets: list[dict] = (), other_twins: list[dict] = (),
              bar_cpu_hours: float = 0.5) -> Path:
    from deqzoo.models.reasoner import ReasonerForGridClassification

    task = run.args["task"]
    heldout = f"{task}_heldout"
    _, n, _, heldout_seed = HELDOUT_SETS[heldout]
    br, bc = BOXES[n]
    givens = (load_heldout(heldout)["inputs"] > 0).sum(1)

    model = ReasonerForGridClassification.from_pretrained(run.checkpoint)
    cfg = model.config
    parameters = sum(p.numel() for p in model.parameters())
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    (dest / "eval_results.json").write_text(json.dumps({**report, "checkpoint": f"model_cards/{name}"},
                                                       indent=1) + "\n")
    reasoner_report, twin_report = (report, other_report) if role == "reasoner" else (other_report, report)
    names = (name, other_name) if role == "reasoner" else (other_name, name)
    runs = {f"{names[0]} (reasoner)": run if role == "reasoner" else other_run,
            f"{names[1]} (twin)": other_run if role == "reasoner" else run}
    runs = {k: v for k, v in runs.items() if v is not None}
    if reasoner_report is not None:
        plot_segments(dest / "exact_vs_segments.png", reasoner_report, twin_report, names[0], names[1])
    plot_training(dest / "training.png", runs)
    metrics = metrics_from_report(report)
    a = run.args
    grad = GRAD_MODE_TEXT[cfg.grad_mode]
    if cfg.grad_mode == "deq":
        grad += f" (`{cfg.deq.get('b_mode', 'ift') if isinstance(cfg.deq, dict) else cfg.deq}`)"
    if role == "reasoner":
        intro = (f"A recursive reasoner (TRM-style, deqzoo's `reasoner` family) trained on 2 shared CPU "
                 f"cores for {run.cpu_s / 3600:.2f} CPU-hours to solve generated {n}×{n} Sudoku "
                 f"({br}×{bc} boxes). "
                 + describe_model(cfg, parameters)
                 + (f" Its one-pass twin, `{other_name}`, has exactly the same parameters, applied once."
                    if other_name else ""))
    else:
        intro = (f"The explicit one-pass twin of `{other_name}`: the same network and parameter count "
                 f"({parameters:,}), applied once (one segment of one cycle of one latent update and one "
                 f"answer update), trained with full backpropagation for {run.cpu_s / 3600:.2f} CPU-hours. "
                 "It is the reasoner without recursion or deep supervision: the comparison measures what "
                 "the recursion buys at equal parameters and CPU time.")
    sections = [intro, ""]
    sections += ["## Data", "",
                 f"Training: a pool of {a['pool']:,} minimal {n}×{n} puzzles generated from seed {a['seed']} "
                 "by `examples/reasoner/puzzles.py` (a random full grid, then givens removed in random order "
                 "while the solution stays unique, down to a puzzle where no given can be removed), the "
                 "held-out grids removed from the pool, augmented on the fly (digit relabelling, row/column "
                 "permutations inside bands/stacks, band/stack permutations"
                 + (", transposition" if br == bc else "") + "). Held-out: "
                 f"`examples/reasoner/data/{heldout}.npz`, {len(givens):,} minimal puzzles from seed "
                 f"{heldout_seed} (givens: mean {givens.mean():.1f}, min {givens.min()}, "
                 f"max {givens.max()}), "
                 "stored in the repository. A pool puzzle may still be a "
                 "relabelled or permuted copy of a held-out one (exact grids only are removed).", ""]
    sections += ["## Recipe", "",
                 f"Gradient: **{cfg.grad_mode}** — {grad}. Batch {a['batch_size']} puzzle slots, one "
                 f"segment per optimizer step (a slot is refilled after {cfg.halt_max_steps} segments or "
                 f"when its Q-head halts it, exploration {cfg.halt_exploration_prob}), AdamW (β 0.9/0.95, "
                 f"weight decay {a['weight_decay']} on matrices), lr {a['lr']} with {a['warmup']} warmup "
                 f"steps, gradient clipping 1.0, seed {a['seed']}, {a['threads']} thread. "
                 + (f"Trained {run.step:,} optimizer steps ({run.puzzles_text()}) in "
                    if not run.earlier_step else
                    f"Trained in two stages: {run.earlier_step:,} steps at a constant lr "
                    f"({run.earlier_cpu_s:,.0f} CPU-s), then from those weights with a fresh optimizer, "
                    f"{a['warmup']} warmup steps and the lr {_schedule_text(a)}, {run.stage_step:,} steps "
                    f"({run.stage_cpu_s:,.0f} CPU-s, {run.puzzles_text()}): {run.step:,} steps in ")
                 + f"**{run.cpu_s:,.0f} CPU-s ({run.cpu_s / 3600:.2f} CPU-hours)**, {run.wall_s:,.0f} s wall "
                 "on a shared 2-core machine"
                 + (": the wall time is mostly waiting." if run.wall_s > 1.5 * run.cpu_s else "."), ""]
    if role == "reasoner":
        sections += ["## Exact-solve against test-time iterations", "",
                     f"`examples/reasoner/evaluate.py` on all {report['puzzles']:,} held-out puzzles; 1× = "
                     f"the trained {report['trained_segments']} segments; one segment is "
                     f"{report['applications_per_segment']} network applications (f calls). Halting rules "
                     "stop each puzzle on its own after a segment: `act` (the Q-head's halt logit > 0), "
                     f"`stability` (answer unchanged for {cfg.halt_patience} segments).", "",
                     iterations_table(report), "",
                     "![exact-solve against the segment budget](exact_vs_segments.png)", ""]
        if other_report is not None:
            sections += [f"The twin `{other_name}` (1 segment = 1×):", "", iterations_table(other_report), ""]
        sections += ["## The bar (fixed in examples/reasoner/README.md before the long runs)", "",
                     bar(report, other_report, run, other_run, bar_cpu_hours), ""]
        if other_budgets or other_twins:  # a longer twin alone still gets its rows
            sections += ["## Other trained budgets (the bar's amendments and its 3-CPU-hour fallback, not "
                         "published)", "",
                         "The same network, recipe and seed, trained at other segment budgets or for longer "
                         "(`examples/reasoner/results/`, README \"The bar\"), and the twin at each training "
                         "length; exact-solve % on all 1,000 held-out puzzles, 1× = the trained segments, "
                         "CPU-hours = the checkpoint's process CPU time:", "",
                         budgets_table([{**report, "trained_cpu_s": run.cpu_s}, *other_budgets],
                                       [{**other_report, "trained_cpu_s": other_run.cpu_s}, *other_twins]
                                       if other_report is not None else list(other_twins)), ""]
            labelled = [(f"reasoner, {r['trained_segments']} segments", r) for r in other_budgets]
            curves = long_curves_table(labelled + [("twin (one pass)", r) for r in other_twins])
            if curves:
                sections += ["Training curves of the longer runs: train.py's exact-solve % at the trained "
                             "budget on the first 200 held-out puzzles, at the last evaluation before each "
                             "half CPU-hour:", "", curves, ""]
    else:
        sections += ["## Exact-solve against test-time iterations", "",
                     "Rerunning the one pass on its own output (2×, 4×, 16× segments):", "",
                     iterations_table(report), ""]
        if other_report is not None:
            sections += ["![exact-solve against the segment budget](exact_vs_segments.png)", ""]
    sections += ["## Training curves", "",
                 "Held-out exact-solve measured during training (train.py's periodic evaluation on the first "
                 f"{a['eval_size']} held-out puzzles) against process CPU time:", "",
                 "![training curves](training.png)", ""]
    for label, r in runs.items():
        if r.curve:
            sections += [f"{label}:", "", curve_table(r), ""]
    sections += ["## Commands", "", "Both trainings (resumable: the same command with `--resume`):", "",
                 "```bash"]
    for label, r in runs.items():
        short = label.split(" ")[0]
        sections += r.commands(f"runs/{short}")
    sections += ["```", "", "Evaluation (the JSON in `eval_results.json`):", "", "```bash"]
    for label in runs:
        short = label.split(" ")[0]
        halting = "budget,act,stability" if "reasoner" in label else "budget"
        sections.append(f"PYTHONPATH=. python examples/reasoner/evaluate.py runs/{short}/checkpoint "
                        f"--heldout {heldout} --multiples {','.join(map(str, MULTIPLES))} "
                        f"--halting {halting} > runs/{short}_eval.json")
    sections += ["```", ""]
    sections += [grad_mode_section(grad_modes)] if grad_modes else []  # the reasoner's card only
    sections += ["## Published reasoners", "", PAPERS.format(n=n), "",
                 "## Use", "", "```python", "import torch", "import deqzoo",
                 "from examples.reasoner.puzzles import load_heldout", "",
                 f'model = deqzoo.from_pretrained("deqzoo/{name}").eval()',
                 f'x = torch.from_numpy(load_heldout("{heldout}")["inputs"][:4].astype("int64"))',
                 'out = model(x, num_segments=4 * model.config.halt_max_steps, halting="stability")',
                 "answer, segments = out.logits.argmax(-1), out.steps  # digits 1..6 per cell, segments run",
                 "```", ""]
    metric_list = [{"type": key, "name": _metric_name(key, cfg.halt_max_steps), "value": value}
                   for key, value in metrics.items()]
    card = dict(
        model_id=f"deqzoo/{name}",
        title=f"{name}: {'recursive reasoner' if role == 'reasoner' else 'one-pass twin'} for {n}×{n} Sudoku",
        pipeline_tag="token-classification", task_module=task, datasets=[f"{task}-generated"],
        dataset_name=f"{n}×{n} Sudoku, {len(givens):,} held-out",  # short: the catalog row quotes it
        metrics=metric_list, tags=["reasoner", "trm", "recursive-reasoning", "sudoku"],
        train_command=" && ".join(run.commands(f"runs/{name}")), eval_command=f"deqzoo eval deqzoo/{name}",
        body_markdown="\n".join(sections))
    write_model_card(dest, **card)  # the demo reads the card's task: write it, then add what the demo shows
    return write_model_card(dest, **card, demo=demo_entry(dest))


def _metric_name(key: str, trained: int) -> str:
    what, *rule, multiple = key.split("_")
    k = int(multiple[:-1])
    where = f"at {k}× segments ({k * trained})"
    if what == "cells":
        return f"cell accuracy {where}, halting off"
    if what == "segments":
        return f"mean segments with {rule[0]} halting, budget {trained}"
    return f"exact-solve {where}, " + (f"{rule[0]} halting" if rule else "halting off")


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="model_cards", help="the folder the card folders go into")
    p.add_argument("--name", required=True)
    p.add_argument("--run", required=True, help="the reasoner's train.py --out folder")
    p.add_argument("--checkpoint", default=None, help="default: RUN/checkpoint")
    p.add_argument("--eval", required=True, action="append", help="evaluate.py's JSON of that checkpoint "
                   "(repeat to merge several)")
    p.add_argument("--twin-name", default=None)
    p.add_argument("--twin-run", default=None)
    p.add_argument("--twin-checkpoint", default=None)
    p.add_argument("--twin-eval", default=None, action="append")
    p.add_argument("--grad-modes", default=[], action="append", help="grad_modes.py's grad_modes.json "
                   "(repeatable: one table each)")
    p.add_argument("--other-budget", default=[], action="append", help="evaluate.py's JSON of a reasoner "
                   "trained at another segment budget (repeatable): a table in the reasoner's card")
    p.add_argument("--other-twin", default=[], action="append", help="evaluate.py's JSON of the twin "
                   "trained for another CPU time (repeatable): rows of the same table")
    p.add_argument("--init-log", default=None, help="the first stage's log.jsonl when --run started from "
                   "its weights (train.py --init-from)")
    p.add_argument("--twin-init-log", default=None, help="the same for --twin-run")
    p.add_argument("--bar-cpu-hours", type=float, default=0.5, help="bar item 5's CPU-hours per network "
                   "(examples/reasoner/README.md: 0.5 for the 6×6 amendment, 6.0 for the 9×9 continuation)")
    p.add_argument("--counters-from-log", action="store_true", help="checkpoints without their "
                   "trainer_state.safetensors (the final weights of finished runs): step, CPU-s and wall-s "
                   "from each run's log's final record")
    p.add_argument("--replace", action="store_true", help="replace this writer's files in existing folders")
    p.add_argument("--allow-subset", action="store_true", help="accept a report on part of the held-out set "
                   "(tests only: `deqzoo eval` scores all of it)")
    args = p.parse_args(argv)
    twin_args = [args.twin_name, args.twin_run, args.twin_eval]
    if any(twin_args) and not all(twin_args):
        p.error("--twin-name, --twin-run and --twin-eval go together")
    dests = [Path(args.out) / args.name] + ([Path(args.out) / args.twin_name] if args.twin_name else [])
    for dest in dests:
        if dest.exists() and any(dest.iterdir()) and not args.replace:
            p.error(f"{dest} exists and is not empty; pass --replace to rewrite its card files "
                    f"({', '.join(CARD_FILES)})")
    run = Run(args.run, args.checkpoint, args.init_log, args.counters_from_log)
    report = load_report(args.eval, run, allow_subset=args.allow_subset)
    twin = twin_report = None
    if args.twin_name:
        twin = Run(args.twin_run, args.twin_checkpoint, args.twin_init_log, args.counters_from_log)
        twin_report = load_report(args.twin_eval, twin, allow_subset=args.allow_subset)
    grad_modes = [json.loads(Path(g).read_text()) for g in args.grad_modes]
    written = [write_one(dests[0], name=args.name, run=run, report=report, role="reasoner",
                         other_name=args.twin_name, other_run=twin, other_report=twin_report,
                         grad_modes=grad_modes,
                         other_budgets=[read_other(b) for b in args.other_budget],
                         other_twins=[read_other(b) for b in args.other_twin],
                         bar_cpu_hours=args.bar_cpu_hours)]
    if twin is not None:
        written.append(write_one(dests[1], name=args.twin_name, run=twin, report=twin_report, role="twin",
                                 other_name=args.name, other_run=run, other_report=report,
                                 grad_modes=[]))
    for path in written:
        print(f"wrote {path.parent}")
    return written


if __name__ == "__main__":
    main()
