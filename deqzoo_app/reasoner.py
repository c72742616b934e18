"""The reasoner tab's computations (no Gradio): a 6×6 Sudoku the user edits, the recursive reasoner's answer
after every segment with per-cell confidence, and where each halting rule stops.

The checkpoint is the embedded reasoner (the family's `Family.app` entry) when there is one, else a
checkpoint folder named by the environment variable ``DEQZOO_APP_REASONER`` (tests, a local run); without
either the app has no reasoner tab (:func:`available`).

Example:
    >>> from deqzoo_app.reasoner import parse_grid
    >>> grid = parse_grid([[1, "", 0, None, " 2", "."]] + [[""] * 6] * 5)
    >>> grid[:6].tolist()
    [1, 0, 0, 0, 2, 0]
"""

from __future__ import annotations

import html
import os
import time
from typing import Any

import numpy as np
import torch

from . import families as F

__all__ = ["ENV", "RULES", "SIZE", "available", "checkpoint", "heldout_puzzle", "parse_grid", "solve_sudoku",
           "warm_up"]

ENV = "DEQZOO_APP_REASONER"
SIZE = 6
BOX = (2, 3)  # rows, columns of a 6×6 box
RULES = ("budget", "act", "stability", "residual")
_RULE_TEXT = {"budget": "none: the whole budget runs", "act": "ACT: the Q-head's halt logit > 0",
              "stability": "stability: the answer unchanged for halt_patience segments",
              "residual": "residual: the answer state's relative change below halt_tol"}


def checkpoint() -> str | None:
    """The reasoner the tab runs: the embedded one, else $DEQZOO_APP_REASONER, else None."""
    embedded = F.CHECKPOINTS.get("reasoner")
    if embedded:
        return embedded[0]
    return os.environ.get(ENV) or None


def available() -> bool:
    return checkpoint() is not None


def _loaded(name: str | None):
    name = name or checkpoint()
    if name is None:
        raise ValueError(f"no reasoner checkpoint: none is embedded yet and ${ENV} is not set")
    if name not in (checkpoint(), *F.CHECKPOINTS.get("reasoner", [])):
        raise ValueError(f"checkpoint must be {checkpoint()!r}, got {name!r}")
    model = F._model(name)
    cfg = model.config
    if cfg.model_type != "reasoner" or cfg.seq_len != SIZE * SIZE or cfg.num_labels < SIZE + 1:
        raise ValueError(f"{name}: the tab needs a reasoner over {SIZE}×{SIZE} = 36 cells with digits "
                         f"1..6, got model_type {cfg.model_type!r}, seq_len {cfg.seq_len}, "
                         f"num_labels {cfg.num_labels}")
    return name, model


def _cell(value: Any, r: int, c: int) -> int:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return 0
    text = str(value).strip()
    if text in ("", ".", "0", "0.0", "nan", "None"):
        return 0
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is None or number != int(number) or not 1 <= number <= SIZE:
        raise ValueError(f"cell (row {r + 1}, column {c + 1}) must be a digit 1..{SIZE} or empty, "
                         f"got {value!r}")
    return int(number)


def parse_grid(grid: Any) -> np.ndarray:
    """A 6×6 grid (rows of cells: digits 1..6, empty / 0 / "." for blanks; a pandas DataFrame, a
    Gradio table value or nested lists) as 36 flat ints; ValueError naming the cell or the shape, and
    naming two givens that conflict (same digit twice in a row, column or box)."""
    if hasattr(grid, "to_numpy"):
        grid = grid.to_numpy(dtype=object).tolist()
    elif isinstance(grid, dict) and "data" in grid:
        grid = grid["data"]
    rows = [list(row) for row in grid] if isinstance(grid, (list, tuple, np.ndarray)) else None
    if rows is None or len(rows) != SIZE or any(len(row) != SIZE for row in rows):
        shape = (len(rows), sorted({len(r) for r in rows})) if rows is not None else type(grid).__name__
        raise ValueError(f"the puzzle must be {SIZE} rows of {SIZE} cells, got {shape}")
    flat = np.array([_cell(v, r, c) for r, row in enumerate(rows) for c, v in enumerate(row)], dtype=np.int64)
    for a, b in _conflicts(flat):
        (ra, ca), (rb, cb) = divmod(a, SIZE), divmod(b, SIZE)
        raise ValueError(f"the givens at (row {ra + 1}, column {ca + 1}) and (row {rb + 1}, column {cb + 1}) "
                         f"are both {flat[a]} in one row, column or box")
    return flat


