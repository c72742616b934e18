"""Broyden's good method on the inverse Jacobian, in one representation: the steps it took. The torch path
and the fused CPU backend (`_kernels.broyden_step`) store the same steps and apply the same estimate, and
`InverseJacobian` (what SHINE reuses) is built from them whichever path ran."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ._contract import (
    _NUMPY_DTYPES,
    _check_output,
    _check_solve_args,
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


class InverseJacobian:
    """Broyden's estimate B ≈ (J_f - I)^{-1} per sample, B = P_{L-1} ... P_1 (-I) with
    P_j = I + s_j s_{j-1}ᵀ / |s_{j-1}|² over the L stored steps s_0..s_{L-1} (Deuflhard's product form).

    `matvec(y)` returns B y and `rmatvec(y)` returns yᵀ B per sample, so the adjoint of implicit
    differentiation, w = (I - J_f)^{-T} g, is approximated by ``-rmatvec(g)``. `rank` is the number of stored
    steps (the largest over the batch).

    S (B, n, D): the steps (float64 values; a sample's rows past its count[b] are finite and not used);
    M (B, n, n): their Gram matrix, computed here when not given. Applying B is the product's recursion
    w_j = w_{j-1} + c_j s_j, c_j = s_{j-1}·w_{j-1} / |s_{j-1}|², written through the Gram matrix: the c_j
    solve the lower-triangular system T c = -(s_k·y)_k, T = diag(|s_k|²) - (M[k, i+1])_{i<k}, and yᵀ B uses
    Tᵀ. So an application is two batched products and one small triangular solve on the state's device,
    whatever the number of steps (the fused kernel runs the recursion itself, one pass over the steps).
    """

    def __init__(self, S: torch.Tensor, count: torch.Tensor, M: torch.Tensor | None = None,
                 n: int | None = None):  # fmt: skip
        if n is None:  # the solver passes n (no host synchronisation per step); else the largest count
            n = int(count.max()) if count.numel() else 0
        self.S, self.count, self.rank = S[:, :n].double(), count, n
        self.M = self.S @ self.S.mT if M is None else M[:, :n, :n]
        live = torch.arange(max(n - 1, 0), device=S.device) < (count[:, None] - 1)  # rows k < L - 1
        T = self.M.diagonal(dim1=1, dim2=2)[:, :-1].diag_embed() - self.M[:, :-1, 1:].tril(-1)
        pair = live[:, :, None] & live[:, None, :]
        self.T = torch.where(pair, T, torch.eye(max(n - 1, 0), dtype=T.dtype, device=T.device))
        self.live = live.double()

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        y64 = y.double()
        if self.rank < 2:
            return -y64.to(y.dtype)
        r = torch.bmm(self.S[:, :-1], y64[:, :, None]) * self.live[:, :, None]  # s_k · y
        c = torch.linalg.solve_triangular(self.T, -r, upper=False)
        return torch.baddbmm(y64[:, None], c.mT, self.S[:, 1:], beta=-1.0)[:, 0].to(y.dtype)

    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        y64 = y.double()
        if self.rank < 2:
            return -y64.to(y.dtype)
        q = torch.bmm(self.S[:, 1:], y64[:, :, None]) * self.live[:, :, None]  # s_{k+1} · y
        d = torch.linalg.solve_triangular(self.T.mT, q, upper=True)
        return -torch.baddbmm(y64[:, None], d.mT, self.S[:, :-1])[:, 0].to(y.dtype)


# `m=None` (full memory) stores at most this many steps, then restarts as limited memory does: the history
# is bounded by it and by the steps taken, never by max_iter (a budget of 1e12 allocates nothing by itself)
MAX_MEMORY = 1024


@register_solver("broyden")
@torch.no_grad()
def broyden(
    g,
    x0,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    m: int | None = None,
    return_inverse: bool = False,
    keep_steps: Iterable[int] = (),
    div_factor: float = 1e6,
):
    """Broyden's ("good") method on the inverse Jacobian of g(x) - x, unit steps, no line search.

    With B_0 = -I the estimate after steps s_0..s_k is B_k = P_k ... P_1 B_0, P_j = I + s_j s_{j-1}ᵀ /
    |s_{j-1}|² (the good Broyden update in Deuflhard's product form), and the next step is
    s_{k+1} = -w |s_k|² / (s_k·w + |s_k|²) with w = B_k g_{k+1} (`_kernels.broyden_update`). `m=None` keeps
    every update (full memory); an integer m restarts from B = -I whenever m steps are stored (limited memory;
    dropping only the oldest pair breaks the secant conditions the later pairs were built on, and can
    diverge). A degenerate secant denominator restarts too. Steps are stored in the state's dtype; the
    history grows with the steps taken (never preallocated by max_iter).
    On CPU the step is one fused kernel (`_kernels.broyden_step`) that stores the steps and sweeps them;
    the torch path stores the same steps (float64 values rounded to the state's dtype) with their Gram matrix
    and applies B as `InverseJacobian` does (three batched products and a small triangular solve a step,
    on the device). With ``return_inverse=True`` the final estimate is exposed as
    ``stats.extra["inverse_jacobian"]`` (an `InverseJacobian`, the same class whichever path ran) for SHINE
    (the DEQ module asks for it when b_mode is "shine").
    """
    from .. import _kernels  # numba loads with the first solve, not with the model
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    m = min(max_iter, MAX_MEMORY) if m is None else int(m)
    if m < 1:
        raise ValueError(f"broyden memory m must be >= 1 or None, got {m}")
    if b == 0:
        z, stats = _empty_result(x0, "broyden", tol, stop_mode)
        if return_inverse:  # B = -I, rank 0
            no_steps = torch.zeros(0, dtype=torch.long)
            stats.extra["inverse_jacobian"] = InverseJacobian(x0.new_zeros(0, 0, d), no_steps)
        return z, stats
    m = min(m, max_iter)  # a step's slot is at most the steps taken
    if _kernels.usable(x0):
        dt = _NUMPY_DTYPES[x0.dtype]

        def make(cap):  # no zero fill: the kernel reads a stored step, norm or factor only once written
            return (
                np.empty((b, cap, d), dt),
                np.empty((2, b, cap)),
                np.empty(b, np.int64),
                np.empty((b, d)),  # w, float64 scratch (mixed precision, `_kernels._sweep`)
            )

        hist = _Pooled(("broyden", b, d, m, x0.dtype), make, m)
        try:
            z, stats = _fused_solve(
                _kernels.broyden_step, g, x0, hist, (m,), name="broyden", max_iter=max_iter, tol=tol,
                stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
            if return_inverse:
                S, count = hist.arrays[0], hist.arrays[2]  # copied: the arrays go back to the pool
                live = np.arange(int(count.max())) < count[:, None]  # unwritten rows are zero steps
                steps = np.where(live[:, :, None], S[:, : live.shape[1]], 0.0)
                inverse = InverseJacobian(torch.from_numpy(steps), torch.from_numpy(count.copy()))
                stats.extra["inverse_jacobian"] = inverse
        finally:
            hist.give_back()
        return z, stats
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "broyden", keep_steps, div_factor)
    dev = x0.device
    cap = min(m, 8)
    # the steps, float64 values rounded to the state's dtype (mixed precision, as the kernel: every product
    # that decides a step is float64, issue 36); zero-filled, since rows past a sample's count are read as 0
    S = torch.zeros(b, cap, d, dtype=torch.float64, device=dev)
    M = torch.zeros(b, cap, cap, dtype=torch.float64, device=dev)  # their Gram matrix, one row per step
    count = torch.zeros(b, dtype=torch.long, device=dev)
    rows = torch.arange(b, device=dev)
    x, nfe = x0.clone(), 0
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            S, M = _into(S.new_zeros(b, cap, d), S), _into(M.new_zeros(b, cap, cap), M)
        fx = g(x)
        fx = _check_output(fx, x)
        nfe += 1
        gx = fx - x
        host = _to_host(_sq_norms(gx, fx))
        if tracker.update_sq(x, host[0], host[1]) or nfe == max_iter:
            break
        last = (count - 1).clamp_min(0)
        g64 = gx.double()
        w = InverseJacobian(S, count, M, n=min(k, cap)).matvec(g64)  # B g
        # `_kernels.broyden_update`, vectorised: restart with no step or a degenerate denominator
        sn_last = M[rows, last, last]
        den = torch.linalg.vecdot(S[rows, last], w) + sn_last
        restart = (count == 0) | ~(torch.isfinite(den) & (den.abs() > 1e-12 * sn_last))
        factor = torch.where(restart, -1.0, -sn_last / den)[:, None]
        s = (factor * torch.where(restart[:, None], -g64, w)).to(x.dtype)  # rounded once, as the kernel's
        slot = torch.where(restart | (count == m), 0, count)
        stepping = tracker.stepping(dev)
        S[rows, slot] = torch.where(stepping[:, None], s.double(), S[rows, slot])
        row = torch.bmm(S, S[rows, slot][:, :, None])[:, :, 0]  # the new step's Gram row
        M[rows, slot] = torch.where(stepping[:, None], row, M[rows, slot])
        M[rows, :, slot] = M[rows, slot]
        count = torch.where(stepping, slot + 1, count)
        x = tracker.next_iterate(x + s)
    if not return_inverse:
        return tracker.result(), tracker.stats(nfe)
    return tracker.result(), tracker.stats(nfe, inverse_jacobian=InverseJacobian(S, count, M))
