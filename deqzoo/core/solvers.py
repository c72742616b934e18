"""Fixed-point solvers for z = f(z), registered by name. They work on flat (B, D) states.

A solver is ``fn(g, x0, *, max_iter, tol, stop_mode, **kwargs) -> (x, SolverStats)`` where ``g`` maps
(B, D) to (B, D) and runs without autograd. Every built-in solver keeps per-sample statistics and returns,
per sample, the iterate with the lowest residual seen; a sample whose residual is below tol is frozen there
(its next iterates are its best one, its history is no longer updated), so its result does not depend on the
rest of its batch. f is called on a new tensor every step, never on a buffer the solver writes while f holds
it, so f may keep its inputs (the fused path recycles an iterate's array only when nothing outside the solver
holds the iterate, a view, an array or an autograd graph of it); f's output is checked (shape, dtype) on every
call. Built-ins also accept ``keep_steps`` (iterations at which to keep a copy of the best iterate so far, for
fixed-point correction) and ``div_factor`` (stop when the largest absolute residual exceeds ``div_factor``
times the largest best one: divergence). Memory grows with the work done (histories of min(m, steps taken)
entries), never with max_iter. An empty batch (B = 0) returns an empty result without calling f.

Registered: ``fixed_point`` (damped), ``anderson`` (incremental Gram matrix), ``broyden`` (good Broyden on
the inverse Jacobian, full or limited memory; exposes its inverse estimate for SHINE), ``gmres`` (Krylov, for
affine maps such as the adjoint system of implicit differentiation).

On CPU float32/float64 states, ``anderson`` and ``broyden`` run each step as one fused numba kernel
(`deqzoo.core._kernels`), with their histories from a per-thread pool (`deqzoo.core.workspace`); elsewhere,
with ``DEQZOO_KERNELS=0``, or while the kernels compile on first use, they run their torch path. Both paths
are one algorithm: the same per-step bookkeeping (`_kernels.track`), the same mixing system
(`_kernels.mixing_weights`) and the same Broyden step rule and product-form estimate; the tests check that
they agree per sample to rounding.
"""

from __future__ import annotations

import inspect
import sys
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


def _check_solve_args(max_iter: int, tol: float, stop_mode: str) -> None:
    if stop_mode not in ("abs", "rel"):
        raise ValueError(f"stop_mode must be 'abs' or 'rel', got {stop_mode!r}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")


def _check_output(fx, x: torch.Tensor) -> torch.Tensor:
    """f's output, checked on every call on every path: a tensor of the state's shape, dtype and device
    (errors name both). Returned as the torch path uses it: sparse and mkldnn outputs as dense tensors; a
    meta tensor (no data) is an error."""
    if not isinstance(fx, torch.Tensor):
        raise TypeError(f"f returned {type(fx).__name__}, expected a tensor of shape {tuple(x.shape)}")
    if fx.shape != x.shape:
        raise ValueError(f"f returned shape {tuple(fx.shape)}, expected {tuple(x.shape)}")
    if fx.dtype != x.dtype:
        raise TypeError(f"f returned dtype {fx.dtype}, expected {x.dtype} (the state's dtype)")
    if fx.is_meta:
        raise ValueError("f returned a meta tensor (shape only, no data); a solve needs its values")
    if fx.device != x.device:
        raise ValueError(f"f returned a tensor on {fx.device}, expected {x.device}")
    if fx.layout is not torch.strided:  # sparse or mkldnn
        fx = fx.to_dense()
    return fx


