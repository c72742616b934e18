"""The `sudoku9` task of `deqzoo eval` / `deqzoo demo`: :mod:`examples.reasoner.sudoku`'s evaluation and demo
on the stored 9×9 held-out puzzles (`data/sudoku9_heldout.npz`, 1,000 minimal puzzles; givens mean 24.4).

Example (untrained networks: a 9×9 one solves none, a 6×6 one is refused before any puzzle is read):
    >>> from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification as Reasoner
    >>> def tiny(cells, labels):
    ...     return Reasoner(ReasonerConfig(seq_len=cells, vocab_size=labels, num_labels=labels,
    ...                                    hidden_size=16, num_heads=2, halt_max_steps=2))
    >>> evaluate(tiny(81, 10), limit=10, progress=False)["exact_1x"]
    0.0
    >>> evaluate(tiny(36, 7), limit=10, progress=False)
    Traceback (most recent call last):
    ValueError: task sudoku9 needs a reasoner over 81 cells with >= 10 labels, got model_type 'reasoner', ...
"""

from __future__ import annotations

from examples.reasoner.sudoku import demo_on, evaluate_on, metric_names, metrics_from_report

__all__ = ["HELDOUT", "demo", "evaluate", "metric_names", "metrics_from_report"]

HELDOUT = "sudoku9_heldout"


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """:func:`examples.reasoner.sudoku.evaluate`'s numbers on the 9×9 held-out puzzles."""
    return evaluate_on(model, HELDOUT, limit=limit, progress=progress)


def demo(model):
    """The first 100 9×9 held-out puzzles at the trained budget, then with stability halting; one line."""
    return demo_on(model, HELDOUT)
