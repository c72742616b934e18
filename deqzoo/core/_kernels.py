"""Fused per-sample CPU steps for Anderson and Broyden, compiled with numba.

Why: on CPU a solver step written as torch ops pays several microseconds of dispatch per op and streams the
solver's history through memory once per op, which costs more than f itself for small f. Here one call does a
whole step for every sample: residual and norms, best-iterate bookkeeping, the history update, the small
mixing or quasi-Newton system, and the next iterate, visiting each sample's history while it is in cache.
Samples that have converged are frozen at their best iterate and skipped, so a sample's trajectory does not
depend on the rest of its batch. Norms and dot products accumulate in the state's dtype over many vector
lanes (float32: ~1e-7 relative, as a BLAS dot), in float64 when that overflows; the small systems are solved
in float64.

Iterates live in X (2, B, D): step k evaluates X[k % 2] and writes the next iterate to the other half. The
best iterate of a sample is not copied when it improves; ``loc[b]`` records which half holds it (-1:
``best_x``), and it is copied to ``best_x`` only when that half is about to be overwritten, on freezing, or by
`gather_best`.

A step also does the solve's bookkeeping (the per-step trace entry and the stop test) and returns one integer
of status flags, so between two calls of f the host runs only the call itself: on CPU, f evicts the
caches, and there every Python-level operation costs several times its warm price. For the same reason the
solvers call a step through its entry (`broyden_entry`, `anderson_entry`) on plain numbers: the address of
f's output and of a run header holding the buffers' shapes and addresses (`header`), with the compiled
entry itself (`entry_point`), not numba's dispatcher. With cold caches, the dispatcher's type resolution
and the unboxing of a dozen arrays cost ~10 us per call, as much as 20% of a small step.

The solvers use these kernels for CPU float32/float64 states when numba imports and ``DEQZOO_KERNELS`` is not
``0``; otherwise they run their torch path (same method; the tests check the two agree).
"""

from __future__ import annotations

import os

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
    "AVAILABLE", "CONVERGED", "DIVERGED", "ENABLED", "H_BEST_X", "NONFINITE", "address",
    "anderson_entry", "anderson_step", "as_array", "broyden_entry", "broyden_step", "entry_point",
    "gather_best", "header", "outcome", "start", "usable",
]  # fmt: skip


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on states like `x`. (`is_cpu`, not `device.type`: right after f, with
    cold caches, building the device object costs ~25 us.)"""
    return AVAILABLE and ENABLED and x.is_cpu and x.dtype in (torch.float32, torch.float64)


def as_array(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor (contiguous first, if it is not)."""
    return t.detach().contiguous().numpy()


# reassociation and contraction let LLVM vectorise the reductions; no "nnan"/"ninf": NaN detection must work
_FLAGS = {"reassoc", "contract", "nsz"}


def _jit(fn=None, inline="never"):
    """numba.njit with the module's settings; ``inline="always"`` inlines at numba's IR level."""
    if fn is None:
        return lambda f: _jit(f, inline)
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, fastmath=_FLAGS, nogil=True, inline=inline)(fn)


if numba is not None:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic

    _BITS = {_types.float32: _types.uint32, _types.float64: _types.uint64}
    _FLOATS = {v: k for k, v in _BITS.items()}

    @_intrinsic
    def _abs_bits(typingctx, x):
        """The bit pattern of |x| (sign bit cleared) as an unsigned integer of x's width: a register
        operation, no memory. These patterns order like the values, NaN above inf, so a max over them is a
        NaN-propagating |x| max that vectorises (numba's NaN-aware float max does not)."""
        if x not in _BITS:
            return None

        def codegen(context, builder, sig, args):
            ity = _ir.IntType(x.bitwidth)
            return builder.and_(builder.bitcast(args[0], ity), ity((1 << (x.bitwidth - 1)) - 1))

        return _BITS[x](x), codegen

    @_intrinsic
    def _from_bits(typingctx, u):
        """The float whose bit pattern is the unsigned integer u."""
        if u not in _FLOATS:
            return None
        to = _FLOATS[u]
        return to(u), lambda context, builder, sig, args: builder.bitcast(args[0], context.get_value_type(to))

    @_intrinsic
    def _pointer(typingctx, addr, like):
        """The integer address `addr` as a pointer to elements of the type of the scalar `like`."""
        if not isinstance(addr, _types.Integer) or not isinstance(like, (_types.Number, _types.Boolean)):
            return None
        ptr = _types.CPointer(like)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(addr, like), codegen


