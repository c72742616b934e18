"""Fused per-sample CPU steps for Anderson and Broyden, compiled with numba, and the per-step bookkeeping
that both paths of those solvers share.

Why: on CPU a solver step written as torch ops pays several microseconds of dispatch per op and streams the
solver's history through memory once per op, which costs more than f itself for small f. Here one call does a
whole step for every sample: residual and norms, best-iterate bookkeeping, the history update, the small
mixing or quasi-Newton system, and the next iterate, visiting each sample's history while it is in cache.

One semantics on every path: `track` is the bookkeeping of a step (per-sample best residual and iterate,
freezing of converged samples, the trace entry and the stop flags). The fused steps call it inside the
kernel; the torch path (`deqzoo.core.solvers`) calls the same function on the per-sample norms it brings to
the host, `mixing_weights` is Anderson's small system on both paths, and `broyden_step` sweeps the same
stored steps that `solvers.broyden.InverseJacobian` applies.

Kernels receive numpy arrays only (never raw addresses): the solvers check f's output positively before
they hand a view of it over (`deqzoo.core.solvers._contract._readable`), and numba checks every array's type,
dimension and layout when it unboxes it. The iterate f is called on (``x``) is never the array the kernel
writes the next one into (``xn``; see `_contract._Iterates`).

Anderson's norms and Gram rows accumulate in the state's dtype over many vector lanes (float32: ~1e-7
relative, as a BLAS dot), in float64 when that overflows; its small systems are solved in float64. Broyden
forms and sums every product that decides its step in float64 (its stored steps stay in the state's dtype):
its float32 chain of dot products otherwise rounds differently with the CPU's vector width, and on
ill-conditioned systems that decided between converging and stalling (issue 36). Either way the results do
not depend on numba's target CPU beyond float64 rounding (tests/core/test_core_hard_systems.py reruns with
``NUMBA_CPU_NAME=generic``).

The solvers use these kernels for CPU float32/float64 states when numba imports, ``DEQZOO_KERNELS`` is not
``0`` and the kernels are compiled (`ready`; on first use they compile in the background, see
`warm_up`); otherwise they run their torch path, which implements the same method.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

try:
    import numba

    AVAILABLE = True
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None
    AVAILABLE = False

ENABLED = os.environ.get("DEQZOO_KERNELS", "1") != "0"

__all__ = [
    "AVAILABLE", "CONVERGED", "DIVERGED", "ENABLED", "NONFINITE", "anderson_step", "broyden_step",
    "host", "mixing_weights", "ready", "track", "usable", "warm_up",
]  # fmt: skip

logger = logging.getLogger("deqzoo")

# reassociation and contraction let LLVM vectorise the reductions; no "nnan"/"ninf": NaN detection must work
_FLAGS = {"reassoc", "contract", "nsz"}


def _jit(fn=None, inline="never"):
    """numba.njit with the module's settings; ``inline="always"`` inlines at numba's IR level."""
    if fn is None:
        return lambda f: _jit(f, inline)
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, fastmath=_FLAGS, nogil=True, inline=inline)(fn)


@_jit
def _copy(dst, src):
    """dst[:] = src for 1-D views (an explicit loop vectorises; numba's slice assignment does not)."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@_jit
def _dot(u, v):
    """u·v summed in v's dtype, returned as float64. With reassociation allowed the loop becomes several
    vector accumulators and one horizontal sum (float32 sums of 512 products err by ~1e-7 relative, as a
    BLAS dot would)."""
    s = v.dtype.type(0.0)
    for i in range(u.shape[0]):
        s += u[i] * v[i]
    return np.float64(s)


@_jit(inline="always")
def _sq_norms(g_sq, fx_sq, fb, xb):
    """|f - x|², |f|² as float64 from sums taken in fb's dtype; where those overflowed, summed again in
    float64 (exact), so a finite state never reads as non-finite."""
    g2, f2 = np.float64(g_sq), np.float64(fx_sq)
    if np.isfinite(g2) and np.isfinite(f2):
        return g2, f2
    g2, f2 = 0.0, 0.0
    for i in range(fb.shape[0]):
        gi = np.float64(fb[i]) - np.float64(xb[i])
        g2 += gi * gi
        f2 += np.float64(fb[i]) * np.float64(fb[i])
    return g2, f2


CONVERGED, NONFINITE, DIVERGED = 1, 2, 4  # the status flags of a step (0: keep going)


@_jit
def track(g_sq, f_sq, best, active, improved, go, rel_mode, tol, div_factor):
    """The bookkeeping of one step, shared by every path of Anderson and Broyden (and the other solvers).

    g_sq, f_sq: per-sample |f(x) - x|² and |f(x)|² (float64; read for active samples only). best (2, B):
    best absolute and relative residuals so far; active (B,): 1 while a sample iterates. Sets improved[b]
    where x[b] becomes sample b's best iterate (the caller copies it), freezes (active = 0) the samples whose
    best residual is below tol, and lists in go[:n_go] the samples that take a step. Returns (flags,
    trace entry, n_go): the trace entry is the step's largest residual in the stop mode (frozen samples count
    with their best; NaN if any is not finite); the flags are CONVERGED when every best residual is below
    tol, NONFINITE when a residual is not finite, DIVERGED when the largest absolute residual exceeds
    div_factor times the largest best one.
    """
    B = best.shape[1]
    r_max, step_abs_max, n_bad, n_go = 0.0, 0.0, 0, 0
    for b in range(B):
        improved[b] = False
        if active[b]:
            a = np.sqrt(g_sq[b])
            rel = a / (np.sqrt(f_sq[b]) + 1e-12)
            r = rel if rel_mode else a
            if not np.isfinite(r):
                n_bad += 1
                continue
            step_abs_max = max(step_abs_max, a)
            r_max = max(r_max, r)
            if r < (best[1, b] if rel_mode else best[0, b]):
                best[0, b] = a
                best[1, b] = rel
                improved[b] = True
            if (best[1, b] if rel_mode else best[0, b]) < tol:
                active[b] = 0
            else:
                go[n_go] = b
                n_go += 1
        else:
            r_max = max(r_max, best[1, b] if rel_mode else best[0, b])
    best_max, best_abs_max = 0.0, 0.0
    for b in range(B):
        best_max = max(best_max, best[1, b] if rel_mode else best[0, b])
        best_abs_max = max(best_abs_max, best[0, b])
    flags = CONVERGED if best_max < tol else 0
    if n_bad > 0:
        flags |= NONFINITE
    elif step_abs_max > div_factor * max(best_abs_max, 1e-30):
        flags |= DIVERGED
    return flags, (r_max if n_bad == 0 else np.nan), n_go


@_jit
def _settle(x, xn, best_x, active, improved):
    """After `track`: improved iterates copied to best_x, and every sample that takes no step (frozen, or a
    non-finite residual) gets its best iterate as its next one."""
    for b in range(x.shape[0]):
        if improved[b]:
            _copy(best_x[b], x[b])
        if not active[b]:
            _copy(xn[b], best_x[b])


@_jit
def mixing_weights(H, go, n_go, n, lam, W, ok):
    """Anderson's mixing weights, alpha = a / sum(a) with (H[b] + reg I) a = 1, reg = lam · max_j H[b]_jj,
    for the samples b = go[k] into W[:, k]; ok[k] is False where a Cholesky pivot is not positive or alpha is
    not finite (the caller then takes a plain damped step). Both paths of `anderson` use it;
    `deqzoo.core.hyper.least_squares_alpha` is the same system in torch ops, for HyperAnderson's
    differentiable unroll (tested equal).

    All samples at once, samples innermost: a 6x6 Cholesky is a chain of divisions and square roots, so one
    system at a time is latency-bound, while across samples every operation is a vector operation."""
    A = np.empty((n, n, n_go))  # lower factor, reciprocal diagonal
    c = np.empty((n, n_go))
    s = np.empty(n_go)
    for k in range(n_go):
        hb = H[go[k]]
        reg = 0.0
        for i in range(n):
            reg = max(reg, hb[i, i])
            for j in range(i + 1):
                A[i, j, k] = hb[i, j]
        reg = reg * lam + 1e-300
        for i in range(n):
            A[i, i, k] += reg
        ok[k] = True
    for i in range(n):
        for j in range(i + 1):
            for k in range(n_go):
                s[k] = A[i, j, k]
            for p in range(j):
                for k in range(n_go):
                    s[k] -= A[i, p, k] * A[j, p, k]
            if i == j:
                for k in range(n_go):
                    ok[k] = ok[k] and s[k] > 0.0  # also catches NaN
                    A[i, i, k] = 1.0 / np.sqrt(abs(s[k]) + 1e-300)
            else:
                for k in range(n_go):
                    A[i, j, k] = s[k] * A[j, j, k]
    for i in range(n):  # forward: L z = 1
        for k in range(n_go):
            s[k] = 1.0
        for p in range(i):
            for k in range(n_go):
                s[k] -= A[i, p, k] * c[p, k]
        for k in range(n_go):
            c[i, k] = s[k] * A[i, i, k]
    for i in range(n - 1, -1, -1):  # backward: Lᵀ a = z
        for k in range(n_go):
            s[k] = c[i, k]
        for p in range(i + 1, n):
            for k in range(n_go):
                s[k] -= A[p, i, k] * c[p, k]
        for k in range(n_go):
            c[i, k] = s[k] * A[i, i, k]
    for k in range(n_go):
        total = 0.0
        for i in range(n):
            total += c[i, k]
        ok[k] = ok[k] and np.isfinite(total) and total != 0.0
        for i in range(n):
            W[i, k] = c[i, k] / total


@_jit
def anderson_step(k, fx, x, xn, best_x, G, Y, H, best, active, lam, tau, rel_mode, tol, div_factor):
    """Step k of Anderson for every active sample: f(x) = fx, the next iterates into xn.

    G[b, j] holds residuals g_j = f(x_j) - x_j, Y[b, j] the damped images f(x_j) - (1 - tau) g_j, H[b] their
    Gram matrix (float64); step k uses slot k % m of the m = G.shape[1] slots (the caller grows them while
    k < its memory). The mixing weights come from `mixing_weights`; a failed system falls back to a plain
    damped step. Returns `track`'s (flags, trace entry, n_go).
    """
    B, d = fx.shape
    m = G.shape[1]
    slot, n = k % m, min(k + 1, m)
    keep = fx.dtype.type(1.0 - tau)
    g2 = np.empty(B)
    f2 = np.empty(B)
    # 1. residuals and norms; the residual and the damped image go straight into their history slots
    for b in range(B):
        if not active[b]:
            continue
        gs, ys, xb, fb = G[b, slot], Y[b, slot], x[b], fx[b]
        g_sq = fx.dtype.type(0.0)
        fx_sq = fx.dtype.type(0.0)
        for i in range(d):
            gi = fb[i] - xb[i]
            gs[i] = gi
            ys[i] = fb[i] - keep * gi
            g_sq += gi * gi
            fx_sq += fb[i] * fb[i]
        g2[b], f2[b] = _sq_norms(g_sq, fx_sq, fb, xb)
    # 2. the shared bookkeeping
    improved = np.empty(B, np.bool_)
    go = np.empty(B, np.int64)
    flags, trace, n_go = track(g2, f2, best, active, improved, go, rel_mode, tol, div_factor)
    _settle(x, xn, best_x, active, improved)
    if flags & NONFINITE:
        return flags, trace, n_go
    # 3. the Gram rows and mixing weights of the stepping samples
    for q in range(n_go):
        b = go[q]
        gs = G[b, slot]
        H[b, slot, slot] = g2[b]
        for j in range(n):
            if j != slot:
                s = _dot(G[b, j], gs)
                H[b, slot, j] = s
                H[b, j, slot] = s
    W = np.empty((n, n_go))
    ok = np.zeros(n_go, np.bool_)
    if n > 1:
        mixing_weights(H, go, n_go, n, lam, W, ok)
    # 4. the next iterates
    acc = np.empty(d, fx.dtype)
    for q in range(n_go):
        b = go[q]
        ob = xn[b]
        if not ok[q]:  # first step, or a singular or ill-posed mixing system: plain damped step, never raise
            _copy(ob, Y[b, slot])
            continue
        # sum_j alpha_j Y_j: the first term initialises the L1-resident accumulator, the last writes out
        w = fx.dtype.type(W[0, q])
        y0 = Y[b, 0]
        for i in range(d):
            acc[i] = w * y0[i]
        for j in range(1, n - 1):
            w = fx.dtype.type(W[j, q])
            yj = Y[b, j]
            for i in range(d):
                acc[i] += w * yj[i]
        w = fx.dtype.type(W[n - 1, q])
        yl = Y[b, n - 1]
        for i in range(d):
            ob[i] = acc[i] + w * yl[i]
    return flags, trace, n_go


@_jit
def _sweep(Sb, cb, L, v, d):
    """v <- P_{L-1} ... P_1 v with P_j = I + s_j s_{j-1}ᵀ / |s_{j-1}|² for one sample (L >= 1), where row
    Sb[j] is s_j, cb[j] = 1 / |s_{j-1}|² and d = Sb[0]·v on entry. Returns Sb[L-1]·v (the step's
    denominator needs it). A chain: each coefficient needs the previous update, so the pass that adds row j
    to v also takes row j's dot product with the updated v. v, the coefficients and the dot products are
    float64 (mixed precision: see `broyden_step`)."""
    e = d
    for j in range(1, L):
        c = e * cb[j]
        row = Sb[j]
        s = 0.0
        for i in range(v.shape[0]):
            r = np.float64(row[i])
            t = v[i] + c * r
            v[i] = t
            s += r * t
        e = s
    return e


@_jit
def _sweep_pair(Sa, ca, La, va, da, Sb, cb, Lb, vb, db):
    """`_sweep` for two samples at once: each chain waits on its own dot product at every row; side by side,
    one chain's arithmetic fills the other's wait. Returns (da, db) as `_sweep` does."""
    ea = da
    eb = db
    for j in range(1, min(La, Lb)):
        xa = ea * ca[j]
        xb = eb * cb[j]
        ra = Sa[j]
        rb = Sb[j]
        sa = 0.0
        sb = 0.0
        for i in range(va.shape[0]):
            r = np.float64(ra[i])
            t = va[i] + xa * r
            va[i] = t
            sa += r * t
            q = np.float64(rb[i])
            u = vb[i] + xb * q
            vb[i] = u
            sb += q * u
        ea = sa
        eb = sb
    da = ea
    db = eb
    n = max(min(La, Lb), 1)
    if La > n:
        da = _sweep(Sa[n - 1 :], ca[n - 1 :], La - n + 1, va, da)
    if Lb > n:
        db = _sweep(Sb[n - 1 :], cb[n - 1 :], Lb - n + 1, vb, db)
    return da, db


@_jit(inline="always")
def broyden_update(L, m, dL, sn_last):
    """The step rule of Broyden's product form, shared by both paths: with L stored steps, the last one of
    squared norm sn_last, and dL = s_{L-1}·w for w = B g, returns (slot, factor): the new step is factor · w
    and goes to `slot`. No stored step, or a degenerate secant denominator: restart from B_0 = -I (slot 0,
    factor -1 with w taken as -g, a fixed-point step); a full memory (L = m) restarts too, keeping the new
    step as the first of the new cycle."""
    if L == 0:
        return 0, -1.0
    den = dL + sn_last
    if not (np.isfinite(den) and abs(den) > 1e-12 * sn_last):
        return 0, np.nan  # NaN: restart, and w must be reset to -g
    return (0 if L == m else L), -sn_last / den


@_jit(inline="always")
def _broyden_store(b, v, dL, x, fx, xn, S, Q, count, m):
    """Sample b's step from its swept w in v (dL: its last stored step dotted with w): the next iterate into
    xn[b] and the step stored as S[b, slot]."""
    sn, coef = Q[0], Q[1]
    d, L = v.shape[0], count[b]
    xb, fb, ob = x[b], fx[b], xn[b]
    slot, factor = broyden_update(L, m, dL, sn[b, L - 1] if L > 0 else 0.0)
    if np.isnan(factor):
        factor = -1.0
        for i in range(d):
            v[i] = np.float64(xb[i] - fb[i])  # -g, as the first pass wrote it
    T = fx.dtype.type
    sl = S[b, slot]
    q_sq = 0.0
    for i in range(d):  # the step (rounded once to the state's dtype), the next iterate, the stored step
        si = T(factor * v[i])
        ob[i] = xb[i] + si
        sl[i] = si
        q_sq += np.float64(si) * np.float64(si)
    sn[b, slot] = q_sq
    coef[b, slot] = 1.0 / sn[b, slot - 1] if slot > 0 else 0.0
    count[b] = slot + 1


@_jit
def broyden_step(k, fx, x, xn, best_x, S, Q, count, V, best, active, m, rel_mode, tol, div_factor):
    """Step k of Broyden's good method for every active sample, in the product form of its inverse
    estimate (`solvers.broyden.InverseJacobian`): f(x) = fx, the next iterates into xn. Only the steps are
    stored, and w = B_k g is one sweep over them: w = -g; w += s_j (s_{j-1}·w) / |s_{j-1}|² for j = 1..k;
    the next step follows `broyden_update`. S[b, :count[b]] holds the steps in the state's dtype (the
    caller grows S's capacity with the steps taken, up to the memory m); Q = (sn, coef): their squared norms
    and the sweep's factors coef[b, j] = 1 / sn[b, j-1]; V (B, D) is float64 scratch for w. Returns
    `track`'s (flags, trace entry, n_go).

    Mixed precision (issue 36): the stored steps and iterates are in the state's dtype; every product that
    decides the update (the norms, w, the sweep's dot products and coefficients) is formed and summed in
    float64. In float32 the chain's products otherwise carry ~1e-7 relative errors that depend on how the
    reduction is split over vector lanes (so on the CPU's vector width), and on ill-conditioned systems
    float32 Broyden then sits on the edge of stalling; so it matches the torch path on any CPU.
    """
    B, d = fx.shape
    if k == 0:  # a solve starts with no stored step
        count[:] = 0
    g2 = np.empty(B)
    f2 = np.empty(B)
    d0 = np.zeros(B)
    for b in range(B):  # one pass: w = -g, its dot with the first stored step (the sweep's start), norms
        if not active[b]:
            continue
        xb, fb, vb, row0 = x[b], fx[b], V[b], S[b, 0]
        g_sq = 0.0
        fx_sq = 0.0
        dd = 0.0
        for i in range(d):
            gi = np.float64(fb[i] - xb[i])  # the residual in the state's dtype, as the torch path forms it
            fi = np.float64(fb[i])
            vb[i] = -gi
            g_sq += gi * gi
            fx_sq += fi * fi
            dd -= np.float64(row0[i]) * gi  # row 0 may be unwritten with no stored step: dd is then not used
        g2[b], f2[b] = g_sq, fx_sq  # float64 sums of float32 or float64 squares: finite for a finite state
        if count[b] > 0:
            d0[b] = dd
    improved = np.empty(B, np.bool_)
    go = np.empty(B, np.int64)
    flags, trace, n_go = track(g2, f2, best, active, improved, go, rel_mode, tol, div_factor)
    _settle(x, xn, best_x, active, improved)
    if flags & NONFINITE:
        return flags, trace, n_go
    held = -1  # a sample whose w waits for a partner: two are swept side by side (`_sweep_pair`)
    for q in range(n_go):
        b = go[q]
        if held < 0:
            held = b
            continue
        da, db = _sweep_pair(
            S[held], Q[1, held], count[held], V[held], d0[held], S[b], Q[1, b], count[b], V[b], d0[b]
        )
        _broyden_store(held, V[held], da, x, fx, xn, S, Q, count, m)
        _broyden_store(b, V[b], db, x, fx, xn, S, Q, count, m)
        held = -1
    if held >= 0:  # an odd one out
        dL = _sweep(S[held], Q[1, held], count[held], V[held], d0[held])
        _broyden_store(held, V[held], dL, x, fx, xn, S, Q, count, m)
    return flags, trace, n_go


# ---------------------------------------------------------------------------------------------------------
# readiness: compiled (or loaded from numba's cache) before the fused path is used

_ready = threading.Event()
_started = False
_lock = threading.Lock()
_error: BaseException | None = None


def _signatures():
    """The argument types of every kernel entry the solvers call: float32 and float64 states."""
    for dt in (np.float32, np.float64):
        fx = np.zeros((2, 3), dt)
        best, act = np.full((2, 2), np.inf), np.ones(2, np.int64)
        yield anderson_step, (
            0, fx, fx.copy(), fx.copy(), fx.copy(), np.zeros((2, 2, 3), dt), np.zeros((2, 2, 3), dt),
            np.zeros((2, 2, 2)), best.copy(), act.copy(), 1e-5, 1.0, True, 1e-5, 1e6,
        )  # fmt: skip
        yield broyden_step, (
            0, fx, fx.copy(), fx.copy(), fx.copy(), np.zeros((2, 2, 3), dt), np.zeros((2, 2, 2)),
            np.zeros(2, np.int64), np.zeros((2, 3)), best.copy(), act.copy(), 2, True, 1e-5, 1e6,
        )  # fmt: skip
    g = np.ones(2)
    yield track, (g, g, np.full((2, 2), np.inf), np.ones(2, np.int64), np.zeros(2, np.bool_),
                  np.zeros(2, np.int64), True, 1e-5, 1e6)  # fmt: skip
    yield mixing_weights, (np.eye(2)[None].repeat(2, 0), np.arange(2), 2, 2, 1e-5, np.empty((2, 2)),
                           np.zeros(2, np.bool_))  # fmt: skip


def _compile() -> None:
    global _error
    try:
        for kernel, args in _signatures():
            kernel(*args)  # compiles, or loads from numba's cache
    except BaseException as e:  # pragma: no cover - a broken numba install: the torch path serves
        _error = e
        logger.warning("deqzoo: compiling the fused CPU solver kernels failed (%s); using the torch path", e)
    finally:
        _ready.set()


def _compile_elsewhere() -> None:
    """Compile in a child process that writes numba's cache, then load from it here. A compiling thread
    would hold the GIL for tens of seconds and stall every torch op of the solves meanwhile (each op waits
    for the GIL when it returns); the child runs at the lowest priority, on the cores the solves leave idle.
    If the child fails (no writable cache, for one), compile in this thread after all.

    The child (`_compile_locked`) compiles only under the cache folder's lock, so processes started together
    compile once between them; while it waits for the lock it exits as soon as this process is gone, and
    once it holds the lock it finishes the shared cache even if this process exits (the next one loads it)."""
    import subprocess
    import sys

    # this file alone, under its own name (numba's cache records it), without the package's heavy imports;
    # at the lowest priority: on a machine with few cores the child would otherwise take a core from
    # torch's thread pool, and every op of the user's first forwards waits for its slowest thread
    code = (
        "import importlib.util, os, sys; "
        "hasattr(os, 'nice') and os.nice(19); "
        f"spec = importlib.util.spec_from_file_location({__name__!r}, {__file__!r}); "
        f"mod = importlib.util.module_from_spec(spec); sys.modules[{__name__!r}] = mod; "
        f"spec.loader.exec_module(mod); sys.exit(mod._compile_locked({os.getpid()}))"
    )
    try:
        run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=1800)
        logger.info("deqzoo: kernel cache %s by a child process", run.stdout.decode().strip())
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("deqzoo: compiling the kernels in a child process failed (%s); compiling here", e)
    _compile_locked()  # loads from the cache the child wrote (milliseconds), or compiles