def _units() -> list[list[int]]:
    rows = [[r * SIZE + c for c in range(SIZE)] for r in range(SIZE)]
    cols = [[r * SIZE + c for r in range(SIZE)] for c in range(SIZE)]
    boxes = [[(br + i) * SIZE + bc + j for i in range(BOX[0]) for j in range(BOX[1])]
             for br in range(0, SIZE, BOX[0]) for bc in range(0, SIZE, BOX[1])]
    return rows + cols + boxes


def _conflicts(flat: np.ndarray) -> list[tuple[int, int]]:
    """Pairs of filled cells with the same digit in a unit."""
    pairs = []
    for unit in _units():
        seen: dict[int, int] = {}
        for i in unit:
            if flat[i]:
                if flat[i] in seen:
                    pairs.append((seen[flat[i]], i))
                else:
                    seen[flat[i]] = i
    return pairs


def heldout_puzzle(index: int = 0) -> list[list[str]]:
    """Held-out puzzle `index` (of the 1,000 the card is scored on) as table rows, blanks empty."""
    from examples.reasoner.puzzles import load_heldout

    index = F.clamp_int(index, "puzzle", "held-out puzzle number")
    flat = load_heldout("sudoku6_heldout")["inputs"][index]
    return [[str(int(v)) if v else "" for v in flat[r * SIZE:(r + 1) * SIZE]] for r in range(SIZE)]


def _trace(model, x: torch.Tensor, segments: int, deadline) -> dict[str, list]:
    """Answer, confidence, halt logit and relative change of y after each segment (the carry continued)."""
    answers, confidence, q_halt, change = [], [], [], []
    carry, y_prev = None, None
    for s in range(segments):
        deadline.check(f"segment {s + 1}")
        out = model(x, carry=carry, num_segments=1, halting="budget")
        carry = out.carry
        probs = torch.softmax(out.logits[0].double(), -1)
        probs[:, 0] = 0.0  # class 0 (blank) is never a target: confidence over the digits
        probs = probs / probs.sum(-1, keepdim=True)
        answers.append(probs.argmax(-1).numpy())
        confidence.append(probs.max(-1).values.numpy())
        q_halt.append(float(out.q_halt_logits[0]))
        y = carry[0].double()
        change.append(float((y - y_prev).norm() / y.norm()) if y_prev is not None else float("nan"))
        y_prev = y
    return {"answers": answers, "confidence": confidence, "q_halt": q_halt, "change": change}


def _grid_html(answer: np.ndarray, confidence: np.ndarray, givens: np.ndarray, title: str,
               big: bool = False) -> str:
    bad = {i for pair in _conflicts(answer) for i in pair} | {i for i in range(SIZE * SIZE)
                                                              if givens[i] and answer[i] != givens[i]}
    size = 34 if big else 18
    cells = []
    for r in range(SIZE):
        row = []
        for c in range(SIZE):
            i = r * SIZE + c
            conf = float(confidence[i])
            border = (f"border-right:{2 if c % BOX[1] == BOX[1] - 1 and c < SIZE - 1 else 1}px solid #333;"
                      f"border-bottom:{2 if r % BOX[0] == BOX[0] - 1 and r < SIZE - 1 else 1}px solid #333;")
            colour = "#c00" if i in bad else "#000"
            weight = "bold" if givens[i] else "normal"
            background = "#ddd" if givens[i] else f"rgba(40,110,220,{0.1 + 0.8 * conf:.2f})"
            row.append(f'<td title="confidence {conf:.2f}" style="width:{size}px;height:{size}px;'
                       f"text-align:center;padding:0;font-size:{size * 0.55:.0f}px;color:{colour};"
                       f'font-weight:{weight};background:{background};{border}">{int(answer[i])}</td>')
        cells.append("<tr>" + "".join(row) + "</tr>")
    return (f'<div style="display:inline-block;margin:4px;text-align:center;font-size:11px">'
            f'<table style="border-collapse:collapse;border:2px solid #333">{"".join(cells)}</table>'
            f'<div class="reasoner-caption">{html.escape(title)}</div></div>')


