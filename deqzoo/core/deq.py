"""The DEQ module: forward solve without a graph, backward mode attached, statistics returned."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .backward import BACKWARD_MODES
from .config import DEQConfig
from .solvers import solve
from .state import State, StatePacker
from .stats import SolverStats


class DEQConvergenceError(RuntimeError):
    """The forward solve did not reach its tolerance (raised when on_nonconvergence="raise")."""

    def __init__(self, message: str, stats: SolverStats):
        super().__init__(message)
        self.stats = stats


class DEQ(nn.Module):
    """A deep equilibrium layer: z* = f(z*), differentiated by the configured backward mode.

    Example:
        >>> import torch
        >>> from deqzoo.core import DEQ, DEQConfig
        >>> lin = torch.nn.Linear(4, 4); x = torch.randn(2, 4)
        >>> deq = DEQ(DEQConfig(f_solver="anderson", f_max_iter=50, f_tol=1e-6))
        >>> z, stats = deq(lambda z: torch.tanh(0.3 * lin(z) + x), torch.zeros(2, 4))
        >>> z.shape, stats.nfe > 0
        (torch.Size([2, 4]), True)
    """

    def __init__(self, config: DEQConfig | None = None, **overrides):
        super().__init__()
        config = config or DEQConfig()
        self.config = config.update(**overrides) if overrides else config

    def forward(self, f, z0: State) -> tuple[State, SolverStats]:
        cfg = self.config
        z_star, stats = solve(f, z0, solver=cfg.f_solver, max_iter=cfg.f_max_iter, tol=cfg.f_tol,
                              stop_mode=cfg.f_stop_mode, **cfg.f_solver_kwargs)
        self._report(stats)
        if not torch.is_grad_enabled():
            return z_star, stats
        return BACKWARD_MODES[cfg.b_mode](f, z_star, StatePacker(z0), cfg), stats

    def _report(self, stats: SolverStats) -> None:
        mode = self.config.on_nonconvergence
        if mode == "ignore" or stats.all_converged:
            return
        message = f"DEQ forward solve did not converge: {stats.summary()} (tol={stats.tol})"
        if mode == "raise":
            raise DEQConvergenceError(message, stats)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
