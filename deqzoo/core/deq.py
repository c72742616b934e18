"""The DEQ module: forward solve without a graph, backward mode attached, statistics returned."""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch
from torch import nn

from .backward import BACKWARD_MODES, BackwardContext, phantom_steps
from .caps import check_gmres_memory
from .config import DEQConfig
from .halting import is_rowwise, rowwise
from .norm import checked_once
from .regularize import jacobian_reg
from .solvers import final_step, get_solver
from .state import State, StatePacker
from .stats import SolverStats


class DeferredState:
    """A state whose gradient graph is built only when called: ``deq(f, z0, defer_graphs=True)`` returns the
    output and the fixed-point correction states as these, so that a training step can build, backpropagate
    and free one state's graph at a time (memory constant in the number of supervised states) instead of
    keeping every graph of the forward until the backward.

    ``state()`` builds a fresh graph each call (the same computation the eager forward does: the backward
    mode at the fixed point for the output, ``correction_k`` phantom steps from the kept iterate for an
    earlier state); ``state.start`` is the detached state it starts from (the solver's z* or kept iterate).

    Example:
        >>> import torch
        >>> from deqzoo.core import DEQ, DEQConfig
        >>> lin = torch.nn.Linear(4, 4); x = torch.randn(2, 4)
        >>> deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=30, n_states=2))
        >>> z, stats = deq(lambda z: torch.tanh(0.3 * lin(z) + x), torch.zeros(2, 4), defer_graphs=True)
        >>> for state in stats.states:          # one graph at a time
        ...     state().pow(2).sum().backward()
        >>> z.start.requires_grad, lin.weight.grad is not None
        (False, True)
    """

    def __init__(self, build, start: State):
        self._build, self.start = build, start

    def __call__(self) -> State:
        return self._build()

    def value(self) -> State:
        """The state's value without a graph (what the eager forward returns): built with autograd on, as
        hook-based backward modes need, and detached at once, so its graph is freed here."""
        with torch.enable_grad():
            z = self()
        return z.detach() if isinstance(z, torch.Tensor) else type(z)(t.detach() for t in z)


def _under_autocast(f, dtype: torch.dtype):
    """f evaluated under torch.autocast in `dtype` (DEQConfig.f_dtype), each output tensor cast back to its
    state tensor's dtype: the solver and its bookkeeping never see the low precision, f's matmuls and
    convolutions do (autocast keeps its own float32 list, e.g. normalisations, in float32)."""

    def run(z: State) -> State:
        first = z if isinstance(z, torch.Tensor) else z[0]
        with torch.autocast(first.device.type, dtype=dtype):
            out = f(z)
        if isinstance(z, torch.Tensor):
            return out.to(z.dtype) if isinstance(out, torch.Tensor) else out
        if isinstance(out, (tuple, list)) and len(out) == len(z):
            return type(out)(o.to(s.dtype) if isinstance(o, torch.Tensor) else o for o, s in zip(out, z))
        return out  # a structure mismatch: the state packer reports it

    return run


class DEQConvergenceError(RuntimeError):
    """The forward solve did not reach its tolerance (raised when on_nonconvergence="raise")."""

    def __init__(self, message: str, stats: SolverStats):
        super().__init__(message)
        self.stats = stats


