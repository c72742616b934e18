"""Anderson acceleration (type I), per sample, in torch on the state's device."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..hyper import least_squares_alpha
from ._contract import (
    _check_solve_args,
    _check_tau,
    _empty_result,
    _grown,
    _into,
    _sq_norms,
    bmm,
    compact,
    make_tracker,
    register_solver,
)


@register_solver("anderson")
@torch.no_grad()
def anderson(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", m: int = 6, lam: float = 1e-5,
             tau: float = 1.0, keep_steps: Iterable[int] = (), div_factor: float = 1e6, halt=None,
             lam_mode: str = "rel", fixed_trip: bool | None = None, check_every: int = 4,
             return_f: bool = False):
    """Anderson acceleration (type I, constrained least squares over the last m residuals).

    The Gram matrix of the stored residuals is updated one row per step (one batched product, O(m·D)), never
    recomputed. The regularization is relative, lam · max_j ||g_j||² over the sample's own window (so
    cond(H + reg I) <= m / lam), and keeps working when residuals become tiny (an absolute lam swamps the
    Gram matrix near convergence and stalls the method). Each sample's small mixing system is solved in
    float64 on the device (`deqzoo.core.hyper.least_squares_alpha`, batched Cholesky); a sample whose system
    is singular or not finite takes a plain damped fixed-point step; nothing here raises. Histories are kept
    per row and compacted with the rows that still iterate (`deqzoo.core.halting`), so a sample's answer
    does not depend on its batch-mates. ``fixed_trip`` / ``check_every``: the masked fixed-trip loop (the
    default under `torch.compile`; see `deqzoo.core.solvers.fixed_point`). ``return_f``: f of each row's
    best iterate, already computed, instead of the iterate (``solve(final="stored")``).

    ``lam_mode="abs"`` regularises with lam itself, H + lam I, as the original releases do (DEQ-Flow v1.0 and
    v2.0, locuslab/deq, TorchDEQ: lam 1e-4), so a converted checkpoint can run its original's Anderson.
    """
    _check_tau(tau)
    if m < 1:
        raise ValueError(f"anderson memory m must be >= 1, got {m}")
    if not lam > 0:
        raise ValueError(f"anderson regularization lam must be > 0, got {lam}")
    if lam_mode not in ("rel", "abs"):
        raise ValueError(f"anderson lam_mode must be 'rel' or 'abs', got {lam_mode!r}")
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    if b == 0:
        return _empty_result(x0, "anderson", tol, stop_mode)
    m = min(int(m), max_iter)  # more slots than steps are never used
    tracker = make_tracker(x0, max_iter, tol, stop_mode, "anderson", keep_steps, div_factor, halt, g,
                           fixed_trip, check_every, return_f)  # fmt: skip
    cap = min(m, 8)
    G = x0.new_empty(b, cap, d)  # g_j = f(x_j) - x_j; slots are read only once written
    Y = x0.new_empty(b, cap, d)  # f(x_j) - (1 - tau) g_j
    H = x0.new_zeros(b, cap, cap, dtype=torch.float64)  # Gram matrix of the g_j (float64)
    x = x0.clone()
    for k in range(max_iter):
        n_rows = x.shape[0]
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            G, Y = _into(G.new_empty(n_rows, cap, d), G), _into(Y.new_empty(n_rows, cap, d), Y)
            H = _into(H.new_zeros(n_rows, cap, cap), H)
        fx = tracker.call(g, x)
        slot, n = k % cap, min(k + 1, cap)
        gi = fx - x  # stored by assignment: dynamo refuses `out=` into a strided slot
        G[:, slot] = gi
        Y[:, slot] = fx if tau == 1.0 else torch.add(fx, gi, alpha=-(1.0 - tau))
        keep = tracker.update_sq(x, *_sq_norms(gi, fx), fx)
        if tracker.done:
            break
        if keep is not None:
            x, gi, G, Y, H = compact(keep, x, gi, G, Y, H)
            n_rows = x.shape[0]
        # g_slot · g_j over the filled slots, as a row times the window (a matrix times a column runs ~10x
        # slower on CPU)
        row = bmm(gi.unsqueeze(1), G[:, :n].transpose(1, 2)).view(n_rows, n).double()
        H[:, slot, :n] = row
        H[:, :n, slot] = row
        if n > 1:
            if lam_mode == "abs":  # the originals' H + lam I (issue 58); least_squares_alpha adds ~0 more
                eye = torch.eye(n, dtype=H.dtype, device=H.device)
                alpha = least_squares_alpha(H[:, :n, :n] + lam * eye, 0.0)
            else:
                alpha = least_squares_alpha(H[:, :n, :n], lam)
            ok = (alpha.abs() < math.inf).all(1, keepdim=True)  # isfinite in two ops
            plain = torch.zeros_like(alpha)
            plain[:, slot] = 1.0  # a failed system: plain damped step
            alpha = torch.where(ok, alpha, plain)
            x = bmm(alpha.to(x.dtype).unsqueeze(1), Y[:, :n]).view(n_rows, d)
        else:
            x = Y[:, slot].clone()
    return tracker.result(), tracker.stats()
