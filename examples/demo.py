"""`deqzoo demo` (run from a clone): every embedded checkpoint offline on its task's samples with every
registered solver; a table that fits 100 columns, one residual-vs-iteration PNG per model that solves
(tolerance drawn), the task's own figures and index.html showing them all. The pieces the task modules share
are here too: a summary that carries a short metric for the table, the residual figure, the HTML page.

Figures are built on `matplotlib.figure.Figure` (no pyplot: no global state, no GUI backend) and returned, so
tests inspect the axes rather than pixels.
"""

from __future__ import annotations

import html
import json
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from deqzoo.cli import CLIError, load_checkpoint
from examples.tasks import task_module

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from deqzoo.core import SolverStats


def format_table(rows: list[list[str]], header: list[str], width: int | None = None,
           shrink: dict[int, int] | None = None) -> str:
    """Columns two spaces apart, a dashed rule under the header. With `width`, the columns in `shrink` (column
    -> narrowest width, in the order given) are narrowed, then any column down to 4, and their cells wrapped
    onto continuation lines until the table fits; no cell's text is lost."""
    cells = [header, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    gap = 2
    order = [*(shrink or {}).items(), *((i, 4) for i in range(len(widths)))]
    for column, narrowest in order if width is not None else ():
        excess = sum(widths) + gap * (len(widths) - 1) - width
        if excess <= 0:
            break
        widths[column] = max(min(narrowest, widths[column]), widths[column] - excess)

    def lines_of(row: list[str]) -> list[str]:
        wrapped = [textwrap.wrap(str(c), w, break_long_words=True, break_on_hyphens=True) or [""]
                   for c, w in zip(row, widths)]
        out = []
        for k in range(max(len(w) for w in wrapped)):
            parts = [(w[k] if k < len(w) else "").ljust(n) for w, n in zip(wrapped, widths)]
            out.append((" " * gap).join(parts).rstrip())
        return out

    lines = lines_of(header) + [(" " * gap).join("-" * w for w in widths)]
    for row in rows:
        lines += lines_of(row)
    return "\n".join(lines)


class DemoSummary(str):
    """A task demo's one-line summary (a `str`, as the task protocol returns) that also carries `metric`: the
    task's headline number in a few words ("10/10 correct", "EPE 0.52 px"), what `deqzoo demo`'s table shows
    where the whole line would not fit."""

    metric: str

    def __new__(cls, text: str, metric: str) -> DemoSummary:
        self = super().__new__(cls, text)
        self.metric = metric
        return self


def demo_metric(summary: str, width: int = 40) -> str:
    """The table's metric for a demo summary: its `metric` when the task gave one, else the summary itself,
    shortened to `width` characters (tasks outside deqzoo return plain strings)."""
    metric = getattr(summary, "metric", None)
    if metric:
        return str(metric)
    text = " ".join(str(summary).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def has_solve(stats: SolverStats | None) -> bool:
    """Whether a demo's statistics come from a fixed-point solve; an explicit network (the RAFT twin, an
    explicit INR) reports `SolverStats.no_solve()` (solver "none", no evaluations) or nothing."""
    return stats is not None and stats.solver != "none" and (stats.nfe > 0 or stats.trace.numel() > 0)


def residual_figure(traces: dict[str, SolverStats], title: str) -> Figure:
    """Per-iteration residual (log scale) of each solve in `traces` (label -> its statistics), with a dashed
    horizontal line at each distinct tolerance (f_tol, in the solve's stop mode): a curve that ends below its
    line converged. Raises ValueError when no solve has a trace (a model without a solve gets no plot)."""
    from matplotlib.figure import Figure

    drawn = {label: s for label, s in traces.items() if has_solve(s) and s.trace.numel() > 0}
    if not drawn:
        raise ValueError(f"{title}: no solve with a residual trace to plot (labels: {sorted(traces)})")
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    for label, s in drawn.items():
        # a residual of exactly 0 has no place on a log axis: drawn a decade below the smallest other value
        positive = [float(v) for v in s.trace if float(v) > 0]
        floor = min(positive) / 10 if positive else 1e-12
        values = [float(v) if float(v) > 0 else floor for v in s.trace]
        state = "converged" if bool(s.converged.all()) else "not converged"
        ax.semilogy(range(1, len(values) + 1), values, marker=".",
                    label=f"{label}: {s.nfe} NFE, {state}")
    tolerances = sorted({(float(s.tol), s.stop_mode) for s in drawn.values() if float(s.tol) > 0})
    for tol, mode in tolerances:
        ax.axhline(tol, color="black", linestyle="--", linewidth=1.0,
                   label=f"tolerance f_tol={tol:.0e} ({mode})")
    modes = sorted({s.stop_mode for s in drawn.values()})
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"max {'/'.join(modes)} residual")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write a figure as PNG (the demo's folder is the demo's own: its files are replaced on every run)."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #bbb; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }}
th {{ background: #eee; }}
figure {{ display: inline-block; margin: 0.5em; vertical-align: top; }}
figcaption {{ font-family: monospace; font-size: 0.85em; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{title}</h1>
{intro}
<table>
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
{images}
</body>
</html>
"""


def write_index(
    path: str | Path,
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    images: dict[str, list[Path]],
    title: str = "deqzoo demo",
    intro: str = "",
) -> Path:
    """Write `path` (index.html): the table (`header`, `rows`) and, per section of `images` (title -> PNG
    paths), every image with its file name as caption. Images are linked relative to the page (they must lie
    in its folder); all text is escaped; no script, no network."""
    path = Path(path)
    folder = path.parent.resolve()
    esc = lambda value: html.escape(str(value), quote=True)  # noqa: E731
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    sections = []
    for section, pngs in images.items():
        if not pngs:
            continue
        figures = []
        for png in pngs:
            png = Path(png)
            if png.resolve().parent != folder:
                raise ValueError(f"{png}: the page {path} links images in its own folder only")
            figures.append(f'<figure><a href="{esc(quote(png.name))}"><img src="{esc(quote(png.name))}" '
                           f'alt="{esc(png.name)}"></a><figcaption>{esc(png.name)}</figcaption></figure>')
        sections.append(f"<h2>{esc(section)}</h2>\n" + "\n".join(figures))
    path.write_text(_PAGE.format(title=esc(title), intro=f"<p>{esc(intro)}</p>" if intro else "",
                                 head=head, body=body, images="\n".join(sections)), encoding="utf-8")
    return path


# --- the command -------------------------------------------------------------------------------------------
DEMO_SOLVERS = ("fixed_point", "anderson", "broyden")


def task_of(directory: Path, meta: dict[str, Any]):
    """The task module a checkpoint's card names (`deqzoo_task`); CLIError naming the card otherwise."""
    name = meta.get("deqzoo_task")
    if not name:
        raise CLIError(f"{directory / 'README.md'}: the model card has no `deqzoo_task` key naming the task")
    try:
        return task_module(name)
    except ValueError as err:
        raise CLIError(f"{directory / 'README.md'}: {err}") from None


def _task_demo(task, model, output_dir: Path):
    """A task's demo; tasks that write files (renders, sample grids) put them in the demo's folder."""
    import inspect

    if "output_dir" in inspect.signature(task.demo).parameters:
        return task.demo(model, output_dir=output_dir)
    return task.demo(model)


# `deqzoo demo`'s table: one row per model and solver, at most DEMO_WIDTH characters wide (a 100-column
# terminal); the full lines go to summary.json and index.html.
DEMO_HEADER = ["model", "solver", "metric", "NFE", "residual", "converged", "time"]
DEMO_WIDTH = 100
_NO_SOLVE = "no solve"


def _converged(stats) -> str:
    done, total = int(stats.converged.sum()), int(stats.converged.numel())
    return "yes" if done == total else "no" if done == 0 else f"{done}/{total}"


def _demo_row(name: str, solver: str, card: bool, summary: str, stats, seconds: float) -> dict[str, Any]:
    """One solve of a model's demo as a record (summary.json, index.html) and, by `_demo_cells`, a table row;
    a model without a solve says so instead of showing 0 evaluations and residual 0."""
    from examples.demo import demo_metric, has_solve

    row: dict[str, Any] = {"model": name, "solver": solver if has_solve(stats) else _NO_SOLVE, "card": card,
                           "metric": demo_metric(summary), "prediction": str(summary),
                           "time_s": round(seconds, 2)}
    if has_solve(stats):
        row.update(NFE=int(stats.nfe), residual=float(stats.residual.max()), stop_mode=stats.stop_mode,
                   tol=float(stats.tol), converged=_converged(stats))
    else:
        row.update(NFE=None, residual=None, stop_mode=None, tol=None, converged=None)
    return row


def card_demo(name: str, output_dir: Path) -> tuple[dict[str, Any], Any, Any, dict[str, Any], Path]:
    """One checkpoint's task demo at its card's settings, seeded (torch's RNG at 0, so a sampling demo gives
    the same output whichever models ran before it): returns (its record, as a `deqzoo demo` row, its
    statistics, the model, the card's metadata, the checkpoint folder). `deqzoo demo` and the test that
    holds the cards to the demo (tests/test_cards_agree.py) both run this."""
    import torch

    model, directory, meta, _ = load_checkpoint(name)
    task = task_of(directory, meta)
    torch.manual_seed(0)
    start = time.perf_counter()
    summary, stats = _task_demo(task, model, output_dir)
    elapsed = time.perf_counter() - start
    default = getattr(getattr(model, "config", None), "deq_config", None)
    # a reversible DEQ's forward is its coupled iteration, not f_solver: the row names what ran
    solver = ("reversible" if default is not None and default.b_mode == "reversible" else
              default.f_solver if default is not None else getattr(stats, "solver", ""))
    return _demo_row(str(name), solver, True, summary, stats, elapsed), stats, model, meta, directory


def demo_entry(directory: Path) -> dict[str, Any]:
    """A card's `deqzoo_demo` entry (the demo's metric and converged flag) for a freshly written checkpoint
    folder: the card writers record what `deqzoo demo` will show for it (tests/test_cards_agree.py holds
    the card to it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        row = card_demo(str(directory), Path(scratch))[0]
    return {"metric": row["metric"], "converged": row["converged"]}


def _demo_cells(row: dict[str, Any]) -> list[str]:
    short = row["model"].split("/", 1)[1] if row["model"].startswith("deqzoo/") else row["model"]
    if row.get("failed"):
        return [short, "-", row["metric"], "-", "-", "-", "-"]
    # a pipeline's solvers ("anderson+fixed_point") may wrap after their "+"
    solver = row["solver"].replace("+", "+ ") + ("*" if row["card"] and row["solver"] != _NO_SOLVE else "")
    if row["NFE"] is None:
        return [short, solver, row["metric"], "-", "-", "-", f"{row['time_s']:.2f}s"]
    return [short, solver, row["metric"], str(row["NFE"]), f"{row['residual']:.1e} {row['stop_mode']}",
            row["converged"], f"{row['time_s']:.2f}s"]


def demo_table(rows: list[dict[str, Any]], width: int = DEMO_WIDTH) -> str:
    """The demo's table (model names without the `deqzoo/` prefix; * marks the card's solver) within
    `width` columns: the model and metric columns wrap when needed."""
    return format_table([_demo_cells(r) for r in rows], DEMO_HEADER, width, shrink={2: 20, 1: 12, 0: 16})


_DEMO_NOTE = ("* the card's solver (its files are in the folder); the other solvers rerun the same demo for "
              "the residual plot. residual: the largest over the batch, in the solve's stop mode (abs/rel); "
              "converged: below the card's f_tol.")


def card_label(config, stats) -> str:
    """The residual plot's label of the card's own solve: its solver, or for a reversible DEQ (whose forward
    is its coupled iteration whatever f_solver says) its coupled steps, one trace point each (2 f calls)."""
    if config.b_mode == "reversible":
        return f"reversible (card, {stats.trace.numel()} coupled steps)"
    return f"{config.f_solver} (card)"


def _without_scratch(text: str, scratch: str) -> str:
    """A comparison run's summary without the files it wrote to its scratch folder (deleted after the run):
    each such path becomes words, not a path-like "(not kept)/x.png"."""
    import re

    return re.sub(re.escape(str(scratch)) + r"[^\s;,)]*", "a file this comparison run did not keep", text)


def _pngs(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.glob("*.png")}


def run_demo(
    names: list[str], output_dir: Path, progress: bool = True
) -> tuple[list[dict[str, Any]], list[str]]:
    """Run each checkpoint's task demo with its card's solver and every other registered solver, write one
    residual plot per model that solves (tolerance drawn) and `index.html` (the table and every PNG written
    now); returns (one record per model and solver, failures)."""
    import tempfile

    from tqdm.auto import tqdm

    from deqzoo.core import SOLVERS
    from examples.demo import has_solve, residual_figure, save_figure, write_index

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    images: dict[str, list[Path]] = {}
    solvers = [s for s in DEMO_SOLVERS if s in SOLVERS]
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in tqdm(names, desc="demo", unit="model", disable=not progress):
        try:
            before = _pngs(output_dir)
            row, stats, model, meta, directory = card_demo(str(name), output_dir)
            written = sorted(p for p, t in _pngs(output_dir).items() if before.get(p) != t)
            images[str(name)] = written
            rows.append(row)
            png = output_dir / f"{Path(str(name)).name.replace('/', '_')}_residuals.png"
            task = task_of(directory, meta)
            if not hasattr(model, "set_deq"):  # a pipeline (DEQ-DDIM): its demo, its solver only
                if has_solve(stats) and stats.trace.numel() > 0:  # its solve gets its plot like any other
                    traces = {f"{stats.solver} (card)": stats}
                    images[str(name)].append(save_figure(residual_figure(traces, f"{name}: solve"), png))
                continue
            default = model.config.deq_config
            if not has_solve(stats):  # an explicit network (the RAFT twin): no solver to compare, no plot
                continue
            traces = {card_label(default, stats): stats}
            policy = model.config.on_nonconvergence
            # the comparison runs write their task files elsewhere: the folder shows the card's solve
            with tempfile.TemporaryDirectory(prefix="deqzoo-demo-") as scratch:
                # a reversible DEQ runs its own coupled iteration whatever f_solver says: nothing to compare
                others = [] if default.b_mode == "reversible" else solvers
                for solver in tqdm(others, desc=name, leave=False, disable=not progress):
                    if solver == default.f_solver:
                        continue
                    # the comparison solvers are drawn, residuals and all: one that misses the card's
                    # tolerance is what the plot shows, not a warning about the card's own settings
                    model.set_deq(f_solver=solver, on_nonconvergence="ignore")
                    start = time.perf_counter()
                    solver_summary, solver_stats = _task_demo(task, model, Path(scratch))
                    row = _demo_row(str(name), solver, False, solver_summary, solver_stats,
                                    time.perf_counter() - start)
                    row["prediction"] = _without_scratch(row["prediction"], scratch)
                    rows.append(row)
                    traces[solver] = solver_stats
            model.set_deq(f_solver=default.f_solver, on_nonconvergence=policy)
            images[str(name)].append(save_figure(residual_figure(traces, f"{name}: forward solve"), png))
        except Exception as err:  # noqa: BLE001 - report every model, then fail
            failures.append(f"{name}: {type(err).__name__}: {err}")
            rows.append({"model": str(name), "failed": True, "metric": f"FAILED: {type(err).__name__}",
                         "prediction": f"FAILED: {type(err).__name__}: {err}"})
    page_rows = [_demo_cells(r) + [r["prediction"]] for r in rows]
    write_index(output_dir / "index.html", [*DEMO_HEADER, "full output"], page_rows, images,
                intro=_DEMO_NOTE)
    return rows, failures


def main(names: list[str], output_dir: str | Path = "demo_output", progress: bool = True) -> int:
    """`deqzoo demo`: every embedded checkpoint (or `names`) on its task's samples with every solver; prints
    the table, writes the figures, index.html and summary.json into `output_dir`; 1 when a model failed."""
    import sys
    import textwrap

    import torch

    from deqzoo.hub.catalog import load_catalog
    from deqzoo.models.registry import require

    # the demo runs every task's data and plots: refuse up front, naming the extra, instead of N failures
    require("demo", ("matplotlib", "PIL", "sklearn", "skimage", "cv2", "mlxtend", "torchvision", "diffusers"),
            "deqzoo demo")
    torch.manual_seed(0)
    names = names or sorted(load_catalog())
    if not names:
        print("deqzoo demo: no embedded checkpoints in the catalog (deqzoo/hub/catalog.json) yet; "
              "nothing to run. "
              "Add a folder under model_cards/ and run `python -m utils.catalog`.")
        return 0
    output_dir = Path(output_dir)
    rows, failures = run_demo(names, output_dir, progress=progress)
    print(demo_table(rows))
    print(textwrap.fill(_DEMO_NOTE, DEMO_WIDTH))
    print("the plots and the full table (open in a browser):")
    print(f"  {output_dir / 'index.html'}")  # the only line as long as the user's path
    (output_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0
