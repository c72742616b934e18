"""Broyden's good method on the inverse Jacobian: a torch path and the fused CPU backend
(`_kernels.broyden_step`), and the inverse estimates SHINE reuses."""

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
    _Pooled,
    _sq_norms,
    _to_host,
    _Tracker,
    register_solver,
)


class InverseJacobian:
    """Broyden's estimate B ≈ (J_f - I)^{-1} per sample (used by SHINE).

    `matvec(y)` returns B y and `rmatvec(y)` returns yᵀ B per sample, so the adjoint of implicit
    differentiation, w = (I - J_f)^{-T} g, is approximated by ``-rmatvec(g)``. `rank` is the number of stored
    updates (the largest over the batch).
    """

    rank: int

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LowRankInverse(InverseJacobian):
    """B = -I + Σ_j u_j v_jᵀ, from the torch path of `broyden`."""

    def __init__(self, W: torch.Tensor):
        self.W = W  # (B, 2n, D): rows 2j = u_j, 2j+1 = v_j
        self.rank = W.shape[1] // 2

    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return -y
        U, V = self.W[:, 0::2].double(), self.W[:, 1::2].double()  # products in float64, as the solver's
        y64 = y.double()
        c = torch.bmm(y64.unsqueeze(1), U.transpose(1, 2))  # (B, 1, n): y · u_j
        return (-y64 + torch.bmm(c, V)[:, 0]).to(y.dtype)

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return -y
        U, V = self.W[:, 0::2].double(), self.W[:, 1::2].double()
        y64 = y.double()
        c = torch.bmm(y64.unsqueeze(1), V.transpose(1, 2))
        return (-y64 + torch.bmm(c, U)[:, 0]).to(y.dtype)


def _step_product_inverse(S: np.ndarray, Q: np.ndarray, count: np.ndarray) -> StepProductInverse:
    """The fused Broyden's final estimate from its stored steps (copied: the arrays go back to the pool);
    slots past a sample's own count hold no step and get a zero step and unit norm."""
    L = int(count.max())
    live = np.arange(L) < count[:, None]
    steps = np.where(live[:, :, None], S[:, :L], 0).astype(S.dtype)
    sn = np.where(live, Q[0, :, :L], 1.0)
    return StepProductInverse(torch.from_numpy(steps), torch.from_numpy(sn), torch.from_numpy(count.copy()))


