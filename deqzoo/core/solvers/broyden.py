"""Broyden's good method on the inverse Jacobian, in one representation: the steps it took (per sample, in
torch on the state's device), and `InverseJacobian` (what SHINE reuses) built from them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._contract import (
    _check_solve_args,
    _empty_result,
    _grown,
    _into,
    _sq_norms,
    _Tracker,
    bmm,
    compact,
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
        r = bmm(y64[:, None], self.S[:, :-1].mT).mT * self.live[:, :, None]  # s_k · y (a row times the steps)
        c = torch.linalg.solve_triangular(self.T, -r, upper=False)
        return bmm(c.mT, self.S[:, 1:], y64[:, None], beta=-1.0)[:, 0].to(y.dtype)

    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        y64 = y.double()
        if self.rank < 2:
            return -y64.to(y.dtype)
        q = bmm(y64[:, None], self.S[:, 1:].mT).mT * self.live[:, :, None]  # s_{k+1} · y
        d = torch.linalg.solve_triangular(self.T.mT, q, upper=True)
        return -bmm(d.mT, self.S[:, :-1], y64[:, None])[:, 0].to(y.dtype)


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
    halt=None,
):
    """Broyden's ("good") method on the inverse Jacobian of g(x) - x, unit steps, no line search.

    With B_0 = -I the estimate after steps s_0..s_k is B_k = P_k ... P_1 B_0, P_j = I + s_j s_{j-1}ᵀ /
    |s_{j-1}|² (the good Broyden update in Deuflhard's product form), and the next step is
    s_{k+1} = -w |s_k|² / (s_k·w + |s_k|²) with w = B_k g_{k+1}. `m=None` keeps every update (full memory);
    an integer m restarts from B = -I whenever m steps are stored (limited memory; dropping only the oldest
    pair breaks the secant conditions the later pairs were built on, and can diverge). A degenerate secant
    denominator restarts too. The steps are stored as float64 values rounded to the state's dtype, with
    their Gram matrix; every product that decides a step is float64 (issue 36), and B is applied as
    `InverseJacobian` does (batched products and a small triangular solve a step, on the device). The
    history grows with the steps taken (never preallocated by max_iter), is kept per row and compacted with
    the rows still iterating. With ``return_inverse=True`` the final estimate is exposed as
    ``stats.extra["inverse_jacobian"]`` (an `InverseJacobian` over the whole batch) for SHINE (the DEQ
    module asks for it when b_mode is "shine").
    """
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
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "broyden", keep_steps, div_factor, halt, g)
    dev = x0.device
    cap = min(m, 8)
    # zero-filled, since rows past a sample's count are read as 0
    S = torch.zeros(b, cap, d, dtype=torch.float64, device=dev)
    M = torch.zeros(b, cap, cap, dtype=torch.float64, device=dev)  # their Gram matrix, one row per step
    count = torch.zeros(b, dtype=torch.long, device=dev)
    retired: list[tuple] = []  # (rows, S, M, count) of rows that stopped, for the inverse estimate
    x = x0.clone()
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            S, M = _into(S.new_zeros(S.shape[0], cap, d), S), _into(M.new_zeros(M.shape[0], cap, cap), M)
        rows = tracker.rows
        fx = tracker.call(g, x)
        gx = fx - x
        keep = tracker.update_sq(x, *_sq_norms(gx, fx), fx)
        if keep is not None and return_inverse:
            gone = ~keep
            retired.append((rows[gone], S[gone], M[gone], count[gone]))
        if tracker.done:
            break
        if keep is not None:
            x, gx, S, M, count = compact(keep, x, gx, S, M, count)
        idx = torch.arange(x.shape[0], device=dev)
        last = (count - 1).clamp_min(0)
        g64 = gx.double()
        w = InverseJacobian(S, count, M, n=min(k, cap)).matvec(g64)  # B g
        sn_last = M[idx, last, last]
        den = torch.linalg.vecdot(S[idx, last], w) + sn_last
        restart = (count == 0) | ~(torch.isfinite(den) & (den.abs() > 1e-12 * sn_last))
        factor = torch.where(restart, -1.0, -sn_last / den)[:, None]
        s = (factor * torch.where(restart[:, None], -g64, w)).to(x.dtype)  # rounded once
        slot = torch.where(restart | (count == m), 0, count)
        S[idx, slot] = s.double()
        row = bmm(S[idx, slot][:, None], S.mT)[:, 0]  # the new step's Gram row
        M[idx, slot] = row
        M[idx, :, slot] = row
        count = slot + 1
        x = x + s
    if not return_inverse:
        return tracker.result(), tracker.stats()
    return tracker.result(), tracker.stats(inverse_jacobian=_assemble(retired, b, d, dev))


def _assemble(retired: list[tuple], b: int, d: int, dev: torch.device) -> InverseJacobian:
    """The whole batch's inverse estimate from the per-row histories kept as rows stopped."""
    cap = max(s.shape[1] for _, s, _, _ in retired)
    S = torch.zeros(b, cap, d, dtype=torch.float64, device=dev)
    M = torch.zeros(b, cap, cap, dtype=torch.float64, device=dev)
    count = torch.zeros(b, dtype=torch.long, device=dev)
    for rows, s, mm, c in retired:
        S[rows, : s.shape[1]] = s
        M[rows, : mm.shape[1], : mm.shape[2]] = mm
        count[rows] = c
    return InverseJacobian(S, count, M)
