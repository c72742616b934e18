"""Damped fixed-point iteration."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._contract import _check_solve_args, _check_tau, _empty_result, make_tracker, register_solver


@register_solver("fixed_point")
@torch.no_grad()
def fixed_point(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", tau: float = 1.0,
                keep_steps: Iterable[int] = (), div_factor: float = 1e6, halt=None,
                fixed_trip: bool | None = None, check_every: int = 4, return_f: bool = False):
    """Damped fixed-point iteration x <- (1 - tau) x + tau g(x), each sample stopping on its own (the rows
    still iterating are the only ones f sees when g is `deqzoo.core.halting.rowwise`).

    ``fixed_trip=True`` (the default under `torch.compile`): every row stays in f's batch for the whole
    budget, a stopped row frozen by a mask, no host read per step (`_contract._MaskedTracker`; in eager
    mode the loop ends early when a check every ``check_every`` steps finds no row iterating).

    ``return_f=True`` returns f of each row's best iterate, already computed by its residual check, with no
    further call (``solve(final="stored")``; the statistics' residuals are the iterate's)."""
    _check_tau(tau)
    _check_solve_args(max_iter, tol, stop_mode)
    if x0.shape[0] == 0:
        return _empty_result(x0, "fixed_point", tol, stop_mode)
    tracker = make_tracker(x0, max_iter, tol, stop_mode, "fixed_point", keep_steps, div_factor, halt, g,
                           fixed_trip, check_every, return_f)  # fmt: skip
    x = x0.clone()
    while True:
        fx = tracker.call(g, x)
        keep = tracker.update(x, fx)
        if tracker.done:
            break
        if keep is not None:
            x, fx = x[keep], fx[keep]
        x = fx.clone() if tau == 1.0 else torch.lerp(x, fx, tau)
    return tracker.result(), tracker.stats()