@_jit
def _copy(dst, src):
    """dst[:] = src for 1-D views (an explicit loop vectorises; numba's slice assignment does not)."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@_jit
def _dot(u, v):
    """u·v (u may be an integer row) summed in v's dtype, returned as float64. With reassociation allowed
    the loop becomes several vector accumulators and one horizontal sum (float32 sums of 512 products err by
    ~1e-7 relative, as a BLAS dot would; blocked float64 partial sums cost 1.7x as much)."""
    s = v.dtype.type(0.0)
    for i in range(u.shape[0]):
        s += v.dtype.type(u[i]) * v[i]
    return np.float64(s)


@_jit
def _release(b, X, half, best_x, loc):
    """Sample b's row of X[half] is about to be overwritten: save it first if it is the best iterate."""
    if loc[b] == half:
        _copy(best_x[b], X[half, b])
        loc[b] = -1


@_jit
def _begin(active, best, rel_mode):
    """Per-step residual record (stop mode, absolute), pre-filled for frozen samples with their best."""
    B = active.shape[0]
    step_r = np.empty(B)
    step_abs = np.zeros(B)
    for b in range(B):
        if not active[b]:
            step_r[b] = best[1, b] if rel_mode else best[0, b]
    return step_r, step_abs


@_jit
def _accept(b, X, cur, best_x, loc, best, rel_mode, tol, active, g_sq, fx_sq, step_r, step_abs):
    """Record sample b's residual at X[cur, b] in step_r/step_abs and its best iterate (best[0] holds the
    absolute residuals, best[1] the relative ones). Returns True when the sample takes a step; False when
    its residual is not finite or it has converged (then it is frozen at its best iterate in both halves)."""
    a = np.sqrt(g_sq)
    rel = a / (np.sqrt(fx_sq) + 1e-12)
    r = rel if rel_mode else a
    step_r[b] = r
    if not np.isfinite(r):
        return False
    step_abs[b] = a
    if r < (best[1, b] if rel_mode else best[0, b]):
        best[0, b] = a
        best[1, b] = rel
        loc[b] = cur
    if (best[1, b] if rel_mode else best[0, b]) < tol:
        _release(b, X, cur, best_x, loc)
        _release(b, X, 1 - cur, best_x, loc)
        _copy(X[cur, b], best_x[b])
        _copy(X[1 - cur, b], best_x[b])
        active[b] = False
        return False
    _release(b, X, 1 - cur, best_x, loc)  # the next iterate goes there
    return True


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


CONVERGED, NONFINITE, DIVERGED = 1, 2, 4  # the kernels' status flags (0: keep going)


@_jit
def _finish(step_r, step_abs, best, rel_mode, tol, div_factor, trace, k):
    """End of step k: its max residual (NaN if any is not finite) goes to trace[k]; returns the status flags:
    CONVERGED when every sample's best residual is below tol, NONFINITE when a residual is not finite,
    DIVERGED when the largest absolute residual exceeds div_factor times the largest best one."""
    r_max = 0.0
    n_bad = 0
    best_max = 0.0
    best_abs_max = 0.0
    for b in range(step_r.shape[0]):
        if np.isfinite(step_r[b]):
            r_max = max(r_max, step_r[b])
        else:
            n_bad += 1
        best_max = max(best_max, best[1, b] if rel_mode else best[0, b])
        best_abs_max = max(best_abs_max, best[0, b])
    trace[k] = r_max if n_bad == 0 else np.nan
    flags = CONVERGED if best_max < tol else 0
    if n_bad > 0:
        flags |= NONFINITE
    elif step_abs.max() > div_factor * max(best_abs_max, 1e-30):
        flags |= DIVERGED
    return flags


@_jit
def start(X, x0, best_x, loc, active, best):
    """Per-solve reset of pooled state: X[0] = best_x = x0, no best iterate in X, every sample active, no
    residual seen."""
    for b in range(x0.shape[0]):
        _copy(X[0, b], x0[b])
        _copy(best_x[b], x0[b])
        loc[b] = -1
        active[b] = True
        best[0, b] = np.inf
        best[1, b] = np.inf


@_jit
def gather_best(X, loc, best_x):
    """Copy into best_x the best iterates that still live in X (loc is left as is)."""
    for b in range(best_x.shape[0]):
        if loc[b] >= 0:
            _copy(best_x[b], X[loc[b], b])


