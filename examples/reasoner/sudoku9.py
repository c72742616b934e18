"""The `sudoku9` task of `deqzoo eval` / `deqzoo demo`: :mod:`examples.reasoner.sudoku`'s evaluation and demo
on the stored 9×9 held-out puzzles (`data/sudoku9_heldout.npz`, 1,000 minimal puzzles; givens mean 24.4).

Example:
    >>> import torch
    >>> from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification
    >>> cfg = ReasonerConfig(seq_len=81, vocab_size=10, num_labels=10, hidden_size=16, num_heads=2,
    ...                      mixer="mlp", pos_encodings="learned", h_cycles=1, l_cycles=1, halt_max_steps=2)
    >>> torch.manual_seed(0) and None
    >>> metrics = evaluate(ReasonerForGridClassification(cfg), limit=10, progress=False)
    >>> list(metrics) == metric_names(2), metrics["exact_1x"]  # an untrained network solves none
    (True, 0.0)
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
