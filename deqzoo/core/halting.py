"""Per-sample halting: stop rules and the row-subset protocol that lets a solve drop stopped rows from f.

Every built-in solver stops each sample on its own. A sample (a row of the flat (B, D) state) stops when its
residual is below the solve's tolerance, when its residual is not finite, when it diverges (its absolute
residual exceeds ``div_factor`` times its own best one), when it has spent its budget, or when one of the
extra stop rules given as ``halt=[...]`` holds for it. A stopped row keeps its lowest-residual iterate, and
the solver's history (Anderson's, Broyden's, HyperAnderson's) is compacted with the rows that remain.

Row subsets (compaction). f is a closure over its input injection, so the engine cannot call it on a subset
of the batch by itself. An f marked with `rowwise` is called as ``f(z, rows)``: ``z`` holds the rows listed in
``rows`` (a (n,) long tensor of batch indices, on the state's device) and f must gather its injection with
``rows`` (``rows=None``: the whole batch). Mark f only when it is row-independent (a row's output depends
on that row alone: no batch statistics such as BatchNorm in training, no coupling of samples such as a
graph's nodes stacked as a batch). An unmarked f is called on the whole batch every step, the stopped rows at
their answer, and ``stats.extra["compacted"]`` is False. Families declare row independence in their
registry entry (`deqzoo.models.registry.Family.row_independent`).

Stop rules (combined with "any": a row halts when one rule holds) see a `Step`: the rows' iterate, f of it,
their residuals, their per-row evaluation counts, and the structured state of f's output.

Example:
    >>> import torch
    >>> from deqzoo.core import solve
    >>> from deqzoo.core.halting import AnswerStable, Budget, rowwise
    >>> a = torch.tensor([[0.1], [0.9]], dtype=torch.float64)   # row 1 contracts slowly
    >>> f = rowwise(lambda z, rows: a[rows] * z + 1 if rows is not None else a * z + 1)
    >>> z, stats = solve(f, torch.zeros(2, 1, dtype=torch.float64), solver="fixed_point",
    ...                  max_iter=500, tol=1e-10)
    >>> stats.nfe_per_sample.tolist(), stats.extra["compacted"]
    ([11, 198], True)
    >>> _, stats = solve(f, torch.zeros(2, 1, dtype=torch.float64), solver="fixed_point", max_iter=500,
    ...                  tol=1e-10, halt=[Budget(torch.tensor([3, 5]))])
    >>> stats.nfe_per_sample.tolist()
    [3, 5]
    >>> stable = AnswerStable(lambda z: z.round(), k=2)      # stop once round(z) holds for 2 steps
    >>> _, stats = solve(f, torch.zeros(2, 1, dtype=torch.float64), solver="fixed_point", max_iter=500,
    ...                  tol=1e-10, halt=[stable])
    >>> stats.nfe_per_sample.tolist()
    [3, 12]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["AnswerStable", "Budget", "HaltHead", "Residual", "Step", "StopRule", "is_rowwise", "rowwise"]


def rowwise(f: Callable) -> Callable:
    """Mark `f` as callable on a subset of the batch, ``f(z, rows)`` (see the module docstring): the solvers
    then call it on the rows still iterating only. Returns f itself, marked.

    Example:
        >>> f = rowwise(lambda z, rows=None: z)
        >>> is_rowwise(f)
        True
    """
    try:
        f.rowwise = True
    except AttributeError:  # a bound method or builtin: wrap it
        inner = f

        def f(z, rows=None):
            return inner(z, rows)

        f.rowwise = True
    return f


def is_rowwise(f) -> bool:
    """Whether `f` was marked with `rowwise` (it accepts ``f(z, rows)``)."""
    return bool(getattr(f, "rowwise", False))


@dataclass
class Step:
    """What a stop rule sees at one step, for the n rows still iterating.

    x, fx: (n, D) flat iterate and f of it; rows: (n,) their batch indices; nfe: (n,) f evaluations each
    row has had (this one included); abs_residual, rel_residual: (n,) float64. `state()` is f's output as
    the caller's structured state (a tensor or tuple of tensors with n rows)."""

    x: torch.Tensor
    fx: torch.Tensor
    rows: torch.Tensor
    nfe: torch.Tensor
    abs_residual: torch.Tensor
    rel_residual: torch.Tensor
    unflatten: Callable[[torch.Tensor], object] | None = None

    def state(self):
        return self.fx if self.unflatten is None else self.unflatten(self.fx)