@_jit
def outcome(X, loc, best_x, best, trace, nfe, rel_mode, tol):
    """End of a solve, in one call: the best iterates still in X copied to best_x, and fresh arrays of the
    per-sample residuals (absolute, relative; in best_x's dtype), the converged flags and the trace."""
    gather_best(X, loc, best_x)
    B = best_x.shape[0]
    res = np.empty((2, B), best_x.dtype)
    conv = np.empty(B, np.bool_)
    for b in range(B):
        res[0, b] = best[0, b]
        res[1, b] = best[1, b]
        conv[b] = (best[1, b] if rel_mode else best[0, b]) < tol
    return res, conv, trace[:nfe].copy()


@_jit
def anderson_step(k, fx, X, G, Y, H, lam, tau, active, best_x, loc, best, trace, rel_mode, tol, div_factor):
    """Step k of Anderson for every active sample, from X[k % 2] to the other half.

    G[b, j] holds residuals g_j = f(x_j) - x_j, Y[b, j] the damped images f(x_j) - (1 - tau) g_j, H[b] their
    Gram matrix (float64), m = G.shape[1] slots used in turn. The mixing weights solve
    (H + reg I) a = 1, alpha = a / sum(a) with reg = lam * max_j H_jj (Cholesky, `_mixing_weights`); a
    non-positive pivot or a non-finite value falls back to a plain damped step. fx is shaped like X[0] (the
    entries build it so; the solvers check f's output). Returns `_finish`'s flags.
    """
    B, d = fx.shape
    m = G.shape[1]
    slot, n = k % m, min(k + 1, m)
    cur = k & 1
    nxt = 1 - cur
    step_r, step_abs = _begin(active, best, rel_mode)
    keep = fx.dtype.type(1.0 - tau)
    # 1. residuals and the Gram row, per sample; the samples that take a step
    go = np.empty(B, np.int64)
    n_go = 0
    for b in range(B):
        if not active[b]:
            continue
        # one pass: the residual and the damped image go straight into their history slots
        gs, ys, xb, fb = G[b, slot], Y[b, slot], X[cur, b], fx[b]
        g_sq = fx.dtype.type(0.0)
        fx_sq = fx.dtype.type(0.0)
        for i in range(d):
            gi = fb[i] - xb[i]
            gs[i] = gi
            ys[i] = fb[i] - keep * gi
            g_sq += gi * gi
            fx_sq += fb[i] * fb[i]
        g2, f2 = _sq_norms(g_sq, fx_sq, fb, xb)
        if not _accept(b, X, cur, best_x, loc, best, rel_mode, tol, active, g2, f2, step_r, step_abs):
            continue
        go[n_go] = b
        n_go += 1
        H[b, slot, slot] = g2
        for j in range(n):
            if j != slot:
                s = _dot(G[b, j], gs)
                H[b, slot, j] = s
                H[b, j, slot] = s
    # 2. the mixing weights of all stepping samples at once
    W = np.empty((n, n_go))
    ok = np.zeros(n_go, np.bool_)
    if n > 1:
        _mixing_weights(H, go, n_go, n, lam, W, ok)
    # 3. the next iterates
    acc = np.empty(d, fx.dtype)
    for q in range(n_go):
        b = go[q]
        ob = X[nxt, b]
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
    return _finish(step_r, step_abs, best, rel_mode, tol, div_factor, trace, k)


