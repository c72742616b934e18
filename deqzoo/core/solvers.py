"""Fixed-point solvers for z = f(z), registered by name. They work on flat (B, D) states.

A solver is ``fn(g, x0, *, max_iter, tol, stop_mode, **kwargs) -> (x, SolverStats)`` where ``g`` maps
(B, D) to (B, D) and runs without autograd. Every built-in solver keeps per-sample statistics and returns,
per sample, the iterate with the lowest residual seen. Hot loops preallocate their buffers, update them in
place, and cross to the host once per step (one small transfer carrying the per-sample norms the stopping
check needs; Anderson's small mixing system rides along). Built-ins also accept ``keep_steps`` (iterations
at which to keep a copy of the best iterate so far, for fixed-point correction) and ``div_factor`` (stop
when the largest absolute residual exceeds ``div_factor`` times the largest best one: divergence).

Registered: ``fixed_point`` (damped), ``anderson`` (incremental Gram matrix), ``broyden`` (good Broyden on
the inverse Jacobian, full or limited memory; exposes its inverse estimate for SHINE), ``gmres`` (Krylov, for
affine maps such as the adjoint system of implicit differentiation).

On CPU float32/float64 states, ``anderson`` and ``broyden`` run each step as one fused numba kernel
(`deqzoo.core._kernels`), with their buffers from a per-thread pool (`deqzoo.core.workspace`); elsewhere, or
with ``DEQZOO_KERNELS=0``, they run the torch path below, which implements the same method (the tests run both
and compare them). The fused path also freezes each sample at its own convergence, so a sample's result does
not depend on the rest of its batch.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from . import _kernels, workspace
from .state import State, StatePacker
from .stats import SolverStats

SOLVERS: dict[str, Callable] = {}

__all__ = [
    "SOLVERS",
    "InverseJacobian",
    "LowRankInverse",
    "StepProductInverse",
    "anderson",
    "broyden",
    "fixed_point",
    "get_solver",
    "gmres",
    "register_solver",
    "solve",
    "solver_kwarg_names",
]


def register_solver(name: str):
    """Register a solver under `name` (decorator). User solvers plug in the same way.

    Example:
        >>> import torch
        >>> from deqzoo.core import register_solver, solve
        >>> @register_solver("halfway")
        ... def halfway(g, x0, *, max_iter, tol, stop_mode="rel", **kw):
        ...     return fixed_point(g, x0, max_iter=max_iter, tol=tol, stop_mode=stop_mode, tau=0.5, **kw)
        >>> f = lambda z: 0.5 * z + 1
        >>> z, stats = solve(f, torch.zeros(1, 2), solver="halfway", max_iter=200, tol=1e-6)
        >>> stats.solver, round(float(z[0, 0]), 4)
        ('fixed_point', 2.0)
    """

    def deco(fn):
        SOLVERS[name] = fn
        return fn

    return deco


def get_solver(name: str) -> Callable:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; registered solvers: {sorted(SOLVERS)}")
    return SOLVERS[name]


def solver_kwarg_names(name: str) -> set[str] | None:
    """Keyword options a registered solver accepts (None when it takes **kwargs, i.e. anything)."""
    params = inspect.signature(get_solver(name)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY} - {"max_iter", "tol", "stop_mode"}


def _to_host(t: torch.Tensor) -> np.ndarray:
    """The one device-to-host transfer of a step (zero-copy on CPU), as float64."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy().astype(np.float64, copy=False)


def _check_solve_args(max_iter: int, tol: float, stop_mode: str) -> None:
    if stop_mode not in ("abs", "rel"):
        raise ValueError(f"stop_mode must be 'abs' or 'rel', got {stop_mode!r}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")


def _kept_extra(keep_steps: list[int], kept: dict, best_x: torch.Tensor, extra: dict) -> dict:
    """stats.extra: the copies kept for fixed-point correction (steps after the solve ended keep the final
    best iterate) and the solver's own entries."""
    if not keep_steps:
        return extra
    return {"kept": {k: kept.get(k, best_x) for k in keep_steps}, **extra}


