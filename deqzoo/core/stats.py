"""Solver statistics: what a solve did, per sample, as tensors (no per-step dicts)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class SolverStats:
    """Outcome of one fixed-point solve.

    Attributes:
        nfe: number of f evaluations: the largest per-sample count (the solve's steps), as before per-sample
            halting; the total work is ``nfe_per_sample.sum()`` rows of f.
        abs_residual: per-sample ||f(z) - z|| at the returned iterate, shape (B,).
        rel_residual: per-sample ||f(z) - z|| / ||f(z)|| at the returned iterate, shape (B,).
        trace: per-step maximum residual (in the solve's stop mode), shape (steps,).
        converged: per-sample bool, residual below tolerance, shape (B,).
        solver: name of the solver that ran.
        stop_mode: "abs" or "rel".
        tol: the tolerance asked for.
        nonfinite: True when f produced non-finite values and the solve stopped early.
        diverged: True when the residual grew far beyond its best value and the solve stopped early.
        nfe_per_sample: per-sample f evaluations, shape (B,) (None for solves without per-sample counts).
        extra: solver extras; built-in solvers add ``compacted`` (f was called on the iterating rows only),
            ``nonfinite`` and ``diverged`` (per-sample bool tensors: which samples stopped for that reason).
    """

    nfe: int
    abs_residual: torch.Tensor
    rel_residual: torch.Tensor
    trace: torch.Tensor
    converged: torch.Tensor
    solver: str = ""
    stop_mode: str = "rel"
    tol: float = 0.0
    nonfinite: bool = False
    diverged: bool = False
    jac_loss: torch.Tensor | None = None
    states: list | None = None
    extra: dict = field(default_factory=dict)
    nfe_per_sample: torch.Tensor | None = None

    def __getitem__(self, index: int | slice | torch.Tensor) -> SolverStats:
        """The statistics of the samples at `index` (an int keeps a batch dimension of one, as pipelines
        expect when they un-batch outputs). Batch-level fields (nfe, trace, flags) are shared.

        Example:
            >>> import torch
            >>> from deqzoo.core import solve
            >>> _, stats = solve(lambda z: 0.5 * z + 1, torch.zeros(3, 2))
            >>> stats[1].rel_residual.shape
            torch.Size([1])
        """
        if isinstance(index, int):
            n = self.converged.shape[0]
            if not -n <= index < n:
                raise IndexError(f"sample index {index} out of range for a batch of {n}")
            index = slice(index % n, index % n + 1)
        per_sample = lambda t: t[index] if isinstance(t, torch.Tensor) and t.dim() > 0 else t  # noqa: E731
        return replace(self, abs_residual=self.abs_residual[index], rel_residual=self.rel_residual[index],
                       converged=self.converged[index],
                       nfe_per_sample=self.nfe_per_sample[index] if self.nfe_per_sample is not None else None,
                       states=[per_sample(s) for s in self.states] if self.states is not None else None)

    @classmethod
    def no_solve(cls, batch: int = 1) -> SolverStats:
        """Statistics of an explicit network (no fixed point solved): 0 evaluations, residual 0, converged.

        Example:
            >>> SolverStats.no_solve(2).summary()
            'none: nfe=0 max rel residual=0.00e+00 converged=2/2'
        """
        return cls(nfe=0, abs_residual=torch.zeros(batch), rel_residual=torch.zeros(batch),
                   trace=torch.zeros(0), converged=torch.ones(batch, dtype=torch.bool), solver="none")

    @property
    def residual(self) -> torch.Tensor:
        """Per-sample residual in the solve's stop mode."""
        return self.rel_residual if self.stop_mode == "rel" else self.abs_residual

    @property
    def all_converged(self) -> bool:
        return bool(self.converged.all())

    def summary(self) -> str:
        return (
            f"{self.solver}: nfe={self.nfe} max {self.stop_mode} residual="
            f"{float(self.residual.max()):.2e} converged={int(self.converged.sum())}/{self.converged.numel()}"
        )