@_jit
def _mixing_weights(H, go, n_go, n, lam, W, ok):
    """alpha = a / sum(a) with (H[b] + reg I) a = 1, reg = lam * max_j H[b]_jj, for the samples b = go[k],
    into W[:, k]; ok[k] is False where a Cholesky pivot is not positive or alpha is not finite.

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
def _sweep(Sb, cb, L, v, d):
    """v <- P_{L-1} ... P_1 v with P_j = I + s_j s_{j-1}ᵀ / |s_{j-1}|² for one sample (L >= 1), where row
    Sb[j] is s_j / scale_j, cb[j] = scale_{j-1} scale_j / |s_{j-1}|² and d = Sb[0]·v on entry. Returns
    Sb[L-1]·v (the step's denominator needs it).

    A chain: each coefficient needs the previous update. Each row is read and converted once: the pass that
    adds row j to v also takes row j's dot product with the updated v, which gives the next coefficient.
    The coefficient chain stays in v's dtype (no float64 round trip on the critical path). Blocking rows
    with the Gram band to break the chain measured no faster: it converts the look-ahead rows again, and
    the conversions compete with the two FMAs per element; two samples side by side (`_sweep_pair`) do
    hide part of the chain's wait."""
    T = v.dtype.type
    e = T(d)
    for j in range(1, L):
        c = e * T(cb[j])
        row = Sb[j]
        s = T(0.0)
        for i in range(v.shape[0]):
            r = T(row[i])  # once: without alias information the store to v would force a reload
            t = v[i] + c * r
            v[i] = t
            s += r * t
        e = s
    return np.float64(e)


@_jit
def _sweep_pair(Sa, ca, La, va, da, Sb, cb, Lb, vb, db):
    """`_sweep` for two samples a and b at once: their common rows in one loop, then the rest of the longer
    one alone. Each chain waits on its own dot product at every row; side by side, one chain's arithmetic
    fills the other's wait (measured in place: the sweep ~5% faster). Returns (da, db) as `_sweep` does."""
    T = va.dtype.type
    ea = T(da)
    eb = T(db)
    for j in range(1, min(La, Lb)):
        xa = ea * T(ca[j])
        xb = eb * T(cb[j])
        ra = Sa[j]
        rb = Sb[j]
        sa = T(0.0)
        sb = T(0.0)
        for i in range(va.shape[0]):
            r = T(ra[i])
            t = va[i] + xa * r
            va[i] = t
            sa += r * t
            q = T(rb[i])
            u = vb[i] + xb * q
            vb[i] = u
            sb += q * u
        ea = sa
        eb = sb
    da = np.float64(ea)
    db = np.float64(eb)
    n = max(min(La, Lb), 1)
    if La > n:
        da = _sweep(Sa[n - 1 :], ca[n - 1 :], La - n + 1, va, da)
    if Lb > n:
        db = _sweep(Sb[n - 1 :], cb[n - 1 :], Lb - n + 1, vb, db)
    return da, db


@_jit(inline="always")
def _broyden_store(b, v, dL, k, fx, X, S, qmax, Q, count):
    """Sample b's step k from its swept w in v (dL: its last stored step dotted with w): the next iterate
    into X[1 - k % 2, b], and the step, rounded with its scale, stored as S[b, count[b]]."""
    scale, sn, coef = Q[0], Q[1], Q[2]
    T = fx.dtype.type
    d, m, L = v.shape[0], S.shape[1], count[b]
    xb, fb, ob = X[k & 1, b], fx[b], X[1 - (k & 1), b]
    # new step = factor * w; with no stored step w = -g and the step is g (a fixed-point step)
    factor = -1.0
    if L > 0:
        den = dL * scale[b, L - 1] + sn[b, L - 1]
        if np.isfinite(den) and abs(den) > 1e-12 * sn[b, L - 1]:
            factor = -sn[b, L - 1] / den
        else:  # degenerate secant equation: restart from B_0 = -I
            L = 0
            for i in range(d):
                v[i] = xb[i] - fb[i]
    if L == m:  # memory full: restart, keeping this step as the first of the new cycle
        L = 0
    f = T(factor)
    top = _abs_bits(T(0.0))
    for i in range(d):  # largest |w_i|: the step's is |factor| times it (rounding is monotone)
        top = max(top, _abs_bits(v[i]))
    sl = S[b, L]
    q_sq = 0.0
    if qmax > 0.0:
        sc = np.float64(abs(f) * _from_bits(top)) / qmax
        inv = T(1.0 / sc) if sc > 0.0 else T(0.0)
        for i in range(d):  # the step, the next iterate and the stored step in one pass
            si = f * v[i]
            ob[i] = xb[i] + si
            qi = np.rint(si * inv)  # |qi| <= qmax by the choice of sc
            sl[i] = S.dtype.type(qi)
            q_sq += np.float64(qi) * np.float64(qi)
    else:  # stored as is
        sc = 1.0
        for i in range(d):
            si = f * v[i]
            ob[i] = xb[i] + si
            sl[i] = si
            q_sq += np.float64(si) * np.float64(si)
    scale[b, L] = sc
    sn[b, L] = np.float64(q_sq) * sc * sc
    coef[b, L] = scale[b, L - 1] * sc / sn[b, L - 1] if L > 0 else 0.0
    count[b] = L + 1


@_jit
def broyden_step(k, fx, X, S, qmax, Q, count, active, best_x, loc, best, trace, rel_mode, tol, div_factor):
    """Step k of Broyden's good method for every active sample, from X[k % 2] to the other half, in the
    product form of its inverse estimate.

    With unit steps and B_0 = -I the inverse estimate after steps s_0..s_k is
    B_k = (I + s_k s_{k-1}ᵀ / |s_{k-1}|²) ... (I + s_1 s_0ᵀ / |s_0|²) B_0 (Deuflhard's recursion), so only
    the steps are stored, one vector per iteration, and w = B_k g is one sweep over them:
    w = -g; w += s_j (s_{j-1}·w) / |s_{j-1}|² for j = 1..k. The next step is
    s_{k+1} = -w |s_k|² / (s_k·w + |s_k|²).

    The sweep reads every stored step once per step (two samples side by side, `_sweep_pair`); the steps are
    stored as integers (int16 for float32 states, int32 for float64) with one scale per step,
    s_j ≈ scale[b, j] · S[b, j], half the bytes of the state's dtype, to 2^-15 (2^-31) of the step's largest
    entry. Only the stored copy is rounded: every iterate takes its step in full precision and every residual
    is exact, so the rounding perturbs the inverse-Jacobian estimate slightly and never limits the accuracy
    reached. ``qmax = 0`` stores float steps as they are.
    S[b, :count[b]] holds the steps; Q = (scale, sn, coef) their scales, squared norms (of the stored values)
    and the sweep's constant factors coef[b, j] = scale[b, j-1] scale[b, j] / sn[b, j-1], all set when step j
    is stored. A full memory (count = S.shape[1]) or a degenerate denominator restarts from B_0 = -I,
    keeping the new step. fx is shaped like X[0], as in `anderson_step`. Returns `_finish`'s flags.
    """
    B, d = fx.shape
    coef = Q[2]
    if k == 0:  # a solve starts with no stored step
        count[:] = 0
    cur = k & 1
    step_r, step_abs = _begin(active, best, rel_mode)
    T = fx.dtype.type
    V = np.empty((2, d), fx.dtype)  # w of two samples: they are swept side by side (`_sweep_pair`)
    held, held_d = -1, 0.0  # a sample whose w waits in V[0] for a partner, and its first dot product
    for b in range(B):
        if not active[b]:
            continue
        v = V[0] if held < 0 else V[1]
        xb, fb, row0 = X[cur, b], fx[b], S[b, 0]
        # w = -g, its dot with the first stored step (the sweep's start) and the squared norms, in one pass;
        # the sums in the state's dtype (vector accumulators), in float64 if that overflowed
        g_sq, fx_sq, d0 = T(0.0), T(0.0), T(0.0)
        for i in range(d):
            gi = fb[i] - xb[i]
            v[i] = -gi
            g_sq += gi * gi
            fx_sq += fb[i] * fb[i]
            d0 -= T(row0[i]) * gi  # row 0 is garbage (unused) with no stored step, but finite: ints or floats
        g2, f2 = _sq_norms(g_sq, fx_sq, fb, xb)
        if not _accept(b, X, cur, best_x, loc, best, rel_mode, tol, active, g2, f2, step_r, step_abs):
            continue
        if held < 0:
            held, held_d = b, np.float64(d0)
            continue
        da, db = _sweep_pair(
            S[held], coef[held], count[held], V[0], held_d, S[b], coef[b], count[b], V[1], np.float64(d0)
        )
        _broyden_store(held, V[0], da, k, fx, X, S, qmax, Q, count)
        _broyden_store(b, V[1], db, k, fx, X, S, qmax, Q, count)
        held = -1
    if held >= 0:  # an odd one out
        dL = _sweep(S[held], coef[held], count[held], V[0], held_d)
        _broyden_store(held, V[0], dL, k, fx, X, S, qmax, Q, count)
    return _finish(step_r, step_abs, best, rel_mode, tol, div_factor, trace, k)


# A run's header: the shapes and buffer addresses a step reads (an int64 array built by `header`; see the
# module docstring for why steps take addresses).
H_B, H_D, H_T, H_M = 0, 1, 2, 3  # batch, state size, trace length, history length (axis 1 of the first array)
H_X, H_BEST_X, H_LOC, H_ACTIVE, H_BEST, H_TRACE = 4, 5, 6, 7, 8, 9
H_ARRAYS = 10  # the solver's own arrays from here (Broyden S, Q, count; Anderson G, Y, H)
HEADER = 13


def address(a: np.ndarray) -> int:
    """The address of a numpy array's first element."""
    return a.__array_interface__["data"][0]


def header(X: np.ndarray, loc, active, best, trace, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    """The header of a run whose buffers are these arrays (C-contiguous, owned by the caller for as long as
    the header is used). The result's address (H_BEST_X) is set per solve."""
    h = np.zeros(HEADER, np.int64)
    h[[H_B, H_D, H_T, H_M]] = X.shape[1], X.shape[2], trace.shape[0], arrays[0].shape[1]
    slots = (H_X, H_LOC, H_ACTIVE, H_BEST, H_TRACE, *range(H_ARRAYS, H_ARRAYS + len(arrays)))
    for slot, a in zip(slots, (X, loc, active, best, trace, *arrays)):
        if not a.flags.c_contiguous:  # a step reads every buffer as contiguous
            raise ValueError(f"run buffer at header slot {slot} is not C-contiguous (strides {a.strides})")
        h[slot] = address(a)
    return h


@_jit
def _run_views(header_addr, x_like):
    """The header and the buffers every step uses, as arrays over the addresses the header holds."""
    h = numba.carray(_pointer(header_addr, np.int64(0)), HEADER)
    B, d = h[H_B], h[H_D]
    X = numba.carray(_pointer(h[H_X], x_like), (2, B, d))
    best_x = numba.carray(_pointer(h[H_BEST_X], x_like), (B, d))
    loc = numba.carray(_pointer(h[H_LOC], np.int64(0)), B)
    active = numba.carray(_pointer(h[H_ACTIVE], False), B)
    best = numba.carray(_pointer(h[H_BEST], 0.0), (2, B))
    trace = numba.carray(_pointer(h[H_TRACE], 0.0), h[H_T])
    return h, X, best_x, loc, active, best, trace


@_jit
def broyden_entry(k, fx_addr, header_addr, x_like, s_like, qmax, rel_mode, tol, div_factor):
    """`broyden_step` on the run described by the header at `header_addr`, with f's output at `fx_addr` (a
    C-contiguous (B, D) block of x_like's type); s_like has the stored steps' type."""
    h, X, best_x, loc, active, best, trace = _run_views(header_addr, x_like)
    B, d, m = h[H_B], h[H_D], h[H_M]
    fx = numba.carray(_pointer(fx_addr, x_like), (B, d))
    S = numba.carray(_pointer(h[H_ARRAYS], s_like), (B, m, d))
    Q = numba.carray(_pointer(h[H_ARRAYS + 1], 0.0), (3, B, m))
    count = numba.carray(_pointer(h[H_ARRAYS + 2], np.int64(0)), B)
    return broyden_step(
        k, fx, X, S, qmax, Q, count, active, best_x, loc, best, trace, rel_mode, tol, div_factor
    )


@_jit
def anderson_entry(k, fx_addr, header_addr, x_like, lam, tau, rel_mode, tol, div_factor):
    """`anderson_step` on the run described by the header at `header_addr` (see `broyden_entry`)."""
    h, X, best_x, loc, active, best, trace = _run_views(header_addr, x_like)
    B, d, m = h[H_B], h[H_D], h[H_M]
    fx = numba.carray(_pointer(fx_addr, x_like), (B, d))
    G = numba.carray(_pointer(h[H_ARRAYS], x_like), (B, m, d))
    Y = numba.carray(_pointer(h[H_ARRAYS + 1], x_like), (B, m, d))
    H = numba.carray(_pointer(h[H_ARRAYS + 2], 0.0), (B, m, m))
    return anderson_step(
        k, fx, X, G, Y, H, lam, tau, active, best_x, loc, best, trace, rel_mode, tol, div_factor
    )


_ENTRIES: dict = {}


def entry_point(kernel, args: tuple):
    """`kernel` compiled for the types of `args`, as its bare compiled entry: a call skips the dispatcher's
    type resolution, so every later call must pass arguments of the same types (numbers, not arrays)."""
    key = (kernel, tuple(type(a) for a in args))
    ep = _ENTRIES.get(key)
    if ep is None:
        ep = kernel.compile(tuple(numba.typeof(a) for a in args))
        _ENTRIES[key] = ep if callable(ep) else kernel  # the dispatcher itself is always a correct fallback
    return ep
