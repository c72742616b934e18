"""Anderson acceleration: one method, a torch path and the fused CPU backend (`_kernels.anderson_step`) over
the same histories and the same mixing system (`deqzoo.core.hyper.least_squares_alpha` on the device; the
kernel's `_kernels.mixing_weights` is its numba coding)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..hyper import least_squares_alpha
from ._contract import (
    _NUMPY_DTYPES,
    _check_output,
    _check_solve_args,
    _check_tau,
    _empty_result,
    _fused_solve,
    _grown,
    _Pooled,
    _sq_norms,
    _to_host,
    _Tracker,
    register_solver,
)


@register_solver("anderson")
@torch.no_grad()
def anderson(
    g,
    x0,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    m: int = 6,
    lam: float = 1e-5,
    tau: float = 1.0,
    keep_steps: Iterable[int] = (),
    div_factor: float = 1e6,
):
    """Anderson acceleration (type I, constrained least squares over the last m residuals).

    The Gram matrix of the stored residuals is updated one row per step (one batched product, O(m·D)), never
    recomputed. The regularization is relative, lam · max_j ||g_j||² over the window (so
    cond(H + reg I) <= m / lam), and keeps working when residuals become tiny (an absolute lam swamps the
    Gram matrix near convergence and stalls the method). The small mixing systems of all samples are solved
    together in float64 (Cholesky: `deqzoo.core.hyper.least_squares_alpha` on the state's device, the same
    system as the kernel's `_kernels.mixing_weights`); a sample whose system is singular or not finite takes
    a plain damped fixed-point step; nothing here raises. On CPU the step is one fused kernel
    (`_kernels.anderson_step`); elsewhere the torch path below runs the same method.
    """
    from .. import _kernels  # numba loads with the first solve, not with the model
    _check_tau(tau)
    if m < 1:
        raise ValueError(f"anderson memory m must be >= 1, got {m}")
    if not lam > 0:
        raise ValueError(f"anderson regularization lam must be > 0, got {lam}")
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    if b == 0:
        return _empty_result(x0, "anderson", tol, stop_mode)
    m = min(int(m), max_iter)  # more slots than steps are never used
    if _kernels.usable(x0):
        dt = _NUMPY_DTYPES[x0.dtype]

        def make(cap):  # no zero fill: the kernel reads a slot of G, Y or H only once written
            return np.empty((b, cap, d), dt), np.empty((b, cap, d), dt), np.empty((b, cap, cap))

        def grow(arrays, cap):
            new = make(cap)
            old = arrays[0].shape[1]
            new[0][:, :old], new[1][:, :old], new[2][:, :old, :old] = arrays[0], arrays[1], arrays[2]
            return new

        hist = _Pooled(("anderson", b, d, m, x0.dtype), make, grow, m)
        try:
            return _fused_solve(
                _kernels.anderson_step, g, x0, hist, (float(lam), float(tau)), name="anderson",
                max_iter=max_iter, tol=tol, stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
        finally:
            hist.give_back()
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "anderson", keep_steps, div_factor)
    cap = min(m, 8)
    G = x0.new_empty(b, cap, d)  # g_j = f(x_j) - x_j; slots are read only once written
    Y = x0.new_empty(b, cap, d)  # f(x_j) - (1 - tau) g_j
    H = torch.zeros(b, cap, cap, dtype=torch.float64, device=x0.device)  # Gram matrix of the g_j (float64)
    x, nfe = x0.clone(), 0
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            grow = _grown(cap, k, m) - cap
            G, Y = (torch.cat((t, t.new_empty(b, grow, d)), 1) for t in (G, Y))
            H = torch.nn.functional.pad(H, (0, grow, 0, grow))
            cap += grow
        fx = g(x)
        fx = _check_output(fx, x)
        nfe += 1
        slot, n = k % cap, min(k + 1, cap)
        gi = torch.sub(fx, x, out=G[:, slot])
        torch.add(fx, gi, alpha=-(1.0 - tau), out=Y[:, slot])
        sq = _sq_norms(gi, fx)
        host = _to_host(sq)  # the step's one transfer: the stopping check
        if tracker.update_sq(x, host[0], host[1]) or nfe == max_iter:
            break
        row = torch.bmm(gi.unsqueeze(1), G[:, :n].transpose(1, 2)).view(b, n).double()  # g_slot · g_j
        H[:, slot, :n] = row
        H[:, :n, slot] = row
        H[:, slot, slot] = sq[0]
        # the weights on the device (the kernel's `_kernels.mixing_weights` is the same system); a failed
        # system (or the first step) takes a plain damped step
        alpha = least_squares_alpha(H[:, :n, :n], lam) if n > 1 else H.new_full((b, 1), float("nan"))
        plain = torch.zeros_like(alpha)
        plain[:, slot] = 1.0
        alpha = torch.where(torch.isfinite(alpha).all(1, keepdim=True), alpha, plain)
        x = tracker.next_iterate(torch.bmm(alpha.to(x.dtype).unsqueeze(1), Y[:, :n]).view(b, d))
    return tracker.result(), tracker.stats(nfe)
