"""Pieces of `deqzoo demo`'s output shared by the tasks and the command: a summary that carries a short
metric for the table, the residual-vs-iteration figure (with the solve's tolerance drawn), and the HTML page
that shows the table and every image the demo wrote.

Figures are built on `matplotlib.figure.Figure` (no pyplot: no global state, no GUI backend) and returned, so
tests inspect the axes rather than pixels.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..core import SolverStats


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
