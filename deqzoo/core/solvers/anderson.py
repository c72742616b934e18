"""Anderson acceleration: one method, a torch path and the fused CPU backend (`_kernels.anderson_step`) over
the same histories and the same mixing system (`_kernels.mixing_weights`)."""

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
    _into,
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
    together in float64 (`_kernels.mixing_weights`, Cholesky); a sample whose system is singular or not
    finite takes a plain damped fixed-point step; nothing here raises. On CPU the step is one fused kernel
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

        hist = _Pooled(("anderson", b, d, m, x0.dtype), make, m)
        try:
            return _fused_solve(
                _kernels.anderson_step, g, x0, hist, (float(lam), float(tau)), name="anderson",
                max_iter=max_iter, tol=tol, stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
        finally:
            hist.give_back()
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "anderson", keep_steps, div_factor)
    mixing = _kernels.host(_kernels.mixing_weights)
    cap = min(m, 8)
    G = x0.new_empty(b, cap, d)  # g_j = f(x_j) - x_j; slots are read only once written
    Y = x0.new_empty(b, cap, d)  # f(x_j) - (1 - tau) g_j
    H = np.zeros((b, cap, cap))  # Gram matrix of the g_j, on the host (float64)
    x, nfe = x0.clone(), 0
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            G, Y = _into(G.new_empty(b, cap, d), G), _into(Y.new_empty(b, cap, d), Y)
            H = _into(np.zeros((b, cap, cap)), H)
        fx = g(x)
        fx = _check_output(fx, x)
        nfe += 1
        slot, n = k % cap, min(k + 1, cap)
        gi = torch.sub(fx, x, out=G[:, slot])
        torch.add(fx, gi, alpha=-(1.0 - tau), out=Y[:, slot])
        row = torch.bmm(gi.unsqueeze(1), G[:, :n].transpose(1, 2)).view(b, n)  # g_slot · g_j, filled slots
        host = _to_host(torch.cat((row.double(), _sq_norms(gi, fx).T), 1))  # one transfer
        if tracker.update_sq(x, host[:, n], host[:, n + 1]) or nfe == max_iter:
            break
        H[:, slot, :n] = host[:, :n]
        H[:, :n, slot] = host[:, :n]
        H[:, slot, slot] = host[:, n]
        alpha = np.zeros((b, n))
        alpha[:, slot] = 1.0  # a failed system (or the first step): plain damped step
        if n > 1:
            go, n_go = tracker.go, tracker.n_go
            if hasattr(mixing, "py_func"):  # compiled: the kernel both paths share
                W, ok = np.empty((n, n_go)), np.zeros(n_go, np.bool_)
                mixing(H, go, n_go, n, lam, W, ok)
                alpha[go[:n_go][ok]] = W[:, ok].T
            else:  # not compiled (yet): the same systems as batched torch ops, not a Python loop per sample
                a = least_squares_alpha(torch.from_numpy(H[go[:n_go], :n, :n]), lam).numpy()
                ok = np.isfinite(a).all(1)
                alpha[go[:n_go][ok]] = a[ok]
        alpha_t = torch.from_numpy(alpha).to(x0.device, x0.dtype, non_blocking=True).unsqueeze(1)
        x = tracker.next_iterate(torch.bmm(alpha_t, Y[:, :n]).view(b, d))
    return tracker.result(), tracker.stats(nfe)


