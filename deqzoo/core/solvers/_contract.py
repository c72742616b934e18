"""The contract every solver keeps, shared by all of them: the registry, argument and output checks, the
per-step bookkeeping (`_Tracker`, whose decisions are `_kernels.track` on every path), the statistics, and
the fused CPU backend's driver (`_fused_solve`) with its pooled histories.

A solver is ``fn(g, x0, *, max_iter, tol, stop_mode, **kwargs) -> (x, SolverStats)`` where ``g`` maps
(B, D) to (B, D) and runs without autograd (see `deqzoo.core.solvers`).
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch

from .. import workspace
from ..stats import SolverStats

SOLVERS: dict[str, Callable] = {}


def register_solver(name: str):
    """Register a solver under `name` (decorator). User solvers plug in the same way.

    Example:
        >>> import torch
        >>> from deqzoo.core import register_solver, solve
        >>> from deqzoo.core.solvers import fixed_point
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
    """A budget is a positive integer (any size: no solver allocates by it) and a tolerance a finite number
    > 0 (tol = inf would call z0 converged after one evaluation, whatever the input)."""
    if stop_mode not in ("abs", "rel"):
        raise ValueError(f"stop_mode must be 'abs' or 'rel', got {stop_mode!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float, np.floating)) or not (0 < tol < math.inf):
        raise ValueError(f"tol must be a finite number > 0, got {tol!r}")


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


def _readable(fx, x: torch.Tensor) -> np.ndarray:
    """f's output as a numpy array the fused kernels may read (checked on every call).

    An allow-list, checked positively: a plain dense CPU tensor of the state's shape and dtype (exactly
    torch.Tensor, strided, C-contiguous, a real data pointer, a storage holding every element; `Tensor.numpy`
    refuses negated, conjugated, zero and grad-requiring tensors by raising) is read in place. Anything else
    goes through `_check_output` (clear errors) and is copied into a fresh plain tensor by torch, which
    resolves views, negation, conjugation, zero tensors, subclasses, sparse and mkldnn layouts."""
    try:
        if (
            type(fx) is torch.Tensor
            and fx.dtype is x.dtype
            and fx.shape == x.shape
            and fx.is_cpu
            and fx.layout is torch.strided
            and fx.is_contiguous()
        ):
            storage, need = fx.untyped_storage(), (fx.storage_offset() + fx.numel()) * fx.element_size()
            if storage.data_ptr() != 0 and storage.nbytes() >= need:
                return fx.numpy()
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        pass  # torch refused to describe or share it (e.g. a wrapper without storage): copy it below
    out = torch.empty(x.shape, dtype=x.dtype)
    out.copy_(_check_output(fx, x).detach())
    return out.numpy()


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


def _into(new, old):
    """`new` (a history grown to a larger capacity: an array or tensor, each axis at least as long as old's)
    holding `old` in its leading corner; both paths grow their histories through it."""
    new[tuple(slice(0, n) for n in old.shape)] = old
    return new


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
        from .. import _kernels  # numba loads with the first solve, not with the model
        self._track = _kernels.host(_kernels.track)

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
        """The statistics of the solve (both paths): the per-sample best residuals, the trace, the flags,
        the copies kept for fixed-point correction (steps after the solve ended keep the final best
        iterate) and the solver's own `extra` entries."""
        from .. import _kernels  # numba loads with the first solve, not with the model

        if self.keep_steps:
            extra = {"kept": {k: self.kept.get(k, self.best_x) for k in self.keep_steps}, **extra}
        x0 = self.x0
        res = torch.from_numpy(self.best.astype(_NUMPY_DTYPES.get(x0.dtype, np.float64))).to(x0.device)
        if x0.dtype not in _NUMPY_DTYPES:
            res = res.to(x0.dtype)
        return SolverStats(
            nfe=nfe, abs_residual=res[0], rel_residual=res[1],
            trace=torch.tensor(self.trace, dtype=torch.float64),
            converged=torch.from_numpy(self.best[1 if self.rel else 0] < self.tol), solver=self.name,
            stop_mode=self.stop_mode, tol=self.tol, nonfinite=bool(self.flags & _kernels.NONFINITE),
            diverged=bool(self.flags & _kernels.DIVERGED), extra=extra,
        )  # fmt: skip


def _to_host(t: torch.Tensor) -> np.ndarray:
    """The one device-to-host transfer of a step (zero-copy on CPU), as float64."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy().astype(np.float64, copy=False)


def _check_tau(tau: float, what: str = "damping tau") -> None:
    """A damping factor in (0, 1] (solvers, and DEQConfig's fields, which name themselves in `what`)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating)) or not 0 < tau <= 1:
        raise ValueError(f"{what} must be in (0, 1], got {tau!r}")


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _fused_solve(step, g, x0: torch.Tensor, hist: Callable[[int], tuple], consts: tuple, *, name: str,
                 max_iter: int, tol: float, stop_mode: str, keep_steps: Iterable[int],
                 div_factor: float) -> tuple[torch.Tensor, SolverStats]:  # fmt: skip
    """Run a fused kernel step ``step(k, fx, x, xn, best_x, *hist(k), best, active, *consts, rel, tol,
    div_factor) -> (flags, trace entry, n_go)`` from x0 until its flags say stop. ``hist(k)`` returns the
    solver's history arrays with room for step k. Every iterate is a new tensor; its buffer is recycled for a
    later iterate only when nothing but the solver held it (`_Iterates`), so f may keep its input."""
    iterates = _Iterates(tuple(x0.shape), _NUMPY_DTYPES[x0.dtype])
    xa = iterates.take()
    x = torch.from_numpy(xa)
    x.copy_(x0)
    t = _Tracker(x0, max_iter, tol, stop_mode, name, keep_steps, div_factor)  # the kernel updates its state
    best_np = t.best_x.numpy()
    for k in range(max_iter):
        arrays = hist(k)
        # between two calls of f as little as possible runs here: f evicts the caches, and then every
        # Python-level operation costs several times its warm price
        fa = _readable(g(x), x)
        xna = iterates.take()  # never x's buffer: the solver holds x
        t.flags, entry, _ = step(k, fa, xa, xna, best_np, *arrays, t.best, t.active, *consts, t.rel, tol,
                                 div_factor)  # fmt: skip
        t.trace.append(entry)
        if t.flags:
            break  # steps in `keep_steps` from here on keep the final best iterate
        if k + 1 in t.keep_steps:
            t.kept[k + 1] = t.best_x.clone()
        del fa  # f's output may be a view of x: dropped, so that only f's own references keep x
        x = torch.from_numpy(xna)  # the previous iterate's tensor goes now unless something else holds it
        xa = xna
    return t.best_x, t.stats(k + 1)


class _Iterates:
    """The fused path's iterate buffers, recycled with public APIs only.

    Each iterate is a fresh numpy view of one of our buffers, wrapped by ``torch.from_numpy`` (its storage
    then holds the view). A view of the iterate, a ``.numpy()`` array of it, an autograd graph that saved it:
    each holds the storage, so the view lives. The solver keeps only a weak reference to the view: once it
    is dead nothing outside the solver holds that iterate, and its buffer takes a later one without f ever
    seeing memory change under a reference it kept. An f that keeps its inputs just costs a new buffer a step.
    """

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype = shape, dtype
        self.buffers: list[np.ndarray] = []
        self.views: list[weakref.ref] = []

    def take(self) -> np.ndarray:
        for i, ref in enumerate(self.views):
            if ref() is None:
                view = self.buffers[i].view()
                self.views[i] = weakref.ref(view)
                return view
        buf = np.empty(self.shape, self.dtype)
        view = buf.view()
        self.buffers.append(buf)
        self.views.append(weakref.ref(view))
        return view


class _Pooled:
    """A solver's history arrays lent by the workspace pool for one solve and grown in place as steps are
    taken (capacity min(m, steps), doubling), then given back with their capacity."""

    def __init__(self, key: tuple, make: Callable[[int], tuple], m: int, first: int = 8):
        self.key, self.make, self.m = key, make, m
        got = workspace.take(key)
        self.arrays, self.cap = got if got is not None else (make(min(m, first)), min(m, first))

    def __call__(self, k: int) -> tuple:
        """The arrays with room for step k (grown through `_into` when the steps taken outgrow them)."""
        cap = _grown(self.cap, k, self.m)
        if cap != self.cap:
            self.arrays = tuple(_into(new, old) for new, old in zip(self.make(cap), self.arrays))
            self.cap = cap
        return self.arrays

    def give_back(self) -> None:
        workspace.give(self.key, (self.arrays, self.cap), sum(a.nbytes for a in self.arrays))



def _sq_norms(gx: torch.Tensor, fx: torch.Tensor) -> torch.Tensor:
    """(2, B): per-sample |gx|², |fx|² accumulated in float64 (as the kernels do past float32 overflow)."""
    return torch.stack(
        (
            torch.linalg.vector_norm(gx, dim=1, dtype=torch.float64),
            torch.linalg.vector_norm(fx, dim=1, dtype=torch.float64),
        )
    ).square_()


def final_step(solver: Callable, g, x0: torch.Tensor, **kwargs) -> tuple[torch.Tensor, SolverStats]:
    """`solver` followed by one plain f step from its answer, kept per sample where it is better.

    A solve ends at its best iterate x, and has evaluated f(x) (the best iterate is usually the last one f
    saw). f(x) is often a better point than x (f contracts near the fixed point), but its residual is not
    known without one more evaluation. This keeps the last (x, f(x)) pair f was called with, evaluates f once
    at f(x) for the samples whose answer is that x, and returns per sample whichever of x and f(x) has the
    lower residual, with that point's own residual, measured, in the statistics (nfe counts the evaluation).
    A sample whose answer is not the last iterate keeps it (its f value is not at hand).
    """
    last: list[torch.Tensor] = []

    def recorded(x: torch.Tensor) -> torch.Tensor:
        fx = g(x)
        last[:] = (x, fx)
        return fx

    x, stats = solver(recorded, x0, **kwargs)
    if not last or x.shape[0] == 0:
        return x, stats
    x_last, fx_last = last
    fx_last = _check_output(fx_last, x)
    at_last = (x == x_last).all(1)
    if not bool(at_last.any()):
        return x, stats
    cand = torch.where(at_last[:, None], fx_last, x)
    del last[:]
    fc = _check_output(g(cand), cand)
    sq = _to_host(_sq_norms(fc - cand, fc))
    abs_c = np.sqrt(sq[0])
    rel_c = abs_c / (np.sqrt(sq[1]) + 1e-12)  # as the solvers' bookkeeping (`_kernels.track`)
    new = rel_c if stats.stop_mode == "rel" else abs_c
    better_np = at_last.cpu().numpy() & np.isfinite(new) & (new < stats.residual.double().cpu().numpy())
    better = torch.from_numpy(better_np)
    dev = better.to(x.device)
    x = torch.where(dev[:, None], cand, x)
    stats.abs_residual = torch.where(dev, torch.from_numpy(abs_c).to(stats.abs_residual), stats.abs_residual)
    stats.rel_residual = torch.where(dev, torch.from_numpy(rel_c).to(stats.rel_residual), stats.rel_residual)
    stats.converged = (stats.residual.double().cpu() < stats.tol).to(torch.bool)
    stats.nfe += 1
    stats.extra["final_step"] = better
    return x, stats