class _Tracker:
    """Per-sample best iterate, residuals, trace and stopping.

    A step hands over per-sample ||f(x) - x|| and ||f(x)|| (device tensors; solvers may append their own
    small per-sample data, such as Anderson's Gram row, to the same transfer); they cross to the host in one
    transfer, the only synchronisation of the step, and the bookkeeping runs there in numpy on (B,) arrays,
    which costs far less than a dozen tiny device kernels. Only the masked copy of the best iterate runs on
    the device.
    """

    def __init__(
        self,
        x0: torch.Tensor,
        max_iter: int,
        tol: float,
        stop_mode: str,
        name: str,
        keep_steps: Iterable[int] = (),
        div_factor: float = 1e6,
    ):
        _check_solve_args(max_iter, tol, stop_mode)
        b = x0.shape[0]
        self.x0 = x0
        # iterates handed to `update` are never modified in place afterwards by the solvers, so the best one
        # is kept by reference (no copy per step); `result` clones only if that is still the caller's x0
        self.best_x = x0
        self.best_abs = np.full(b, np.inf)
        self.best_rel = np.full(b, np.inf)
        self.trace: list[float] = []
        self.tol, self.stop_mode, self.name, self.steps = tol, stop_mode, name, 0
        self.keep_steps = sorted({int(k) for k in keep_steps})
        self.kept: dict[int, torch.Tensor] = {}
        self.div_factor = div_factor
        self.nonfinite = self.diverged = False

    def update(
        self,
        x: torch.Tensor,
        fx: torch.Tensor | None,
        abs_r: torch.Tensor | None = None,
        fx_norm: torch.Tensor | None = None,
    ) -> bool:
        """Record iterate x with f(x) = fx; abs_r = ||fx - x|| and fx_norm = ||fx|| may be given instead of
        being computed. Returns True when the solve should stop (converged, non-finite or diverged)."""
        if abs_r is None:
            abs_r = torch.linalg.vector_norm(fx - x, dim=1)
        if fx_norm is None:
            fx_norm = torch.linalg.vector_norm(fx, dim=1)
        host = _to_host(torch.stack((abs_r, fx_norm)))
        return self.update_host(x, host[0], host[1])

    def update_host(self, x: torch.Tensor, abs_r: np.ndarray, fx_norm: np.ndarray) -> bool:
        """As `update`, with the per-sample norms already on the host."""
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            rel_r = abs_r / (fx_norm + 1e-12)
            r, best = (rel_r, self.best_rel) if self.stop_mode == "rel" else (abs_r, self.best_abs)
            better = r < best  # False for NaN: a non-finite iterate never becomes the best
            self.best_abs[better] = abs_r[better]
            self.best_rel[better] = rel_r[better]
            finite = bool(np.isfinite(abs_r).all())
            self.trace.append(float(r.max()))
            if better.all():
                self.best_x = x
            elif better.any():
                mask = torch.from_numpy(better).to(x.device, non_blocking=True)[:, None]
                if finite:  # lerp with a 0/1 weight is an exact masked copy, and cheaper than where
                    self.best_x = torch.lerp(self.best_x, x, mask.to(x.dtype))
                else:
                    self.best_x = torch.where(mask, x, self.best_x)
            self.steps += 1
            if self.keep_steps and self.steps in self.keep_steps:
                self.kept[self.steps] = self.best_x
            self.nonfinite = not finite
            if finite and abs_r.max() > self.div_factor * max(self.best_abs.max(), 1e-30):
                self.diverged = True
            return bool(best.max() < self.tol) or self.nonfinite or self.diverged

    def result(self) -> torch.Tensor:
        """The best iterate (a fresh tensor, never the caller's x0 itself)."""
        if self.best_x.data_ptr() == self.x0.data_ptr():
            return self.best_x.clone()
        return self.best_x

    def stats(self, nfe: int, **extra) -> SolverStats:
        # converted on the numpy side: torch.tensor(list) and .to(dtype) cost microseconds each
        np_dtype = _NUMPY_DTYPES.get(self.x0.dtype)

        def as_t(a: np.ndarray) -> torch.Tensor:
            if np_dtype is None:
                return torch.from_numpy(a).to(self.x0.device, self.x0.dtype)
            return torch.from_numpy(a.astype(np_dtype)).to(self.x0.device)

        r = self.best_rel if self.stop_mode == "rel" else self.best_abs
        return SolverStats(
            nfe=nfe,
            abs_residual=as_t(self.best_abs),
            rel_residual=as_t(self.best_rel),
            trace=torch.from_numpy(np.array(self.trace, dtype=np.float64)),
            converged=torch.from_numpy(r < self.tol),
            solver=self.name,
            stop_mode=self.stop_mode,
            tol=self.tol,
            nonfinite=self.nonfinite,
            diverged=self.diverged,
            extra=_kept_extra(self.keep_steps, self.kept, self.best_x, extra),
        )


