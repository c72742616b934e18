"""Root solvers for z = f(z), registered by name. They work on flat (B, D) states.

A solver is `fn(g, x0, *, max_iter, tol, stop_mode, **kwargs) -> (x, SolverStats)` where g maps (B, D) -> (B, D).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .state import State, StatePacker
from .stats import SolverStats

SOLVERS: dict[str, Callable] = {}


def register_solver(name: str):
    """Register a solver under `name` (decorator). User solvers plug in the same way.

    Example:
        >>> from deqzoo.core import register_solver, solve
        >>> @register_solver("my_fp")
        ... def my_fp(g, x0, *, max_iter, tol, stop_mode, **kw):
        ...     return fixed_point(g, x0, max_iter=max_iter, tol=tol, stop_mode=stop_mode)
    """

    def deco(fn):
        SOLVERS[name] = fn
        return fn

    return deco


def get_solver(name: str) -> Callable:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; registered solvers: {sorted(SOLVERS)}")
    return SOLVERS[name]


class _Tracker:
    """Per-sample best-iterate bookkeeping, updated in place."""

    def __init__(self, x0: torch.Tensor, max_iter: int, tol: float, stop_mode: str, name: str):
        b = x0.shape[0]
        self.best_x = x0.clone()
        self.best_abs = torch.full((b,), float("inf"), dtype=x0.dtype, device=x0.device)
        self.best_rel = self.best_abs.clone()
        self.trace = torch.empty(max_iter, dtype=x0.dtype, device=x0.device)
        self.tol, self.stop_mode, self.name, self.steps = tol, stop_mode, name, 0

    def update(self, x: torch.Tensor, fx: torch.Tensor) -> bool:
        """Record iterate x with f(x) = fx; return True when every sample has converged."""
        diff = (fx - x).norm(dim=1)
        abs_r = torch.nan_to_num(diff, nan=float("inf"))
        rel_r = abs_r / (fx.norm(dim=1) + 1e-9)
        r = rel_r if self.stop_mode == "rel" else abs_r
        best = self.best_rel if self.stop_mode == "rel" else self.best_abs
        better = r < best
        self.best_x[better] = x[better]
        self.best_abs[better] = abs_r[better]
        self.best_rel[better] = rel_r[better]
        self.trace[self.steps] = r.max()
        self.steps += 1
        return bool((best < self.tol).all())

    def stats(self, nfe: int) -> SolverStats:
        r = self.best_rel if self.stop_mode == "rel" else self.best_abs
        return SolverStats(
            nfe=nfe, abs_residual=self.best_abs, rel_residual=self.best_rel, trace=self.trace[: self.steps],
            converged=r < self.tol, solver=self.name, stop_mode=self.stop_mode, tol=self.tol,
            nonfinite=bool(torch.isinf(self.best_abs).any()),
        )


@register_solver("fixed_point")
def fixed_point(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", tau: float = 1.0, **_):
    """Damped fixed-point iteration x <- (1 - tau) x + tau g(x)."""
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "fixed_point")
    x, nfe = x0, 0
    for _ in range(max_iter):
        fx = g(x)
        nfe += 1
        if tracker.update(x, fx):
            break
        x = fx if tau == 1.0 else (1 - tau) * x + tau * fx
    return tracker.best_x, tracker.stats(nfe)


@register_solver("anderson")
def anderson(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", m: int = 5, lam: float = 1e-4,
             tau: float = 1.0, **_):
    """Anderson acceleration with memory m (provisional; see the engine issue)."""
    b, d = x0.shape
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "anderson")
    X = x0.new_zeros(b, m, d)
    F = x0.new_zeros(b, m, d)
    x, nfe = x0, 0
    for k in range(max_iter):
        fx = g(x)
        nfe += 1
        if tracker.update(x, fx):
            break
        i = k % m
        X[:, i], F[:, i] = x, fx
        n = min(k + 1, m)
        G = F[:, :n] - X[:, :n]
        H = torch.bmm(G, G.transpose(1, 2)) + lam * torch.eye(n, dtype=x0.dtype, device=x0.device)
        ones = x0.new_ones(b, n, 1)
        alpha = torch.linalg.solve(H, ones)
        alpha = alpha / alpha.sum(1, keepdim=True)
        x = (tau * torch.bmm(alpha.transpose(1, 2), F[:, :n]) + (1 - tau) * torch.bmm(alpha.transpose(1, 2), X[:, :n]))[:, 0]
    return tracker.best_x, tracker.stats(nfe)


def solve(f: Callable[[State], State], z0: State, solver: str = "anderson", max_iter: int = 50, tol: float = 1e-4,
          stop_mode: str = "rel", **solver_kwargs) -> tuple[State, SolverStats]:
    """Find z* = f(z*) starting at z0 (no autograd graph is built).

    Example:
        >>> import torch
        >>> from deqzoo.core import solve
        >>> A = 0.5 * torch.eye(3, dtype=torch.float64); b = torch.ones(1, 3, dtype=torch.float64)
        >>> z, stats = solve(lambda z: z @ A + b, torch.zeros(1, 3, dtype=torch.float64), tol=1e-10)
        >>> torch.allclose(z, 2 * b)
        True
    """
    packer = StatePacker(z0)
    x0 = packer.flatten(z0)
    if not torch.isfinite(x0).all():
        raise ValueError("z0 contains non-finite values (NaN or Inf)")
    with torch.no_grad():
        x, stats = get_solver(solver)(packer.wrap(f), x0.detach(), max_iter=max_iter, tol=tol, stop_mode=stop_mode,
                                      **solver_kwargs)
    return packer.unflatten(x), stats
