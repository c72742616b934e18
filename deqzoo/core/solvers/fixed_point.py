"""Damped fixed-point iteration."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ._contract import (
    _check_output,
    _check_solve_args,
    _check_tau,
    _empty_result,
    make_tracker,
    masked_rule,
    register_solver,
)


@register_solver("fixed_point")
@torch.no_grad()
def fixed_point(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", tau: float = 1.0,
                keep_steps: Iterable[int] = (), div_factor: float = 1e6, halt=None,
                fixed_trip: bool | str | None = None, check_every: int = 4, return_f: bool = False):
    """Damped fixed-point iteration x <- (1 - tau) x + tau g(x), each sample stopping on its own (the rows
    still iterating are the only ones f sees when g is `deqzoo.core.halting.rowwise`).

    ``fixed_trip=True`` (the default under `torch.compile`): every row stays in f's batch for the whole
    budget, a stopped row frozen by a mask, no host read per step (`_contract._MaskedTracker`; in eager
    mode the loop ends early when a check every ``check_every`` steps finds no row iterating).

    ``fixed_trip="while"``: the same, and when compiled its steps after the first are one ``torch.while_loop``
    (f traced once, not once per step: Inductor compiles a budget of any size; no halt rules or kept steps);
    eager, it runs as ``fixed_trip=True``.

    ``return_f=True`` returns f of each row's best iterate, already computed by its residual check, with no
    further call (``solve(final="stored")``; the statistics' residuals are the iterate's)."""
    _check_tau(tau)
    _check_solve_args(max_iter, tol, stop_mode)
    if fixed_trip not in (None, True, False, "while"):
        raise ValueError(f"fixed_trip must be None, a bool or 'while', got {fixed_trip!r}")
    looped = fixed_trip == "while" and torch.compiler.is_compiling()
    if looped and (halt is not None or keep_steps):
        raise ValueError("fixed_trip='while' takes no halt rules or keep_steps (its body is traced once)")
    if x0.shape[0] == 0:
        return _empty_result(x0, "fixed_point", tol, stop_mode)
    tracker = make_tracker(x0, max_iter, tol, stop_mode, "fixed_point", keep_steps, div_factor, halt, g,
                           fixed_trip, check_every, return_f)  # fmt: skip
    x = x0.clone()
    if looped:  # step 1 as in the loop below (it sets the stored f), the rest one torch.while_loop
        fx = tracker.call(g, x)
        tracker.update(x, fx)
        if not tracker.done:
            _while_steps(g, fx.clone() if tau == 1.0 else torch.lerp(x, fx, tau), tracker, tau)
        return tracker.result(), tracker.stats()
    while True:
        fx = tracker.call(g, x)
        keep = tracker.update(x, fx)
        if tracker.done:
            break
        if keep is not None:
            x, fx = x[keep], fx[keep]
        x = fx.clone() if tau == 1.0 else torch.lerp(x, fx, tau)
    return tracker.result(), tracker.stats()


def _while_steps(g, x: torch.Tensor, tracker, tau: float) -> None:
    """Steps 2..max_iter of the fixed-trip solve as one ``torch.while_loop``: the body is the masked loop's
    step (f of the iterating rows' iterate, the stopped rows at their answer; `masked_rule`), carried as
    tensors; the tracker's state and trace are set from the loop's result."""
    n_iter, rowwise, every = tracker.max_iter, tracker.rowwise, tracker.STATE
    # the body reads locals only, never the tracker (dynamo drops the tracker's later attribute writes when
    # the traced body reads it: checked by the compile test)
    rule = functools.partial(masked_rule, rel=tracker.rel, tol=tracker.tol, max_iter=n_iter,
                             div_factor=tracker.div_factor, keep_f=tracker.keep_f)  # fmt: skip
    names = [n for n in every if n != "best_fx" or tracker.keep_f]
    steps = torch.arange(n_iter, device=x.device)

    def cond(k, x, trace, *state):
        return k < n_iter

    def body(k, x, trace, *state):
        full = {"best_fx": None, **dict(zip(names, state))}
        xin = torch.where(full["active"][:, None], x, full["best_x"])
        fx = _check_output(g(xin, None) if rowwise else g(xin), xin)
        g_sq = torch.linalg.vector_norm(fx - x, dim=1, dtype=torch.float64).double().square()
        f_sq = torch.linalg.vector_norm(fx, dim=1, dtype=torch.float64).double().square()
        new, entry = rule(tuple(full[n] for n in every), x, g_sq, f_sq, fx)
        new = dict(zip(every, new))
        x = fx.clone() if tau == 1.0 else torch.lerp(x, fx, tau)
        return (k + 1, x, torch.where(steps == k, entry, trace), *(new[n] for n in names))

    k0 = torch.ones((), dtype=torch.long, device=x.device)
    trace0 = torch.zeros(n_iter, dtype=torch.float64, device=x.device)
    out = torch.while_loop(cond, body, (k0, x, trace0, *(getattr(tracker, n) for n in names)))
    for name, value in zip(names, out[3:], strict=True):
        setattr(tracker, name, value)
    tracker.trace.extend(out[2][1:].unbind(0))
    tracker.steps, tracker.ended = n_iter, True