def _cache_dir() -> Path:
    """The folder of numba's cache for this file: ``NUMBA_CACHE_DIR`` when set, else ``__pycache__`` beside
    this file when writable, else the user's cache folder (numba's own order). The lock and the readiness
    marker live there."""
    if numba.config.CACHE_DIR:
        return Path(numba.config.CACHE_DIR)
    here = Path(__file__).parent / "__pycache__"
    if os.access(here if here.exists() else here.parent, os.W_OK):
        return here
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deqzoo"


def _marker() -> Path:
    """A file whose presence says this cache holds every kernel for this source, numba and target CPU (numba
    keys its own cache on the same three)."""
    import hashlib

    import llvmlite.binding as llvm

    cpu = numba.config.CPU_NAME or llvm.get_host_cpu_name()
    features = numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    key = hashlib.sha256(
        b"\0".join([Path(__file__).read_bytes(), numba.__version__.encode(), cpu.encode(), features.encode()])
    ).hexdigest()[:16]
    return _cache_dir() / f"deqzoo-kernels-{key}.ready"


@contextlib.contextmanager
def _cache_lock(parent: int | None = None):
    """Hold the cache folder's lock (an advisory ``flock`` on ``deqzoo-kernels.lock``). With `parent`, wait
    only while that process lives: yields False (lock not taken) once it is gone. Without ``fcntl`` (Windows)
    or a writable folder, yields True without a lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no advisory locks here: compile without one
        yield True
        return
    try:
        folder = _cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "deqzoo-kernels.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield True
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if parent is not None else 0))
                break
            except BlockingIOError:
                if os.getppid() != parent:  # the process that wanted the kernels is gone
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _compile_locked(parent: int | None = None) -> int:
    """`_compile` under the cache folder's lock; marks the cache ready when it succeeded. As the compile
    child's work (`parent` given, see `_compile_elsewhere`): wait for the lock only while `parent` lives,
    compile unless another process finished the cache meanwhile, and print which. Exit status 0 on success,
    1 if compiling failed, 3 if the parent was gone before the lock came free (nothing compiled)."""
    with _cache_lock(parent) as held:
        if not held:
            return 3
        if parent is not None and _cache_is_warm():
            print("loaded")
            return 0
        _compile()
        if _error is not None:
            return 1
        with contextlib.suppress(OSError):  # a read-only cache: the next process checks again, no harm
            _marker().touch()
        if parent is not None:
            print("compiled")
        return 0


def warm_up(block: bool = False) -> bool:
    """Compile (or load from numba's cache) the fused kernels: in the background while solves run the torch
    path, or here with ``block=True``. Returns whether they are ready. On a fresh install the compilation
    takes tens of seconds of CPU time (in a child process, see `_compile_elsewhere`); a one-line notice is
    logged once. numba caches the result next to this file (``__pycache__``), in ``NUMBA_CACHE_DIR`` when
    set, or in the user's cache folder when the package folder is read-only; one process at a time compiles
    into a cache folder (a lock there), the others wait and load.

    Example:
        >>> from deqzoo.core import _kernels
        >>> _kernels.warm_up(block=True) or not _kernels.AVAILABLE
        True
    """
    global _started
    if not AVAILABLE:
        return False
    with _lock:
        if not _started:
            _started = True
            if _cache_is_warm():
                _compile()  # loads (milliseconds); needs no lock
            elif block:
                _compile_locked()
            else:
                logger.warning(
                    "deqzoo: compiling the fused CPU solver kernels in the background (once per install; "
                    "solves use the torch path meanwhile)"
                )
                threading.Thread(target=_compile_elsewhere, name="deqzoo-kernels", daemon=True).start()
    if block:
        _ready.wait()
    return _ready.is_set() and _error is None


def _cache_is_warm() -> bool:
    """Whether a process has finished numba's cache of every kernel for this source, numba and CPU (our
    marker, written after a successful compile: numba's own cache index is not a public API). Loading them
    then costs milliseconds."""
    try:
        return _marker().exists()
    except OSError:
        return False


def host(fn):
    """`fn` (a shared kernel such as `track`) for a call from the torch path: compiled when the kernels are
    ready, else its Python function (slower, same results), so no solve waits for a compilation. Asking
    starts the compilation (or loads numba's cache), as `usable` does for CPU states: a solve on a GPU never
    calls `usable`'s `ready`, and before this asked it ran the Python functions for the whole process, a
    per-sample Python loop per step (4.5x TorchDEQ's time for an MDEQ at batch 256 on an H100). With the
    kernels disabled (``DEQZOO_KERNELS=0``) it starts nothing, but uses them once another caller has."""
    compiled = ready() if ENABLED else _ready.is_set() and _error is None
    return fn if compiled else getattr(fn, "py_func", fn)


def ready() -> bool:
    """Whether the fused kernels can be called now (compiled or loaded); starts the compilation if not."""
    if _ready.is_set():
        return _error is None
    return warm_up(block=False)


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on states like `x` now."""
    return AVAILABLE and ENABLED and x.is_cpu and x.dtype in (torch.float32, torch.float64) and ready()