def _check_tau(tau: float) -> None:
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"damping tau must be in (0, 1], got {tau}")


_BROYDEN_STORAGE: dict = {}  # steps stored in the state's dtype (integer storage cost convergence)
_QMAX = {torch.int16: float(torch.iinfo(torch.int16).max), torch.int32: float(torch.iinfo(torch.int32).max)}
_NUMPY_DTYPES = {
    torch.float32: np.float32, torch.float64: np.float64, torch.int16: np.int16, torch.int32: np.int32,
}  # fmt: skip
_SCALAR = {t: np_t(0) for t, np_t in _NUMPY_DTYPES.items()}  # the kernel entries' element-type tokens


class _FusedRun:
    """The buffers and per-sample state of solves driven by a fused CPU kernel (see `_kernels`), made once per
    thread and shape and then lent from the workspace pool (`take`/`give`), numpy views included.

    X (2, B, D) holds the iterates (step k evaluates f at X[k % 2]), `best` (2, B) each sample's best absolute
    and relative residual, `trace` the per-step max residual, `arrays` the solver's own history.
    """

    def __init__(self, x0: torch.Tensor, max_iter: int, arrays: dict[str, tuple[tuple[int, ...], type]]):
        b, d = x0.shape
        self.X = x0.new_empty(2, b, d)
        self.halves, self.Xn = (self.X[0], self.X[1]), self.X.numpy()
        self.loc, self.active = np.empty(b, np.int64), np.empty(b, np.bool_)
        self.best, self.trace = np.empty((2, b)), np.empty(max_iter)
        self.arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in arrays.items()}
        parts = (self.Xn, self.loc, self.active, self.best, self.trace, *self.arrays.values())
        self.nbytes = sum(a.nbytes for a in parts)
        # the kernels' entries read the buffers through this header; it lives (and dies) with them
        self.header = _kernels.header(
            self.Xn, self.loc, self.active, self.best, self.trace, tuple(self.arrays.values())
        )
        self.header_addr = _kernels.address(self.header)

    @classmethod
    def take(cls, key: tuple, x0: torch.Tensor, max_iter: int, arrays: dict) -> _FusedRun:
        run = workspace.take(key)
        return run if run is not None else cls(x0, max_iter, arrays)

    def solve(self, g, x0: torch.Tensor, entry, consts: tuple, *, name: str, max_iter: int, tol: float,
              stop_mode: str, keep_steps: Iterable[int], div_factor: float,
              **extra) -> tuple[torch.Tensor, SolverStats]:  # fmt: skip
        """Run ``entry(k, address of f(X[k % 2]), header address, *consts, rel, tol, div_factor)`` (a
        `_kernels` entry: numbers in, status flags out) from x0 until its flags say stop."""
        # the result: fresh, and it starts as x0 (`new_empty` costs twice as much with cold caches)
        best_x = torch.empty_like(x0, memory_format=torch.contiguous_format)
        best_np, rel = best_x.numpy(), stop_mode == "rel"
        _kernels.start(self.Xn, _kernels.as_array(x0), best_np, self.loc, self.active, self.best)
        self.header[_kernels.H_BEST_X] = best_x.data_ptr()
        args = (*consts, rel, float(tol), float(div_factor))
        step, head = _kernels.entry_point(entry, (0, 0, 0, *args)), self.header_addr
        halves, shape, dtype = self.halves, x0.shape, x0.dtype
        keep = sorted({int(k) for k in keep_steps})
        kept: dict[int, torch.Tensor] = {}
        # between two calls of f as little as possible runs here: f evicts the caches, and then every
        # Python-level operation costs several times its warm price (a few attribute reads and one call of
        # the compiled step on plain integers; `Tensor.numpy` alone would cost ~9 us)
        for k in range(max_iter):
            fx = g(halves[k & 1])
            try:  # the common case: f's output can be read in place
                plain = fx.shape == shape and fx.dtype is dtype and fx.is_contiguous()
                plain = plain and fx.is_cpu and not fx.is_neg()
            except AttributeError:
                plain = False
            if not plain:
                fx = _conform(fx, shape, dtype)
            # fx stays referenced until the step returns, so the address stays valid
            flags = step(k, fx.data_ptr(), head, *args)
            if flags:
                break  # steps in `keep` from here on keep the final best iterate
            if keep and k + 1 in keep:
                _kernels.gather_best(self.Xn, self.loc, best_np)
                kept[k + 1] = best_x.clone()
        nfe = k + 1
        res, conv, trace = _kernels.outcome(self.Xn, self.loc, best_np, self.best, self.trace, nfe, rel, tol)
        # numpy slices, not Tensor.unbind: a torch op here is a cold dispatch (~50 us after f)
        abs_residual, rel_residual = torch.from_numpy(res[0]), torch.from_numpy(res[1])
        return best_x, SolverStats(
            nfe=nfe,
            abs_residual=abs_residual,
            rel_residual=rel_residual,
            trace=torch.from_numpy(trace),
            converged=torch.from_numpy(conv),
            solver=name,
            stop_mode=stop_mode,
            tol=tol,
            nonfinite=bool(flags & _kernels.NONFINITE),
            diverged=bool(flags & _kernels.DIVERGED),
            extra=_kept_extra(keep, kept, best_x, extra),
        )