class StopRule:
    """A per-sample stop rule. ``start(batch, device)`` is called once per solve; ``__call__(step)`` returns
    a (n,) bool tensor on the state's device, True where a row halts now. A rule that keeps state per row
    indexes it by ``step.rows`` (the original batch indices), so compaction needs nothing from it."""

    def start(self, batch: int, device: torch.device) -> None:
        pass

    def __call__(self, step: Step) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class Budget(StopRule):
    """At most `steps` evaluations of f per sample: an int, or a (B,) tensor of per-sample budgets.
    `Budget.random(low, high)` draws a per-sample budget uniformly from [low, high] at each solve (torch's
    RNG), a training option (random depth per step; the solve's max_iter still caps it)."""

    def __init__(self, steps: int | torch.Tensor, *, high: int | None = None):
        self.steps, self.high, self._drawn = steps, high, None
        low = int(steps.min()) if isinstance(steps, torch.Tensor) else int(steps)
        if low < 1 or (high is not None and high < low):
            raise ValueError(f"Budget needs steps >= 1 (and high >= steps), got steps={steps}, high={high}")

    @classmethod
    def random(cls, low: int, high: int) -> Budget:
        return cls(int(low), high=int(high))

    def start(self, batch: int, device: torch.device) -> None:
        if self.high is not None:
            self._drawn = torch.randint(int(self.steps), self.high + 1, (batch,)).to(device)
        elif isinstance(self.steps, torch.Tensor):
            if self.steps.shape != (batch,):
                raise ValueError(f"Budget: per-sample steps have shape {tuple(self.steps.shape)}, "
                                 f"the batch is ({batch},)")
            self._drawn = self.steps.to(device)
        else:
            self._drawn = None

    def __call__(self, step: Step) -> torch.Tensor:
        limit = self.steps if self._drawn is None else self._drawn[step.rows]
        return step.nfe >= limit


class Residual(StopRule):
    """Residual below `tol` in `stop_mode` ("abs" or "rel"): the solve's own rule, here to combine a second
    criterion (e.g. an absolute floor beside the solve's relative tolerance)."""

    def __init__(self, tol: float, stop_mode: str = "rel"):
        if stop_mode not in ("abs", "rel") or not tol > 0:
            raise ValueError(f"Residual needs tol > 0 and stop_mode 'abs'/'rel', got {tol}, {stop_mode!r}")
        self.tol, self.stop_mode = tol, stop_mode

    def __call__(self, step: Step) -> torch.Tensor:
        r = step.rel_residual if self.stop_mode == "rel" else step.abs_residual
        return r < self.tol


class AnswerStable(StopRule):
    """Halt a row once ``output(state)`` (e.g. ``lambda z: head(z).argmax(-1)``) has been the same for `k`
    consecutive steps. `output` receives f's output for the iterating rows (structured state) and returns
    a tensor with one row per sample."""

    def __init__(self, output: Callable, k: int = 3):
        if k < 1:
            raise ValueError(f"AnswerStable needs k >= 1, got {k}")
        self.output, self.k = output, int(k)
        self._last: torch.Tensor | None = None
        self._count: torch.Tensor | None = None

    def start(self, batch: int, device: torch.device) -> None:
        self._last, self._batch = None, batch
        self._count = torch.zeros(batch, dtype=torch.long, device=device)

    def __call__(self, step: Step) -> torch.Tensor:
        y = self.output(step.state()).reshape(step.rows.shape[0], -1)
        if self._last is None:
            self._last = y.new_zeros(self._batch, y.shape[1])
            same = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
        else:
            same = (self._last[step.rows] == y).all(1) & (step.nfe > 1)
        self._last[step.rows] = y
        self._count[step.rows] = torch.where(same, self._count[step.rows] + 1, 0)
        return self._count[step.rows] >= self.k


class HaltHead(StopRule):
    """A learned halt head (HRM/TRM's Q-head style): ``head(state) -> (n,) logits``; a row halts when its
    logit is > 0."""

    def __init__(self, head: Callable):
        self.head = head

    def __call__(self, step: Step) -> torch.Tensor:
        return self.head(step.state()).reshape(-1) > 0


def check_rules(halt: Sequence[StopRule] | StopRule | None) -> tuple[StopRule, ...]:
    """`halt` as a tuple of rules (a clear error for anything else)."""
    if halt is None:
        return ()
    rules = (halt,) if isinstance(halt, StopRule) else tuple(halt)
    for r in rules:
        if not isinstance(r, StopRule):
            raise TypeError(f"halt: expected StopRules (deqzoo.core.halting), got {type(r).__name__}")
    return rules
