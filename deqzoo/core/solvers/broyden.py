"""Broyden's good method on the inverse Jacobian, in one representation: the steps it took (per sample, in
torch on the state's device), and `InverseJacobian` (what SHINE reuses) built from them."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..halting import Step, StopRule
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


# DEQ-Flow v1.0's Broyden (code.v.1.0/core/lib/solvers.py) stops on "hardly any progress": after more
# than `stall_window` (30) steps, the residual below STALL_FACTOR x tol and the last `stall_window`
# residuals within a ratio of STALL_RATIO of each other
STALL_FACTOR, STALL_RATIO = 3.0, 1.3


class OriginalBreaks(StopRule):
    """DEQ-Flow v1.0 Broyden's two extra stop rules, per sample (the original applies them to the whole
    batch's residual; per sample they are the same rules for a batch of one). Added to a broyden solve by its
    options ``stall_window`` and ``protect_per_element`` (the converter of v1.0 releases writes them).

    The original's trace holds the residuals of its iterates x_1, x_2, ... (not of x0), ``nstep`` counting
    them; here a row's n-th f evaluation measures x_{n-1}, so nstep = nfe - 1.

    - stall (``stall_window`` = w > 0): nstep > w, residual < 3 tol and max / min of the last w residuals
      < 1.3 ("hardly any progress in the last 30 steps").
    - protective break (``protect_per_element`` = p > 0): residual > p · D · (the first traced residual),
      D the state's size per sample. The original's threshold is (1e6 for abs, 1e3 for rel) times its
      number of positions L, with D = C · L for a (C, L) state: p = 1e6 / C or 1e3 / C.

    Example:
        >>> import torch
        >>> from deqzoo.core import solve
        >>> f = lambda z: torch.cat([0.5 * z[:, :1] + 1, z[:, 1:] + 2e-3 + 1e-4 * torch.cos(z[:, 1:])], 1)
        >>> z0 = torch.zeros(1, 2, dtype=torch.float64)  # no root: the residual stalls near 4e-3
        >>> [solve(f, z0, solver="broyden", max_iter=100, tol=1.5e-3, stop_mode="abs", stall_window=w)[1].nfe
        ...  for w in (0, 30)]  # without the rule, the whole budget
        [100, 39]
    """

    def __init__(self, tol: float, stop_mode: str, stall_window: int, protect_per_element: float, dim: int):
        if stall_window < 0 or not protect_per_element >= 0:
            raise ValueError(f"broyden: stall_window must be >= 0 and protect_per_element >= 0, got "
                             f"{stall_window} and {protect_per_element}")
        self.tol, self.rel, self.window = tol, stop_mode == "rel", stall_window
        self.protect = protect_per_element * dim

    def start(self, batch: int, device: torch.device) -> None:
        self.hist = torch.full((batch, max(self.window, 1)), math.nan, dtype=torch.float64, device=device)
        self.first = torch.full((batch,), math.nan, dtype=torch.float64, device=device)

    def __call__(self, step: Step) -> torch.Tensor:
        r = (step.rel_residual if self.rel else step.abs_residual).double()
        nstep, rows = step.nfe - 1, step.rows
        stop = torch.zeros_like(r, dtype=torch.bool)
        traced = nstep >= 1
        if self.window:
            slot = (nstep - 1).clamp_min(0) % self.window
            self.hist[rows[traced], slot[traced]] = r[traced]
            h = self.hist[rows]
            stall = (nstep > self.window) & (r < STALL_FACTOR * self.tol)
            stop |= stall & (h.amax(1) / h.amin(1) < STALL_RATIO)
        if self.protect:
            first = nstep == 1
            self.first[rows[first]] = r[first]
            stop |= traced & (r > self.first[rows] * self.protect)
        return stop


class _BatchStop(StopRule):
    """The 2020 MDEQ release's stop rule (locuslab/mdeq lib/modules/broyden.py), for ``best="batch"``: every
    row stops together once the batch's residual per element, sqrt(sum over rows of |f(x) - x|² / (B D)),
    is below tol, or is not finite (its loop test ``objective >= eps`` is False for NaN). Its eps =
    1e-5 sqrt(B D) on the whole batch's norm (lib/modules/deq2d.py) is this rule with tol = 1e-5, whatever
    the input's size."""

    def __init__(self, tol: float, dim: int):
        self.tol, self.dim = tol, dim

    def __call__(self, step: Step) -> torch.Tensor:
        batch = (step.abs_residual.double().square().mean() / self.dim).sqrt()
        stop = (batch < self.tol) | ~torch.isfinite(batch)
        return stop.expand(step.abs_residual.shape[0])