def _readable(fx: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """f's output (already checked by `_check_output`) as a numpy array the fused kernels may read.

    An allow-list: a plain dense CPU tensor (exactly torch.Tensor, strided layout, C-contiguous, no negative
    or conjugate bit, not a zero tensor, a real data pointer, a storage holding every element) is read in
    place; anything else (expanded, strided, negated or conjugated views, zero tensors, subclasses) is first
    copied into a fresh plain tensor by torch (`_check_output` has made sparse and mkldnn outputs dense and
    refused meta tensors)."""
    try:
        if (
            type(fx) is torch.Tensor
            and fx.layout is torch.strided
            and fx.is_cpu
            and not fx.requires_grad
            and fx.is_contiguous()
            and not fx.is_neg()
            and not fx.is_conj()
            and not fx._is_zerotensor()
            and fx.data_ptr() != 0
        ):
            storage = fx.untyped_storage()
            if storage.nbytes() >= (fx.storage_offset() + fx.numel()) * fx.element_size():
                return fx.numpy()
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        pass  # torch refused to describe it (e.g. a wrapper without storage): copy it below
    src = fx.detach()
    out = torch.empty(x.shape, dtype=x.dtype)
    out.copy_(src)  # torch resolves views, negation, conjugation, zero tensors and subclasses
    return out.numpy()


def _kept_extra(keep_steps: list[int], kept: dict, best_x: torch.Tensor, extra: dict) -> dict:
    """stats.extra: the copies kept for fixed-point correction (steps after the solve ended keep the final
    best iterate) and the solver's own entries."""
    if not keep_steps:
        return extra
    return {"kept": {k: kept.get(k, best_x) for k in keep_steps}, **extra}


def _empty_result(
    x0: torch.Tensor, name: str, tol: float, stop_mode: str
) -> tuple[torch.Tensor, SolverStats]:
    """A batch of zero samples: nothing to solve, f is not called."""
    none = x0.new_zeros(0)
    return x0.clone(), SolverStats(
        nfe=0, abs_residual=none, rel_residual=none.clone(), trace=torch.zeros(0, dtype=torch.float64),
        converged=torch.zeros(0, dtype=torch.bool), solver=name, stop_mode=stop_mode, tol=tol,
    )  # fmt: skip


def _grown(cap: int, k: int, m: int) -> int:
    """A history's capacity for step k with memory m: it doubles while the steps taken outgrow it."""
    return cap if k < cap or cap >= m else min(m, 2 * cap)


class _Tracker:
    """The torch path's per-step bookkeeping: per-sample best iterate and residuals, freezing, trace, stop.

    A step hands over per-sample |f(x) - x|² and |f(x)|² (one small device-to-host transfer); the decisions
    are `_kernels.track`, the same function the fused kernels run, so both paths stop, freeze and report
    alike. Only the masked copy of improved best iterates and the freezing of the next iterate run on the
    device.
    """

    def __init__(self, x0: torch.Tensor, max_iter: int, tol: float, stop_mode: str, name: str,
                 keep_steps: Iterable[int] = (), div_factor: float = 1e6):  # fmt: skip
        _check_solve_args(max_iter, tol, stop_mode)
        b = x0.shape[0]
        self.x0 = x0
        self.best_x = x0.clone(memory_format=torch.contiguous_format)
        self.best = np.full((2, b), np.inf)
        self.active = np.ones(b, np.int64)
        self.improved = np.zeros(b, np.bool_)
        self.go = np.zeros(b, np.int64)
        self.n_go = b
        self.all_active = True
        self.trace: list[float] = []
        self.tol, self.stop_mode, self.name, self.steps = tol, stop_mode, name, 0
        self.rel = stop_mode == "rel"
        self.keep_steps = sorted({int(k) for k in keep_steps})
        self.kept: dict[int, torch.Tensor] = {}
        self.div_factor = div_factor
        self.flags = 0
        self._track = _kernels.host(_kernels.track)

    @property
    def nonfinite(self) -> bool:
        return bool(self.flags & _kernels.NONFINITE)

    @property
    def diverged(self) -> bool:
        return bool(self.flags & _kernels.DIVERGED)

    def update(self, x: torch.Tensor, fx: torch.Tensor | None, abs_r: torch.Tensor | None = None,
               fx_norm: torch.Tensor | None = None) -> bool:  # fmt: skip
        """Record iterate x with f(x) = fx (or the norms abs_r = |fx - x|, fx_norm = |fx|). Returns True when
        the solve should stop (converged, non-finite or diverged)."""
        if abs_r is None:
            abs_r = torch.linalg.vector_norm(fx - x, dim=1)
        if fx_norm is None:
            fx_norm = torch.linalg.vector_norm(fx, dim=1)
        host = _to_host(torch.stack((abs_r, fx_norm)))
        return self.update_sq(x, host[0] ** 2, host[1] ** 2)

    def update_sq(self, x: torch.Tensor, g_sq: np.ndarray, f_sq: np.ndarray) -> bool:
        """As `update`, with the per-sample squared norms on the host (float64)."""
        self.flags, t, self.n_go = self._track(
            g_sq, f_sq, self.best, self.active, self.improved, self.go, self.rel, self.tol, self.div_factor
        )
        self.trace.append(float(t))
        if self.improved.all():
            self.best_x.copy_(x)
        elif self.improved.any():
            mask = torch.from_numpy(self.improved).to(x.device, non_blocking=True)[:, None]
            self.best_x = torch.where(mask, x, self.best_x)
        self.all_active = bool(self.active.all())
        self.steps += 1
        if self.keep_steps and self.steps in self.keep_steps:
            self.kept[self.steps] = self.best_x.clone()
        return self.flags != 0

    def stepping(self, device: torch.device) -> torch.Tensor:
        """(B,) bool on the device: the samples that take a step now."""
        mask = np.zeros(self.active.shape[0], np.bool_)
        mask[self.go[: self.n_go]] = True
        return torch.from_numpy(mask).to(device, non_blocking=True)

    def next_iterate(self, xn: torch.Tensor) -> torch.Tensor:
        """xn with every frozen sample at its best iterate."""
        if self.all_active:
            return xn
        mask = torch.from_numpy(self.active.astype(np.bool_)).to(xn.device, non_blocking=True)[:, None]
        return torch.where(mask, xn, self.best_x)

    def result(self) -> torch.Tensor:
        """The best iterates (a tensor of the solver's own, never the caller's x0)."""
        return self.best_x

    def stats(self, nfe: int, **extra) -> SolverStats:
        return _stats(self.best, self.trace, nfe, self.x0, self.name, self.stop_mode, self.tol, self.flags,
                      _kept_extra(self.keep_steps, self.kept, self.best_x, extra))  # fmt: skip


def _stats(best: np.ndarray, trace: list, nfe: int, x0: torch.Tensor, name: str, stop_mode: str, tol: float,
           flags: int, extra: dict) -> SolverStats:  # fmt: skip
    """The statistics of a solve from its bookkeeping (both paths)."""
    r = best[1] if stop_mode == "rel" else best[0]
    res = torch.from_numpy(best.astype(_NUMPY_DTYPES.get(x0.dtype, np.float64))).to(x0.device)
    if x0.dtype not in _NUMPY_DTYPES:
        res = res.to(x0.dtype)
    return SolverStats(
        nfe=nfe, abs_residual=res[0], rel_residual=res[1],
        trace=torch.tensor(trace, dtype=torch.float64), converged=torch.from_numpy(r < tol),
        solver=name, stop_mode=stop_mode, tol=tol, nonfinite=bool(flags & _kernels.NONFINITE),
        diverged=bool(flags & _kernels.DIVERGED), extra=extra,
    )  # fmt: skip


def _to_host(t: torch.Tensor) -> np.ndarray:
    """The one device-to-host transfer of a step (zero-copy on CPU), as float64."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy().astype(np.float64, copy=False)


def _check_tau(tau: float) -> None:
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"damping tau must be in (0, 1], got {tau}")


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _fused_solve(step, g, x0: torch.Tensor, hist: Callable[[int], tuple], consts: tuple, *, name: str,
                 max_iter: int, tol: float, stop_mode: str, keep_steps: Iterable[int],
                 div_factor: float) -> tuple[torch.Tensor, SolverStats]:  # fmt: skip
    """Run a fused kernel step ``step(k, fx, x, xn, best_x, *hist(k), best, active, *consts, rel, tol,
    div_factor) -> (flags, trace entry, n_go)`` from x0 until its flags say stop. ``hist(k)`` returns the
    solver's history arrays with room for step k. Every iterate is a new tensor; its array is recycled for a
later iterate only when nothing but the solver holds it (`_holders`), so f may keep its input."""
    b = x0.shape[0]
    x = x0.clone(memory_format=torch.contiguous_format)
    xa = x.numpy()
    best_x = x.clone()  # the result; starts as x0
    best_np = best_x.numpy()
    best, active = np.full((2, b), np.inf), np.ones(b, np.int64)
    rel = stop_mode == "rel"
    keep = sorted({int(k) for k in keep_steps})
    kept: dict[int, torch.Tensor] = {}
    trace: list[float] = []
    shape, dtype, need = x.shape, x.dtype, x.numel() * x.element_size()
    x = torch.from_numpy(xa)  # iterates are tensors over arrays of ours: `_holders` counts who holds them
    held = _holders(x)
    spare = None  # an iterate's array that nothing outside the solver holds: the next step writes into it
    for k in range(max_iter):
        arrays = hist(k)
        fx = g(x)
        # between two calls of f as little as possible runs here: f evicts the caches, and then every
        # Python-level operation costs several times its warm price. The common case, checked positively:
        # a plain dense CPU tensor of the state's shape and dtype, with a real data pointer and a storage
        # holding it (Tensor.numpy refuses negated, conjugated and grad-requiring tensors by raising)
        fa = None
        try:
            if (
                type(fx) is torch.Tensor
                and fx.dtype is dtype
                and fx.shape == shape
                and fx.is_cpu
                and fx.layout is torch.strided
                and fx.is_contiguous()
                and not fx._is_zerotensor()
            ):
                storage = fx.untyped_storage()
                if (
                    storage.data_ptr() != 0
                    and storage.nbytes() >= need + fx.storage_offset() * fx.element_size()
                ):
                    fa = fx.numpy()
        except RuntimeError:
            pass
        if fa is None:  # everything else: checked (clear errors), copied into a plain tensor
            fa = _readable(_check_output(fx, x), x)
        xna = np.empty_like(xa) if spare is None else spare
        flags, t, _ = step(k, fa, xa, xna, best_np, *arrays, best, active, *consts, rel, tol, div_factor)
        trace.append(t)
        if flags:
            break  # steps in `keep` from here on keep the final best iterate
        if keep and k + 1 in keep:
            kept[k + 1] = best_x.clone()
        del fx, fa  # f's output may be a view of x: it must not count as a holder below
        spare = xa if held[0] >= 0 and _holders(x) == held else None  # see `_holders`
        x = torch.from_numpy(xna)
        xa = xna
    return best_x, _stats(best, trace, k + 1, x0, name, stop_mode, tol, flags,
                          _kept_extra(keep, kept, best_x, {}))  # fmt: skip


def _holders(x: torch.Tensor) -> tuple[int, int, int]:
    """Who holds iterate x: references to the Python object, to its TensorImpl (autograd's saved tensors,
    C++ containers) and to its storage (views, ``.numpy()`` arrays). Counts equal to a fresh iterate's,
    taken the same way, mean that nothing but the solver holds x: its array may then take a later iterate
    without f ever seeing a buffer change under a reference it kept. An f that kept x, a view of it, or
    saved it for backward makes x held, and the next step gets a fresh array instead."""
    try:
        return sys.getrefcount(x), x._use_count(), torch._C._storage_Use_Count(x.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):  # private counters gone in some torch: never recycle
        return (-1, -1, -1)


class _Pooled:
    """A solver's history arrays lent by the workspace pool for one solve and grown in place as steps are
    taken (capacity min(m, steps), doubling), then given back with their capacity."""

    def __init__(self, key: tuple, make: Callable[[int], tuple], grow: Callable[[tuple, int], tuple],
                 m: int, first: int = 8):  # fmt: skip
        self.key, self.make, self.grow_fn, self.m = key, make, grow, m
        got = workspace.take(key)
        self.arrays, self.cap = got if got is not None else (make(min(m, first)), min(m, first))

    def __call__(self, k: int) -> tuple:
        cap = _grown(self.cap, k, self.m)
        if cap != self.cap:
            self.arrays, self.cap = self.grow_fn(self.arrays, cap), cap
        return self.arrays

    def give_back(self) -> None:
        workspace.give(self.key, (self.arrays, self.cap), sum(a.nbytes for a in self.arrays))


@register_solver("fixed_point")
@torch.no_grad()
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
    _check_solve_args(max_iter, tol, stop_mode)
    if x0.shape[0] == 0:
        return _empty_result(x0, "fixed_point", tol, stop_mode)
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "fixed_point", keep_steps, div_factor)
    x, nfe = x0.clone(), 0
    for _ in range(max_iter):
        fx = g(x)
        fx = _check_output(fx, x)
        nfe += 1
        if tracker.update(x, fx) or nfe == max_iter:
            break
        x = tracker.next_iterate(fx.clone() if tau == 1.0 else torch.lerp(x, fx, tau))
    return tracker.result(), tracker.stats(nfe)


def _sq_norms(gx: torch.Tensor, fx: torch.Tensor) -> torch.Tensor:
    """(2, B): per-sample |gx|², |fx|² accumulated in float64 (as the kernels do past float32 overflow)."""
    return torch.stack(
        (
            torch.linalg.vector_norm(gx, dim=1, dtype=torch.float64),
            torch.linalg.vector_norm(fx, dim=1, dtype=torch.float64),
        )
    ).square_()


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
    mixing = _kernels.host(_kernels.mixing_weights)
    cap = min(m, 8)
    G = x0.new_empty(b, cap, d)  # g_j = f(x_j) - x_j; slots are read only once written
    Y = x0.new_empty(b, cap, d)  # f(x_j) - (1 - tau) g_j
    H = np.zeros((b, cap, cap))  # Gram matrix of the g_j, on the host (float64)
    x, nfe = x0.clone(), 0
    for k in range(max_iter):
        if _grown(cap, k, m) != cap:
            cap = _grown(cap, k, m)
            G = torch.cat((G, G.new_empty(b, cap - G.shape[1], d)), 1)
            Y = torch.cat((Y, Y.new_empty(b, cap - Y.shape[1], d)), 1)
            H2 = np.zeros((b, cap, cap))
            H2[:, : H.shape[1], : H.shape[1]] = H
            H = H2
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
            W, ok = np.empty((n, n_go)), np.zeros(n_go, np.bool_)
            mixing(H, go, n_go, n, lam, W, ok)
            alpha[go[:n_go][ok]] = W[:, ok].T
        alpha_t = torch.from_numpy(alpha).to(x0.device, x0.dtype, non_blocking=True).unsqueeze(1)
        x = tracker.next_iterate(torch.bmm(alpha_t, Y[:, :n]).view(b, d))
    return tracker.result(), tracker.stats(nfe)


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
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    m = max_iter if m is None else int(m)
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


@register_solver("gmres")
@torch.no_grad()
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
    squares problem on the small Hessenberg matrix (float64; a NaN or singular system ends that sample
    cleanly, never with a LAPACK error), and the true residual measured
    at the returned iterate. The Krylov basis grows with the steps taken. Costs one more evaluation of g than
    steps (to get c = g(0) - ... from g(x0)).
    """
    del div_factor  # GMRES residuals are monotone; divergence cannot happen
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    if b == 0:
        return _empty_result(x0, "gmres", tol, stop_mode)
    tiny = torch.finfo(x0.dtype).tiny
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "gmres", keep_steps)
    k_max = max(max_iter - 1, 1)
    gx0 = g(x0)
    gx0 = _check_output(gx0, x0)
    nfe = 1
    r0 = gx0 - x0  # residual of (I - M) x = c at x0
    stop = tracker.update(x0, gx0, torch.linalg.vector_norm(r0, dim=1))
    beta = torch.linalg.vector_norm(r0, dim=1)
    basis = [torch.nan_to_num(r0 / beta.clamp_min(tiny)[:, None])]
    Hs = torch.zeros(b, 1, 0, dtype=torch.float64, device=x0.device)  # grows with the steps
    e1 = beta.double()[:, None, None]
    x = x0
    for j in range(k_max):
        if stop or nfe >= max_iter:
            break
        vj = basis[j]
        fv = g(vj + x0)
        fv = _check_output(fv, x0)
        w = vj - (fv - gx0)  # (I - M) v_j, using g(v + x0) - g(x0) = M v_j
        nfe += 1
        Vm = torch.stack(basis, 1)
        h = torch.bmm(w.unsqueeze(1), Vm.transpose(1, 2))[:, 0]
        w = w - torch.bmm(h.unsqueeze(1), Vm)[:, 0]
        h2 = torch.bmm(w.unsqueeze(1), Vm.transpose(1, 2))[:, 0]
        w = w - torch.bmm(h2.unsqueeze(1), Vm)[:, 0]
        hn = torch.linalg.vector_norm(w, dim=1)
        col = torch.cat(((h + h2).double(), hn.double()[:, None]), 1)[:, :, None]  # (B, j + 2, 1)
        Hs = torch.cat((torch.cat((Hs, Hs.new_zeros(b, 1, j)), 1), col), 2)
        basis.append(torch.nan_to_num(w / hn.clamp_min(tiny)[:, None]))
        e = torch.cat((e1, e1.new_zeros(b, j + 1, 1)), 1)
        y = _least_squares(Hs, e)  # (B, j+1, 1), finite
        x = x0 + torch.bmm(y.transpose(1, 2).to(x0.dtype), Vm)[:, 0]
        res = torch.linalg.vector_norm(e - Hs @ y, dim=(1, 2)).to(x0.dtype)
        # ||g(x)|| >= ||x|| - residual: a conservative denominator for the relative residual
        fx_norm = (torch.linalg.vector_norm(x, dim=1) - res).clamp_min(0)
        stop = tracker.update(x, None, res, fx_norm)
    # measure the true residual at the returned iterate (one more evaluation, keeps the stats honest)
    x_best = tracker.result()
    fx = g(x_best)
    fx = _check_output(fx, x_best)
    nfe += 1
    stats = tracker.stats(nfe)
    abs_r = torch.linalg.vector_norm(fx - x_best, dim=1)
    stats.abs_residual = abs_r
    stats.rel_residual = abs_r / (torch.linalg.vector_norm(fx, dim=1) + 1e-12)
    stats.converged = (stats.residual < tol).cpu()
    stats.nonfinite = stats.nonfinite or not bool(torch.isfinite(abs_r).all())
    return x_best, stats


def _least_squares(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """argmin |A y - rhs| per sample (float64). LAPACK asserts on non-finite input, so a sample with a NaN
    or Inf entry gets y = 0 (its residual stays the initial one and the stats flag it); a singular system
    gets the rank-revealing driver's answer on CPU, and y = 0 where a device's driver returns non-finite."""
    finite = torch.isfinite(A).flatten(1).all(1) & torch.isfinite(rhs).flatten(1).all(1)
    A = torch.where(finite[:, None, None], A, 0.0)
    rhs = torch.where(finite[:, None, None], rhs, 0.0)
    y = torch.linalg.lstsq(A, rhs).solution
    good = finite & torch.isfinite(y).flatten(1).all(1)
    return torch.where(good[:, None, None], y, 0.0)


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


from . import hyper as _hyper  # noqa: E402,F401  (registers "hyperanderson"; it reuses this module's tracker)