def _conform(fx, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """f's output as a contiguous CPU tensor of the state's dtype (a copy where it is strided, a view, of
    another dtype or requires grad), or an error naming what f returned and what was expected."""
    if not isinstance(fx, torch.Tensor):
        raise TypeError(f"f returned {type(fx).__name__}, expected a tensor of shape {tuple(shape)}")
    if fx.shape != shape:
        raise ValueError(f"f returned shape {tuple(fx.shape)}, expected {tuple(shape)}")
    return fx.detach().to("cpu", dtype).resolve_neg().contiguous()


@register_solver("fixed_point")
def fixed_point(
    g,
    x0,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    tau: float = 1.0,
    keep_steps: Iterable[int] = (),
    div_factor: float = 1e6,
):
    """Damped fixed-point iteration x <- (1 - tau) x + tau g(x)."""
    _check_tau(tau)
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "fixed_point", keep_steps, div_factor)
    x, nfe = x0, 0
    for _ in range(max_iter):
        fx = g(x)
        nfe += 1
        if tracker.update(x, fx) or nfe == max_iter:
            break
        if tau == 1.0:
            x = fx
        else:
            x = torch.lerp(x, fx, tau)
    return tracker.result(), tracker.stats(nfe)


@register_solver("anderson")
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
    recomputed; that row crosses to the host in the step's single transfer together with ||f(x)||, and the
    tiny (B, m, m) mixing system is solved there in float64. The newest residual norm is the row's diagonal
    entry, so it costs nothing. The regularization is relative, lam · max_j ||g_j||² over the window (so
    cond(H + reg I) <= m / lam), and keeps working when
    residuals become tiny (an absolute lam swamps the Gram matrix near convergence and stalls the method).
    A sample whose mixing system is singular or not finite falls back to a plain damped fixed-point step;
    nothing here raises. On CPU the step is one fused kernel (`_kernels.anderson_step`, same method, the
    small systems of all samples solved together by Cholesky).
    """
    _check_tau(tau)
    if m < 1:
        raise ValueError(f"anderson memory m must be >= 1, got {m}")
    if not lam > 0:
        raise ValueError(f"anderson regularization lam must be > 0, got {lam}")
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    if _kernels.usable(x0):
        dt = _NUMPY_DTYPES[x0.dtype]
        # no zero fill: the kernel reads a slot of G, Y or H only once written
        arrays = {"G": ((b, m, d), dt), "Y": ((b, m, d), dt), "H": ((b, m, m), np.float64)}
        key = ("anderson", b, d, m, max_iter, x0.dtype)
        run = _FusedRun.take(key, x0, max_iter, arrays)
        try:
            return run.solve(
                g, x0, _kernels.anderson_entry, (_SCALAR[x0.dtype], float(lam), float(tau)), name="anderson",
                max_iter=max_iter, tol=tol, stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
        finally:
            workspace.give(key, run, run.nbytes)
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "anderson", keep_steps, div_factor)
    # slots are read only once written (the products below cover the first n slots), so no zero fill
    Fb = x0.new_empty(b, m, d)  # f(x_j)
    G = x0.new_empty(b, m, d)  # g_j = f(x_j) - x_j
    H = np.zeros((b, m, m))  # Gram matrix of the g_j, on the host
    on_cpu = x0.device.type == "cpu"
    x, nfe = x0, 0
    for k in range(max_iter):
        fx = g(x)
        nfe += 1
        i, n = k % m, min(k + 1, m)
        gi = torch.sub(fx, x, out=G[:, i])
        Fb[:, i].copy_(fx)
        row = torch.bmm(gi.unsqueeze(1), G[:, :n].transpose(1, 2)).view(b, n)  # g_i · g_j, filled slots
        fx_norm = torch.linalg.vector_norm(fx, dim=1, keepdim=True)
        if on_cpu:  # zero-copy views, no transfer to batch
            host_row, host_norm = _to_host(row), _to_host(fx_norm)[:, 0]
        else:  # one transfer for both
            host = _to_host(torch.cat((row, fx_norm), 1))
            host_row, host_norm = host[:, :n], host[:, n]
        H[:, i, :n] = host_row
        H[:, :n, i] = host_row
        gi_sq = H[:, i, i].copy()
        if tracker.update_host(x, np.sqrt(np.maximum(gi_sq, 0)), host_norm) or nfe == max_iter:
            break
        if n == 1:
            x = fx if tau == 1.0 else torch.lerp(x, fx, tau)
            continue
        # relative regularization, scaled by the largest residual in the window: cond(H + reg I) <= n / lam
        alpha = _mixing_weights(H[:, :n, :n], H[:, range(n), range(n)].max(1) * lam, i)
        alpha = torch.from_numpy(alpha).to(x0.device, x0.dtype, non_blocking=True).unsqueeze(1)  # (B, 1, n)
        x = torch.bmm(alpha, Fb[:, :n]).view(b, d)  # sum_j alpha_j f(x_j)
        if tau != 1.0:
            # damped: sum_j alpha_j ((1 - tau) x_j + tau f(x_j)) = sum alpha f - (1 - tau) sum alpha g
            x.sub_(torch.bmm(alpha, G[:, :n]).view(b, d), alpha=1.0 - tau)
    return tracker.result(), tracker.stats(nfe)


def _mixing_weights(Hn: np.ndarray, reg: np.ndarray, newest: int) -> np.ndarray:
    """alpha = (H + reg I)^{-1} 1 / (1ᵀ (H + reg I)^{-1} 1) per sample; e_newest where that fails."""
    b, n, _ = Hn.shape
    A = Hn + (reg + 1e-300)[:, None, None] * np.eye(n)
    ones = np.ones((b, n, 1))
    with np.errstate(all="ignore"):
        try:
            a = np.linalg.solve(A, ones)[:, :, 0]
        except np.linalg.LinAlgError:  # some sample exactly singular: solve them one by one
            a = np.full((b, n), np.nan)
            for s in range(b):
                try:
                    a[s] = np.linalg.solve(A[s], ones[s])[:, 0]
                except np.linalg.LinAlgError:
                    pass
        alpha = a / a.sum(1, keepdims=True)
    bad = ~np.isfinite(alpha).all(1)
    if bad.any():
        alpha[bad] = 0.0
        alpha[bad, newest] = 1.0
    return alpha


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
        U, V = self.W[:, 0::2], self.W[:, 1::2]
        c = torch.bmm(y.unsqueeze(1).to(U.dtype), U.transpose(1, 2))  # (B, 1, n): y · u_j
        return -y + torch.bmm(c, V)[:, 0].to(y.dtype)

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return -y
        U, V = self.W[:, 0::2], self.W[:, 1::2]
        c = torch.bmm(y.unsqueeze(1).to(U.dtype), V.transpose(1, 2))
        return -y + torch.bmm(c, U)[:, 0].to(y.dtype)


def _step_product_inverse(S: np.ndarray, Q: np.ndarray, count: np.ndarray, dtype: torch.dtype):
    """The fused Broyden's final estimate from its stored steps (rounded values times their scales); slots
    past a sample's own count hold no step and get a zero step and unit norm."""
    L = int(count.max())
    live = np.arange(L) < count[:, None]
    steps = np.where(live[:, :, None], S[:, :L], 0).astype(_NUMPY_DTYPES[dtype])
    steps *= np.where(live, Q[0, :, :L], 0.0)[:, :, None].astype(steps.dtype)
    sn = np.where(live, Q[1, :, :L], 1.0)
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