# `m=None` (full memory) stores at most this many steps, then restarts as limited memory does: the history
# is bounded by it and by the steps taken, never by max_iter (a budget of 1e12 allocates nothing by itself)
MAX_MEMORY = 1024


@register_solver("broyden")
@torch.no_grad()
def broyden(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", m: int | None = None,
            return_inverse: bool = False, keep_steps: Iterable[int] = (), div_factor: float = 1e6, halt=None,
            stall_window: int = 0, protect_per_element: float = 0.0, best: str = "sample"):
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

    ``stall_window`` > 0 and ``protect_per_element`` > 0 add DEQ-Flow v1.0's two extra stop rules (its
    ``lib/solvers.py`` broyden), per sample: `OriginalBreaks`.

    ``best="sample"`` (the default) returns each sample's lowest-residual iterate and stops each sample on
    its own. ``best="batch"`` is the 2020 MDEQ release's rule (locuslab/mdeq ``lib/modules/broyden.py``):
    every row iterates until the batch's residual per element sqrt(Σ_b |f(x_b) - x_b|² / (B D)) is below
    tol (`_BatchStop`; ``stop_mode`` must be "abs") or the budget is spent, and the iterate with the
    lowest batch residual (the first on ties, x0 included) is returned for every row; the per-row
    statistics are those of that iterate. Per-sample stop rules (v1.0's, ``halt``) are not combined with it.

    Example:
        >>> import torch
        >>> from deqzoo.core import solve
        >>> f = lambda z: torch.tanh(z @ torch.tensor([[0.5, 0.2], [-0.3, 0.4]], dtype=z.dtype) + 1)
        >>> z0 = torch.zeros(3, 2, dtype=torch.float64)
        >>> z, st = solve(f, z0, solver="broyden", max_iter=30, tol=1e-10, stop_mode="abs", best="batch")
        >>> bool((f(z) - z).abs().max() < 1e-8), st.nfe_per_sample.unique().numel()  # the rows stop together
        (True, 1)
    """
    _check_solve_args(max_iter, tol, stop_mode)
    if best not in ("sample", "batch"):
        raise ValueError(f"broyden: best must be 'sample' or 'batch', got {best!r}")
    batch_best = best == "batch"
    # per-row stop rules would take rows out of the batch the release iterates as one
    if batch_best and (stop_mode != "abs" or stall_window or protect_per_element or return_inverse
                       or halt is not None):  # fmt: skip
        raise ValueError("broyden: best='batch' (the 2020 MDEQ release's rule) needs stop_mode='abs' and no "
                         "stall_window, protect_per_element, return_inverse or halt rules")
    if batch_best:
        halt = _BatchStop(tol, x0.shape[1])
    if stall_window or protect_per_element:
        extra = OriginalBreaks(tol, stop_mode, int(stall_window), float(protect_per_element), x0.shape[1])
        halt = (extra,) if halt is None else (*((halt,) if isinstance(halt, StopRule) else halt), extra)
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
    # best="batch": no row stops on its own residual or divergence (tol below any residual), only by
    # `_BatchStop`, a non-finite value or the budget, all rows at the same step
    tracker = _Tracker(x0, max_iter, 5e-324 if batch_best else tol, stop_mode, "broyden", keep_steps,
                       math.inf if batch_best else div_factor, halt, g)
    if batch_best:
        lowest = torch.full((), math.inf, dtype=torch.float64, device=x0.device)
        lowest_x, lowest_sq = x0, None
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
        sq = _sq_norms(gx, fx)
        keep = tracker.update_sq(x, *sq, fx)
        if batch_best and x.shape[0] == b:  # all rows still iterate (they stop together)
            batch_sq = sq[0].sum()
            improved = batch_sq < lowest  # strict: the first lowest step wins, as the original's
            lowest = torch.where(improved, batch_sq, lowest)
            lowest_x = torch.where(improved, x, lowest_x)
            lowest_sq = sq if lowest_sq is None else torch.where(improved, sq, lowest_sq)
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
    if batch_best:
        _set_batch_best(tracker, lowest_x, lowest_sq, tol)
    if not return_inverse:
        return tracker.result(), tracker.stats()
    return tracker.result(), tracker.stats(inverse_jacobian=_assemble(retired, b, d, dev))


def _set_batch_best(tracker: _Tracker, x: torch.Tensor, sq: torch.Tensor | None, tol: float) -> None:
    """Make the tracker's answer the lowest batch-residual iterate x for every row (best="batch")."""
    tracker.result()  # writes the rows still held into the whole-batch arrays first
    tracker.tol = tol
    if sq is None:  # no finite batch residual: x0
        return
    a = sq[0].sqrt()
    tracker.best_x.copy_(x)
    tracker.best.copy_(torch.stack((a, a / (sq[1].sqrt() + 1e-12))))


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
