"""Fixed-point solvers for z = f(z), registered by name, one module per method (`fixed_point`, `anderson`,
`broyden`, `gmres`, `hyperanderson`) over one shared contract (`_contract`). They work on flat (B, D) states.

A solver is ``fn(g, x0, *, max_iter, tol, stop_mode, **kwargs) -> (x, SolverStats)`` where ``g`` maps
(B, D) to (B, D) and runs without autograd. Every built-in solver keeps per-sample statistics and returns,
per sample, the iterate with the lowest residual seen. Each sample stops on its own (`deqzoo.core.halting`):
below tol, a non-finite residual, divergence (its absolute residual above ``div_factor`` times its own best
one), its budget (max_iter, or a ``halt`` rule's), or a ``halt`` stop rule. A stopped sample leaves the
solver's state (its history rows are dropped), and, when g is marked `deqzoo.core.halting.rowwise`, f's
batch: g is called as ``g(x, rows)`` on the iterating rows only. So a sample's answer, its NFE
(``stats.nfe_per_sample``) and its flags do not depend on the rest of its batch. f is called on a new tensor
every step, so f may keep its inputs; f's output is checked (shape, dtype) on every call. Built-ins also
accept ``keep_steps`` (iterations at which to keep a copy of the best iterate so far, for fixed-point
correction). Memory grows with the work done (histories of min(m, steps taken) entries), never with
max_iter. An empty batch (B = 0) returns an empty result without calling f.

Registered: ``fixed_point`` (damped), ``anderson`` (incremental Gram matrix), ``broyden`` (good Broyden on
the inverse Jacobian, full or limited memory; exposes its inverse estimate for SHINE), ``gmres`` (Krylov, for
affine maps such as the adjoint system of implicit differentiation), ``hyperanderson`` (learned weights).

One implementation per method, in torch on the state's device (CPU and accelerators alike).
"""

import functools
from collections.abc import Callable

import torch

from ..state import State, StatePacker
from ..stats import SolverStats
from ._contract import (
    SOLVERS,
    _check_solve_args,
    check_final,
    final_step,
    get_solver,
    register_solver,
    solver_kwarg_names,
)
from .anderson import anderson
from .broyden import InverseJacobian, broyden
from .fixed_point import fixed_point
from .gmres import gmres
from .hyperanderson import hyperanderson

__all__ = [
    "SOLVERS",
    "InverseJacobian",
    "anderson",
    "broyden",
    "final_step",
    "fixed_point",
    "get_solver",
    "gmres",
    "hyperanderson",
    "register_solver",
    "solve",
    "solver_kwarg_names",
]


def solve(f: Callable[[State], State], z0: State, solver: str = "anderson", max_iter: int = 50,
          tol: float = 1e-4, stop_mode: str = "rel", final: bool | int | str = False, **solver_kwargs
) -> tuple[State, SolverStats]:
    """Find z* = f(z*) starting at z0 (no autograd graph is built).

    z0 is a tensor or a tuple/list of tensors with a common batch dimension first; f returns the same
    structure. Stopping and statistics are per sample; each sample's lowest-residual iterate is returned
    (``final=True``: or f of it, where one more evaluation shows it is better; an int n: fⁿ of it, always;
    see `final_step`; ``final="stored"``: f of it as the solver already computed it, no further call, the
    statistics' residuals those of the iterate, TorchDEQ's return rule: solvers with ``return_f``).
    An f marked with `deqzoo.core.halting.rowwise` is called on the iterating rows only, ``f(z, rows)``;
    ``halt=[...]`` adds per-sample stop rules (`deqzoo.core.halting`) to the built-in solvers.

    Example:
        >>> import torch
        >>> from deqzoo.core import solve
        >>> A = 0.5 * torch.eye(3, dtype=torch.float64); b = torch.ones(1, 3, dtype=torch.float64)
        >>> z, stats = solve(lambda z: z @ A + b, torch.zeros(1, 3, dtype=torch.float64), tol=1e-10)
        >>> torch.allclose(z, 2 * b), bool(stats.converged.all())
        (True, True)
    """
    _check_solve_args(max_iter, tol, stop_mode)  # before anything is allocated, for user solvers too
    check_final(final, solver, "solve: final")
    packer = StatePacker(z0)
    x0 = packer.flatten(z0)
    packer.check_finite(x0)
    with torch.no_grad():
        run = get_solver(solver)
        if final == "stored":
            solver_kwargs["return_f"] = True
        elif final:
            run = functools.partial(final_step, run, steps=0 if final is True else final)
        x, stats = run(packer.wrap(f), x0.detach(), max_iter=max_iter, tol=tol, stop_mode=stop_mode,
                       **solver_kwargs)  # fmt: skip
    return packer.unflatten(x), stats