class StepProductInverse(InverseJacobian):
    """B = P_k ... P_1 (-I) with P_j = I + s_j s_{j-1}ᵀ / |s_{j-1}|², from the fused path of `broyden`.

    S (B, L, D) holds the steps, sn (B, L) their squared norms and count (B,) how many are stored per sample.
    """

    def __init__(self, S: torch.Tensor, sn: torch.Tensor, count: torch.Tensor):
        self.S, self.count = S, count
        self.sn = sn[:, : S.shape[1]].clamp_min(1e-300)
        self.rank = S.shape[1]

    def _coef(self, a: torch.Tensor, j_norm: int, j_used: int) -> torch.Tensor:
        # pairs beyond a sample's own count do not exist for it
        live = (j_used < self.count).to(a.dtype)
        return (a / self.sn[:, j_norm].to(a.dtype) * live)[:, None]

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        w = -y.to(torch.float64)
        for j in range(1, self.rank):
            w += (
                self._coef(torch.linalg.vecdot(self.S[:, j - 1].double(), w), j - 1, j)
                * self.S[:, j].double()
            )
        return w.to(y.dtype)

    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        r = y.to(torch.float64, copy=True)  # updated in place below: never the caller's tensor
        for j in range(self.rank - 1, 0, -1):
            r += (
                self._coef(torch.linalg.vecdot(self.S[:, j].double(), r), j - 1, j)
                * self.S[:, j - 1].double()
            )
        return (-r).to(y.dtype)


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
    the torch path keeps the same estimate as B = -I + Σ_j u_j v_jᵀ with u_j = s_j and
    v_j = B_{j-1}ᵀ s_{j-1} / |s_{j-1}|² (four batched products a step). With ``return_inverse=True`` the
    final estimate is exposed as ``stats.extra["inverse_jacobian"]`` (an `InverseJacobian`) for SHINE (the
    DEQ module asks for it when b_mode is "shine").
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
            stats.extra["inverse_jacobian"] = LowRankInverse(x0.new_zeros(0, 0, d))
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

        def grow(arrays, cap):  # the steps, their norms and factors, the counts (V is scratch)
            new = make(cap)
            old = arrays[0].shape[1]
            new[0][:, :old], new[1][:, :, :old], new[2][:] = arrays[0], arrays[1], arrays[2]
            return new

        hist = _Pooled(("broyden", b, d, m, x0.dtype), make, grow, m)
        try:
            z, stats = _fused_solve(
                _kernels.broyden_step, g, x0, hist, (m,), name="broyden", max_iter=max_iter, tol=tol,
                stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
            if return_inverse:
                stats.extra["inverse_jacobian"] = _step_product_inverse(*hist.arrays[:3])
        finally:
            hist.give_back()
        return z, stats
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "broyden", keep_steps, div_factor)
    dev = x0.device
    cap = min(m, 8)
    U = x0.new_zeros(b, cap, d)  # u_j = s_j
    V = x0.new_zeros(b, cap, d)  # v_j = B_{j-1}ᵀ s_{j-1} / |s_{j-1}|² (slot 0 unused)
    sn = torch.ones(b, cap, dtype=torch.float64, device=dev)  # |s_j|²
    count = torch.zeros(b, dtype=torch.long, device=dev)
    rows = torch.arange(b, device=dev)
    x, nfe = x0.clone(), 0
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            U = torch.cat((U, U.new_zeros(b, cap - U.shape[1], d)), 1)
            V = torch.cat((V, V.new_zeros(b, cap - V.shape[1], d)), 1)
            sn = torch.cat((sn, sn.new_ones(b, cap - sn.shape[1])), 1)
        fx = g(x)
        fx = _check_output(fx, x)
        nfe += 1
        gx = fx - x
        host = _to_host(_sq_norms(gx, fx))
        if tracker.update_sq(x, host[0], host[1]) or nfe == max_iter:
            break
        n = min(k, cap)  # slots that may hold steps
        L = count
        last = (L - 1).clamp_min(0)
        p_last, sn_last = U[rows, last], sn[rows, last]
        # mixed precision, as the fused kernel (`_kernels.broyden_step`): the stored u_j, v_j stay in the
        # state's dtype, every product that decides the step is formed and summed in float64 (issue 36)
        g64, p64 = gx.double(), p_last.double()
        if n > 1:
            live = ((torch.arange(n, device=dev) < L[:, None]) & (torch.arange(n, device=dev) >= 1)).double()
            U64, V64 = U[:, :n].double(), V[:, :n].double()
            c = torch.bmm(g64.unsqueeze(1), V64.transpose(1, 2)) * live[:, None]  # v_j · g
            w = torch.baddbmm(g64.unsqueeze(1), c, U64, beta=-1.0).view(b, d)  # B g = -g + Σ u_j c_j
            e = torch.bmm(p64.unsqueeze(1), U64.transpose(1, 2)) * live[:, None]  # u_j · s_last
            bt = torch.baddbmm(p64.unsqueeze(1), e, V64, beta=-1.0).view(b, d)  # Bᵀ s_last
        else:
            w, bt = -g64, -p64
        # `_kernels.broyden_update`, vectorised: restart with no step or a degenerate denominator
        den = torch.linalg.vecdot(p64, w) + sn_last
        restart = (L == 0) | ~(torch.isfinite(den) & (den.abs() > 1e-12 * sn_last))
        factor = torch.where(restart, -1.0, -sn_last / den)[:, None]
        w = torch.where(restart[:, None], -g64, w)
        slot = torch.where(restart | (L == m), 0, L)
        s = (factor * w).to(x.dtype)  # rounded once to the state's dtype, as the kernel's step
        bt = (bt / sn_last[:, None]).to(x.dtype)
        stepping = tracker.stepping(dev)
        keep_old = ~stepping[:, None]
        U[rows, slot] = torch.where(keep_old, U[rows, slot], s)
        V[rows, slot] = torch.where(keep_old, V[rows, slot], bt)
        sn[rows, slot] = torch.where(stepping, torch.linalg.vector_norm(s, dim=1, dtype=torch.float64) ** 2,
                                     sn[rows, slot])  # fmt: skip
        count = torch.where(stepping, slot + 1, count)
        x = tracker.next_iterate(x + s)
    if not return_inverse:
        return tracker.result(), tracker.stats(nfe)
    n = int(count.max()) if b else 0
    live = ((torch.arange(n, device=dev) < count[:, None]) & (torch.arange(n, device=dev) >= 1)).to(x0.dtype)
    W = torch.stack((U[:, :n], V[:, :n] * live[:, :, None]), 2).reshape(b, 2 * n, d)
    return tracker.result(), tracker.stats(nfe, inverse_jacobian=LowRankInverse(W))