def _figure(trace: dict, stops: dict[str, int], budget: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    seg = np.arange(1, len(trace["answers"]) + 1)
    conf = np.array(trace["confidence"])
    ax.plot(seg, conf.mean(1), "o-", ms=3, label="mean cell confidence")
    ax.plot(seg, conf.min(1), "s--", ms=3, label="lowest cell confidence")
    final = trace["answers"][-1]
    ax.plot(seg, [float((a == final).mean()) for a in trace["answers"]], ":", label="cells = final answer")
    for rule, colour in (("act", "tab:red"), ("stability", "tab:green"), ("residual", "tab:purple")):
        if stops.get(rule, budget) < budget:
            ax.axvline(stops[rule], color=colour, lw=1, alpha=0.7, label=f"{rule} halts")
    ax.set_xlabel("segment")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def solve_sudoku(grid: Any, segments: int | None = None, halting: str = "stability",
                 checkpoint_name: str | None = None):
    """Run the reasoner on the edited puzzle for `segments` segments (the compute slider; default: its
    trained budget). Returns (HTML: the answer after every segment with per-cell confidence, and the answer
    where `halting` stops; a figure of confidence per segment with each rule's halting point; Markdown)."""
    from examples.reasoner.puzzles import count_sudoku_solutions

    F._check_choice(halting, RULES, "halting rule")
    givens = parse_grid(grid)
    name, model = _loaded(checkpoint_name)
    trained = model.config.halt_max_steps
    budget = trained if segments in (None, "") else F.clamp_int(segments, "segments", "segments")
    deadline = F.Deadline()
    x = torch.from_numpy(givens)[None]
    with F._lock(name), torch.no_grad():
        start = time.perf_counter()
        trace = _trace(model, x, budget, deadline)
        elapsed = time.perf_counter() - start
        # each rule as the model applies it (per-sample halting in forward), not re-derived here
        stops = {rule: int(model(x, num_segments=budget, halting=rule).steps[0]) for rule in RULES}
    stop = stops[halting]
    answer, confidence = trace["answers"][stop - 1], trace["confidence"][stop - 1]
    solutions = count_sudoku_solutions(givens.tolist(), SIZE, limit=2)
    conflicts = _conflicts(answer)
    valid = not conflicts and bool(((givens == 0) | (answer == givens)).all())
    apps = model.config.applications_per_segment
    strip = "".join(_grid_html(a, c, givens, f"seg. {s + 1}", big=False)
                    for s, (a, c) in enumerate(zip(trace["answers"], trace["confidence"])))
    page = (f"<div><b>answer where the rule stops (segment {stop})</b><br>"
            + _grid_html(answer, confidence, givens, f"segment {stop} of {budget}", big=True)
            + "</div><div><b>the answer after each segment</b> (cell shade: confidence; grey: givens; red: "
            "a digit that breaks a rule)<br>" + strip + "</div>")
    puzzle_kind = {0: "no solution", 1: "a unique solution"}.get(solutions, "several solutions")
    verdict = ("a valid Sudoku consistent with the givens" if valid
               else f"not a valid Sudoku ({len(conflicts)} repeated digits in a row, column or box)")
    same = {rule: bool((trace["answers"][stops[rule] - 1] == trace["answers"][-1]).all()) for rule in RULES}
    rows = "\n".join(f"| {rule} | {stops[rule]} | {stops[rule] * apps} | {'yes' if same[rule] else 'no'} |"
                     for rule in RULES)
    summary = (f"**Halting: {_RULE_TEXT[halting]}** — stopped at segment **{stop}** of {budget} "
               f"({stop * apps} network applications of {budget * apps}; trained with {trained} segments). "
               f"The answer there is {verdict}; the puzzle has {puzzle_kind} ({int((givens > 0).sum())} "
               f"givens). {budget} segments took {elapsed * 1000:.0f} ms on this CPU.\n\n"
               "| rule | halts at segment | f calls | answer = the full budget's |\n|---|---|---|---|\n"
               f"{rows}"
               f"\n\nCheckpoint: `{name}`.")
    return page, _figure(trace, stops, budget), summary


def warm_up() -> None:
    """One solve (loads the checkpoint), when the tab has one."""
    if available():
        solve_sudoku(heldout_puzzle(0), segments=2)