class DEQ(nn.Module):
    """A deep equilibrium layer: z* = f(z*), differentiated by the configured backward mode.

    ``z, stats = deq(f, z0)``: f is a closure over the input injection mapping a state to a state of the
    same structure (a tensor or a tuple/list of tensors, batch first). Without autograd (inference) z is the
    solver's z*; with autograd the backward mode attaches the gradient (see deqzoo.core.backward).
    ``stats`` is a `SolverStats`; in training it may also carry ``jac_loss`` (DEQConfig.jac_reg_samples) and
    ``states`` (fixed-point correction, DEQConfig.n_states / state_indices).

    ``deq(f, z0, defer_graphs=True)`` with autograd on builds no gradient graph in the forward: z and every
    entry of ``stats.states`` are `DeferredState` objects (``z.start`` is z*, ``z()`` builds the backward
    mode's graph), for a training step that backpropagates one supervised state at a time.

    Example:
        >>> import torch
        >>> from deqzoo.core import DEQ, DEQConfig
        >>> lin = torch.nn.Linear(4, 4); x = torch.randn(2, 4)
        >>> deq = DEQ(DEQConfig(f_solver="anderson", f_max_iter=50, f_tol=1e-6))
        >>> z, stats = deq(lambda z: torch.tanh(0.3 * lin(z) + x), torch.zeros(2, 4))
        >>> z.shape, stats.nfe > 0, bool(stats.converged.all())
        (torch.Size([2, 4]), True, True)
    """

    def __init__(self, config: DEQConfig | None = None, **overrides):
        super().__init__()
        config = config or DEQConfig()
        self.config = config.update(**overrides) if overrides else config
        self.compile_options: dict[str, Any] | None = None  # set by `compile_f`; not part of the config

    def compile_f(self, enabled: bool = True, **options: Any) -> DEQ:
        """Run f through ``torch.compile(f, **options)`` in every solve (False: back to eager).

        The solver loop stays eager (its stopping test reads values every step); f, the costly part, is one
        compiled graph per call, with no graph break per step, compiled on the first solve and reused by
        every later step and solve with the same shapes.

        Example:
            >>> import torch
            >>> from deqzoo.core import DEQ
            >>> deq = DEQ(f_solver="fixed_point", f_max_iter=30, f_tol=1e-6).compile_f()
            >>> deq.compile_options
            {}
        """
        self.compile_options = dict(options) if enabled else None
        return self

    def extra_repr(self) -> str:
        c = self.config
        return f"f_solver={c.f_solver}, f_max_iter={c.f_max_iter}, f_tol={c.f_tol}, b_mode={c.b_mode}"

    def _max_iter(self, training: bool) -> int:
        cfg = self.config
        if training and cfg.f_max_iter_min:
            return int(torch.randint(cfg.f_max_iter_min, cfg.f_max_iter + 1, ()).item())
        return cfg.f_max_iter

    def forward(self, f, z0: State, *, defer_graphs: bool = False, halt=None) -> tuple[State, SolverStats]:
        return self.solve_with(self.config, f, z0, defer_graphs=defer_graphs, halt=halt)

    def solve_with(self, cfg: DEQConfig, f, z0: State, *, max_iter: int | None = None,
                   defer_graphs: bool = False, halt=None) -> tuple[State, SolverStats]:
        """`forward` under the settings `cfg` instead of `self.config` (which stays untouched, so a subclass
        that solves with per-call settings, e.g. a hypersolver, is safe across threads).

        `max_iter` overrides the forward budget for this call (no f_max_iter_min randomization); the solve
        still stops at cfg.f_tol. ``halt`` adds per-sample stop rules to the forward solve
        (`deqzoo.core.halting`); an f marked `deqzoo.core.halting.rowwise` is called on the samples still
        iterating only (unless cfg.f_compact is False). ``max_iter=0`` runs no solve: z0 is taken as z*
        (Implicit²'s training forward from a reused fixed point, `FixedPointCache(hit_max_iter=0)`); with
        autograd the backward mode's differentiable step f(z0) is the output (modes "ift", "jacobian_free",
        phantom "npg"), without it f(z0) is (stats.nfe = 1). No tolerance is checked then: the statistics
        report the residual of z0, ||f(z0) - z0|| (/ ||f(z0)||), measured from that one f call.

        Example:
            >>> import torch
            >>> from deqzoo.core import DEQ, DEQConfig
            >>> deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=50, f_tol=1e-6))
            >>> f = lambda z: 0.5 * z + 1  # z* = 2
            >>> z, stats = deq.solve_with(deq.config, f, torch.full((1, 2), 1.0), max_iter=0)
            >>> z.tolist(), stats.nfe, round(float(stats.rel_residual[0]), 4)  # the mode's step: nfe 0
            ([[1.5, 1.5]], 0, 0.3333)
        """
        if torch.jit.is_tracing() or torch.compiler.is_exporting():
            raise RuntimeError(
                f"DEQ: the {cfg.f_solver!r} forward solve cannot be traced or exported: its stopping test "
                "and statistics read tensor values every step. Export under fixed-iteration inference "
                "instead: deqzoo.export.exportable(model) (see deqzoo.export)")
        marked = is_rowwise(f)
        if marked and not cfg.f_compact:
            f, marked = (lambda inner: lambda z: inner(z, None))(f), False  # the whole batch every step
        if self.compile_options is not None:
            f = torch.compile(f, **self.compile_options)  # compiled code is cached per code object: one
            # compilation serves every later call of the same model function (guards: shapes, dtypes)
            if marked:
                f = rowwise(f)
        packer = StatePacker(z0)
        x0 = packer.flatten(z0)
        compiling = torch.compiler.is_compiling()  # the fixed-trip solve: no host read (docs/engine.md)
        if not compiling:  # compiled, a non-finite z0 row is flagged by the solve's own stats instead
            packer.check_finite(x0)
        if cfg.f_dtype is not None:
            f = _under_autocast(f, getattr(torch, cfg.f_dtype))
        g = packer.wrap(f)
        grad = torch.is_grad_enabled()
        if max_iter is None:
            max_iter = self._max_iter(grad)
        elif isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
            raise ValueError(f"DEQ.solve_with: max_iter must be an integer >= 0 or None, got {max_iter!r}")
        if max_iter == 0:
            if defer_graphs and grad:
                raise ValueError("DEQ: defer_graphs=True needs a forward solve to defer from (max_iter=0)")
            return self._without_solve(cfg, g, x0, packer, grad)
        keep = cfg.state_steps(max_iter) if grad else []
        mode = BACKWARD_MODES[cfg.b_mode]
        ctx = BackwardContext(config=cfg, stats=None, x0=x0, max_iter=max_iter, keep_steps=keep)
        if grad and defer_graphs and not getattr(mode, "needs_solve", True):
            raise ValueError(
                f"defer_graphs=True needs a forward solve to defer from; b_mode={cfg.b_mode!r} builds its "
                "graph while solving"
            )
        # a mode with replaces_solve (reversible) runs its own forward computation in inference too
        if not getattr(mode, "needs_solve", True) and (grad or getattr(mode, "replaces_solve", False)):
            x = mode(g, None, ctx)
            x_star = x
            self._report(ctx.stats, cfg)
            stats = ctx.stats
            if not grad:
                return packer.unflatten(x), stats
        else:
            kwargs = dict(cfg.f_solver_kwargs)
            if cfg.b_mode == "shine":  # SHINE reuses the forward solver's inverse-Jacobian estimate
                kwargs.setdefault("return_inverse", True)
            solver_keep = [k for k in keep if k < max_iter]
            if solver_keep:
                kwargs["keep_steps"] = solver_keep
            if cfg.f_solver == "gmres":  # its basis grows with the budget: refused before any allocation
                check_gmres_memory("f_max_iter", max_iter, x0)
            if halt is not None:
                kwargs["halt"] = halt
            # weight norms checked once per solve, not per f call (compiled: the model's reset_norm did it)
            with torch.no_grad(), contextlib.nullcontext() if compiling else checked_once():
                run = get_solver(cfg.f_solver)
                if cfg.f_final_step == "stored":  # f of the answer, already computed (no call)
                    kwargs["return_f"] = True
                elif cfg.f_final_step:
                    # an int n: fⁿ of each sample's answer, as the original releases return (issue 58)
                    steps = 0 if cfg.f_final_step is True else cfg.f_final_step
                    run = functools.partial(final_step, run, steps=steps)
                x_star, stats = run(g, x0.detach(), max_iter=max_iter, tol=cfg.f_tol,
                                    stop_mode=cfg.f_stop_mode, **kwargs)
            self._report(stats, cfg)
            if not grad:
                return packer.unflatten(x_star), stats
            ctx.stats = stats
            if defer_graphs:
                return self._deferred(g, x_star, ctx, keep, cfg, packer)
            x = mode(g, x_star, ctx)
            if "supervised_states" in stats.extra:  # b_mode "truncated" with supervise=True
                flat = stats.extra["supervised_states"]
                stats.extra["supervised_states"] = [packer.unflatten(s) for s in flat]
        if cfg.jac_reg_samples > 0:
            stats.jac_loss = self._jac_loss(g, x_star if ctx.kept is None else x, ctx)
        if keep:
            stats.states = [packer.unflatten(s) for s in self._states(g, x, ctx, keep, cfg)]
        return packer.unflatten(x), stats

    def _deferred(self, g, x_star: torch.Tensor, ctx: BackwardContext, keep: list[int], cfg: DEQConfig,
                  packer: StatePacker) -> tuple[DeferredState, SolverStats]:
        """The output and the correction states as `DeferredState`s: each call builds exactly the graph the
        eager path builds for it (`_states`' choice of start per iteration), from a fresh detached start."""
        mode, stats = BACKWARD_MODES[cfg.b_mode], ctx.stats
        output = DeferredState(lambda: packer.unflatten(mode(g, x_star, ctx)), packer.unflatten(x_star))
        if cfg.jac_reg_samples > 0:  # its graph is built here, at z* (one differentiable f call at a leaf)
            stats.jac_loss = self._jac_loss(g, x_star, ctx)
        kept_plain = stats.extra.get("kept", {})
        states = []
        for k in keep:
            if k < ctx.max_iter and k in kept_plain:
                start = kept_plain[k]
                states.append(DeferredState(
                    lambda start=start: packer.unflatten(
                        phantom_steps(g, start, cfg.correction_k, cfg.correction_tau)),
                    packer.unflatten(start)))
            else:  # the output itself (an iteration at or past the cap, or a solve that ended earlier)
                states.append(output)
        if keep:
            stats.states = states
        return output, stats

    def _without_solve(self, cfg: DEQConfig, g, x0: torch.Tensor, packer: StatePacker,
                       grad: bool) -> tuple[State, SolverStats]:
        """max_iter = 0: no forward solve, z0 taken as z*, one f step from it (see `solve_with`)."""
        variant = cfg.b_mode_kwargs.get("variant", "upg")
        if cfg.b_mode not in ("ift", "jacobian_free") and not (cfg.b_mode == "phantom" and variant == "npg"):
            raise ValueError(
                f"DEQ: max_iter=0 (no forward solve) needs a backward mode whose output is one "
                f"differentiable step f(z0): 'ift', 'jacobian_free' or 'phantom' with variant 'npg'; got "
                f"b_mode={cfg.b_mode!r}" + (f" (variant {variant!r})" if cfg.b_mode == "phantom" else ""))
        if cfg.state_steps(1):
            raise ValueError("DEQ: max_iter=0 (no forward solve) has no solver states for fixed-point "
                             f"correction (n_states={cfg.n_states}, state_indices={cfg.state_indices})")
        if grad:
            ctx = BackwardContext(config=cfg, stats=None, x0=x0, max_iter=0)
            x = BACKWARD_MODES[cfg.b_mode](g, x0.detach(), ctx)
            fx, nfe = ctx.fx_pair[1], 0  # the mode's own f(z0), counted as its refinement step
        else:
            x = fx = g(x0)
            nfe = 1
        with torch.no_grad():
            abs_r = torch.linalg.vector_norm((fx - x0).detach().double(), dim=1)
            rel_r = abs_r / (torch.linalg.vector_norm(fx.detach().double(), dim=1) + 1e-12)
        res = rel_r if cfg.f_stop_mode == "rel" else abs_r
        stats = SolverStats(nfe=nfe, abs_residual=abs_r.to(x0.dtype), rel_residual=rel_r.to(x0.dtype),
                            trace=torch.zeros(0, dtype=torch.float64), converged=(res < cfg.f_tol).cpu(),
                            solver="no_solve", stop_mode=cfg.f_stop_mode, tol=cfg.f_tol)
        if grad:
            ctx.stats = stats
            if cfg.jac_reg_samples > 0:
                stats.jac_loss = self._jac_loss(g, x0, ctx)
        return packer.unflatten(x), stats

    def _jac_loss(self, g, x_star: torch.Tensor, ctx: BackwardContext) -> torch.Tensor:
        if ctx.fx_pair is not None:
            xs, fx = ctx.fx_pair
        else:  # modes without an f call at a leaf z* (phantom UPG, unrolled): one more differentiable call
            xs = x_star.detach().requires_grad_()
            fx = g(xs)
        return jacobian_reg(fx, xs, n_samples=ctx.config.jac_reg_samples)

    def _states(self, g, x: torch.Tensor, ctx: BackwardContext, keep: list[int],
                cfg: DEQConfig) -> list[torch.Tensor]:
        kept_graph = ctx.kept or {}
        kept_plain = ctx.stats.extra.get("kept", {}) if ctx.stats is not None else {}
        out = []
        for k in keep:
            if k >= ctx.max_iter:
                out.append(x)
            elif k in kept_graph:
                out.append(kept_graph[k])
            elif k in kept_plain:
                out.append(phantom_steps(g, kept_plain[k], cfg.correction_k, cfg.correction_tau))
            else:  # a user solver that does not keep states: fall back to the output
                out.append(x)
        return out

    def _report(self, stats: SolverStats, cfg: DEQConfig) -> None:
        mode = cfg.on_nonconvergence
        # compiled, nothing reads the stats' values (a warning or an error would be a host read and a
        # branch on it): the caller reads stats.converged
        if mode == "ignore" or torch.compiler.is_compiling() or stats.all_converged:
            return
        flags = "".join(
            [", non-finite values" if stats.nonfinite else "", ", diverged" if stats.diverged else ""]
        )
        message = f"DEQ forward solve did not converge: {stats.summary()} (tol={stats.tol}{flags})"
        if mode == "raise":
            raise DEQConvergenceError(message, stats)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