@register_solver("broyden")
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

    The estimate is B = -I + Σ_j u_j v_jᵀ. `m=None` keeps every rank-one update (full memory); an integer m
    restarts from B = -I whenever m updates are stored (limited memory; dropping only the oldest pair breaks
    the secant conditions the later pairs were built on, and can diverge). With unit steps a step needs four
    batched products over the stored pairs (TorchDEQ's form needs six): the dot products u_j·Δx and v_j·g
    and the two combinations giving B g and Bᵀ Δx; B Δg then follows from B g_old = -Δx.
    On CPU the step is one fused kernel (`_kernels.broyden_step`) in the product form of the same estimate,
    which stores one vector per step (the step, rounded to int16/int32 with a scale) instead of two and sweeps
    it once. With ``return_inverse=True`` the final estimate is exposed as ``stats.extra["inverse_jacobian"]``
    (an `InverseJacobian`) for SHINE (the DEQ module asks for it when b_mode is "shine").
    """
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    m = max_iter if m is None else int(m)
    if m < 1:
        raise ValueError(f"broyden memory m must be >= 1 or None, got {m}")
    if _kernels.usable(x0):
        qtype = _BROYDEN_STORAGE.get(x0.dtype, x0.dtype)  # see _kernels.broyden_step
        qmax = _QMAX.get(qtype, 0.0)  # 0: float storage
        # no zero fill: the kernel reads a stored step, scale, norm or factor only once written
        arrays = {
            "S": ((b, m, d), _NUMPY_DTYPES[qtype]), "Q": ((3, b, m), np.float64), "count": ((b,), np.int64),
        }  # fmt: skip
        key = ("broyden", b, d, m, max_iter, x0.dtype, qtype)
        # the steps stay with a returned inverse estimate, so then they are the solve's own
        run = _FusedRun(x0, max_iter, arrays) if return_inverse else _FusedRun.take(key, x0, max_iter, arrays)
        S, Q, count = run.arrays["S"], run.arrays["Q"], run.arrays["count"]
        try:
            z, stats = run.solve(
                g, x0, _kernels.broyden_entry, (_SCALAR[x0.dtype], _SCALAR[qtype], qmax), name="broyden",
                max_iter=max_iter, tol=tol, stop_mode=stop_mode, keep_steps=keep_steps, div_factor=div_factor,
            )  # fmt: skip
        finally:
            if not return_inverse:
                workspace.give(key, run, run.nbytes)
        if return_inverse:
            stats.extra["inverse_jacobian"] = _step_product_inverse(S, Q, count, x0.dtype)
        return z, stats
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "broyden", keep_steps, div_factor)
    # empty, not zeros: with full memory m = max_iter, and only the slots in use are ever touched (zeroing
    # the whole buffer would fault in every page of a (B, max_iter, D) allocation up front)
    U = x0.new_empty(b, m, d)
    V = x0.new_empty(b, m, d)
    x = x0
    fx = g(x)
    nfe, stored = 1, 0
    gx = fx - x
    stop = tracker.update(x, fx, torch.linalg.vector_norm(gx, dim=1))
    p = gx  # step = -B0 g with B0 = -I: the first step is a plain fixed-point step
    while not stop and nfe < max_iter:
        x = x + p
        fx = g(x)
        nfe += 1
        g_new = fx - x
        if tracker.update(x, fx, torch.linalg.vector_norm(g_new, dim=1)) or nfe == max_iter:
            break
        n = stored
        if n:
            Un, Vn = U[:, :n], V[:, :n]
            c = torch.bmm(g_new.unsqueeze(1), Vn.transpose(1, 2))  # v_j · g
            e = torch.bmm(p.unsqueeze(1), Un.transpose(1, 2))  # u_j · Δx
            q = torch.baddbmm(g_new.unsqueeze(1), c, Un, alpha=1.0, beta=-1.0).view(
                b, d
            )  # B g = -g + Σ u_j c_j
            v = torch.baddbmm(p.unsqueeze(1), e, Vn, alpha=1.0, beta=-1.0).view(
                b, d
            )  # Bᵀ Δx = -Δx + Σ v_j e_j
        else:
            q, v = -g_new, -p
        # u = (Δx - B Δg) / (vᵀ Δg) with B Δg = B g_new - B g_old = q + Δx, so u = -q / (vᵀ Δg)
        dv = torch.stack((torch.linalg.vecdot(v, g_new - gx), torch.linalg.vecdot(v, g_new)), 1)  # (B, 2)
        denom, vg = dv[:, :1], dv[:, 1:]
        denom = torch.where(
            denom.abs() > 1e-30, denom, torch.full_like(denom, math.inf)
        )  # degenerate: no update
        u = q.div(denom).neg_()
        if stored == m:
            stored = 0
        U[:, stored].copy_(u)
        V[:, stored].copy_(v)
        stored += 1
        p = torch.addcmul(q, u, vg).neg_()  # -B_{k+1} g_new = -(q + u (vᵀ g_new))
        gx = g_new
    W = torch.stack((U[:, :stored], V[:, :stored]), 2).view(b, 2 * stored, d)
    if not return_inverse:
        return tracker.result(), tracker.stats(nfe)
    return tracker.result(), tracker.stats(nfe, inverse_jacobian=LowRankInverse(W))


@register_solver("gmres")
def gmres(
    g,
    x0,
    *,
    max_iter: int,
    tol: float,
    stop_mode: str = "rel",
    keep_steps: Iterable[int] = (),
    div_factor: float = 1e6,
):
    """GMRES for an affine map g(x) = M x + c (solves (I - M) x = c), e.g. the adjoint system of IFT.

    Batched Arnoldi with classical Gram-Schmidt applied twice (one batched product each), a per-sample least
    squares problem on the small Hessenberg matrix, and the true residual measured at the returned iterate.
    Costs one more evaluation of g than steps (to get c = g(0) - ... from g(x0)).
    """
    del div_factor  # GMRES residuals are monotone; divergence cannot happen
    b, d = x0.shape
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "gmres", keep_steps)
    k_max = max(max_iter - 1, 1)
    V = x0.new_empty(b, k_max + 1, d)
    Hs = torch.zeros(b, k_max + 1, k_max, dtype=torch.float64, device=x0.device)
    gx0 = g(x0)
    nfe = 1
    r0 = gx0 - x0  # residual of (I - M) x = c at x0
    stop = tracker.update(x0, gx0, torch.linalg.vector_norm(r0, dim=1))
    beta = torch.linalg.vector_norm(r0, dim=1)
    V[:, 0] = r0 / beta.clamp_min(1e-300)[:, None]
    e1 = torch.zeros(b, k_max + 1, 1, dtype=torch.float64, device=x0.device)
    e1[:, 0, 0] = beta.double()
    x = x0
    for j in range(k_max):
        if stop or nfe >= max_iter:
            break
        vj = V[:, j]
        w = vj - (g(vj + x0) - gx0)  # (I - M) v_j, using g(v + x0) - g(x0) = M v_j
        nfe += 1
        h = torch.bmm(w.unsqueeze(1), V[:, : j + 1].transpose(1, 2))[:, 0]
        w = w - torch.bmm(h.unsqueeze(1), V[:, : j + 1])[:, 0]
        h2 = torch.bmm(w.unsqueeze(1), V[:, : j + 1].transpose(1, 2))[:, 0]
        w = w - torch.bmm(h2.unsqueeze(1), V[:, : j + 1])[:, 0]
        hn = torch.linalg.vector_norm(w, dim=1)
        Hs[:, : j + 1, j] = (h + h2).double()
        Hs[:, j + 1, j] = hn.double()
        V[:, j + 1] = w / hn.clamp_min(1e-300)[:, None]
        y = torch.linalg.lstsq(Hs[:, : j + 2, : j + 1], e1[:, : j + 2]).solution  # (B, j+1, 1)
        y = torch.nan_to_num(y)
        x = x0 + torch.bmm(y.transpose(1, 2).to(x0.dtype), V[:, : j + 1])[:, 0]
        res = torch.linalg.vector_norm(e1[:, : j + 2] - Hs[:, : j + 2, : j + 1] @ y, dim=(1, 2)).to(x0.dtype)
        # ||g(x)|| >= ||x|| - residual: a conservative denominator for the relative residual
        fx_norm = (torch.linalg.vector_norm(x, dim=1) - res).clamp_min(0)
        stop = tracker.update(x, None, res, fx_norm)
    # measure the true residual at the returned iterate (one more evaluation, keeps the stats honest)
    x_best = tracker.result()
    fx = g(x_best)
    nfe += 1
    stats = tracker.stats(nfe)
    abs_r = torch.linalg.vector_norm(fx - x_best, dim=1)
    stats.abs_residual = abs_r
    stats.rel_residual = abs_r / (torch.linalg.vector_norm(fx, dim=1) + 1e-12)
    stats.converged = stats.residual < tol
    return x_best, stats


def solve(
    f: Callable[[State], State],
    z0: State,
    solver: str = "anderson",
    max_iter: int = 50,
    tol: float = 1e-4,
    stop_mode: str = "rel",
    **solver_kwargs,
) -> tuple[State, SolverStats]:
    """Find z* = f(z*) starting at z0 (no autograd graph is built).

    z0 is a tensor or a tuple/list of tensors with a common batch dimension first; f returns the same
    structure. Stopping and statistics are per sample; each sample's lowest-residual iterate is returned.

    Example:
        >>> import torch
        >>> from deqzoo.core import solve
        >>> A = 0.5 * torch.eye(3, dtype=torch.float64); b = torch.ones(1, 3, dtype=torch.float64)
        >>> z, stats = solve(lambda z: z @ A + b, torch.zeros(1, 3, dtype=torch.float64), tol=1e-10)
        >>> torch.allclose(z, 2 * b), bool(stats.converged.all())
        (True, True)
    """
    packer = StatePacker(z0)
    x0 = packer.flatten(z0)
    packer.check_finite(x0)
    with torch.no_grad():
        x, stats = get_solver(solver)(
            packer.wrap(f), x0.detach(), max_iter=max_iter, tol=tol, stop_mode=stop_mode, **solver_kwargs
        )
    return packer.unflatten(x), stats
