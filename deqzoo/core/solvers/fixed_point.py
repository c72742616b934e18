"""Damped fixed-point iteration."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._contract import _check_solve_args, _check_tau, _empty_result, _Tracker, register_solver


@register_solver("fixed_point")
@torch.no_grad()
def fixed_point(
    g,
    x0,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    tau: float = 1.0,
    keep_steps: Iterable[int] = (),
    div_factor: float = 1e6,
    halt=None,
):
    """Damped fixed-point iteration x <- (1 - tau) x + tau g(x), each sample stopping on its own (the rows
    still iterating are the only ones f sees when g is `deqzoo.core.halting.rowwise`)."""
    _check_tau(tau)
    _check_solve_args(max_iter, tol, stop_mode)
    if x0.shape[0] == 0:
        return _empty_result(x0, "fixed_point", tol, stop_mode)
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "fixed_point", keep_steps, div_factor, halt, g)
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
