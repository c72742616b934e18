"""Reversible DEQ (RevDEQ, McCallum, Arora & Foster 2025, arXiv 2509.12917): exact gradients of a fixed number
of coupled fixed-point steps, with memory constant in the number of steps.

The forward replaces the solver by the paper's algebraically reversible coupled iteration, y and z both
starting at z0, with coupling/damping ``beta``::

    y_{n+1} = (1 - beta) y_n + beta f(z_n)
    z_{n+1} = (1 - beta) z_n + beta f(y_{n+1})          n = 0 .. N-1, output z_N

Each step inverts in algebra, so the backward walks the steps in reverse, rebuilding each state instead of
storing it, one f call at a time. The gradient is that of the N-step computation itself (autograd through
the unrolled coupled loop, up to rounding), not an approximation of the implicit gradient.

In floating point a rebuilt state's rounding grows geometrically with the steps undone (each divides by
(1 - beta) twice; numbers in docs/engine.md, "RevDEQ precision"). The forward therefore keeps (z_n, y_n)
every ``segment`` steps (default 4 in float64, 2 otherwise) and the backward rebuilds within one segment,
measuring the rebuilt segment start against the kept one (`_rebuild_error`); above ``rebuild_tol`` (default
1e-10 in float64, 1e-4 otherwise) it redoes the segment on states recomputed forward from the kept start.
``stats.extra["reversible"]`` reports ``rebuild_error``, ``segments`` and ``recomputed_segments``.
``segment=0, rebuild_tol=math.inf`` is the paper's method, memory constant in N.

Select it with ``DEQConfig(b_mode="reversible", f_max_iter=N, b_mode_kwargs={"beta": 0.8})``; f_max_iter is
the number of coupled steps N (f_max_iter_min randomizes it in training); f_solver and f_tol play no part
(f_tol only decides ``stats.converged``). It runs in inference too, with the same N-step map.

Cost (N steps): forward 2N + 1 f calls without a graph (``stats.nfe``); backward 2N f calls with a graph
and 2N vector-Jacobian products, one graph alive at a time; memory: z0 and one (z, y) pair per ``segment``
steps (states, not graphs; unrolled autograd holds 2N graphs). No adaptive stopping: every sample runs N
steps. Prefer it over IFT when gradients must be exact with a loose tolerance or small fixed budget (IFT is
exact only at a converged z*); prefer IFT for many steps or per-sample stopping, phantom / Jacobian-free
when the backward must be cheaper than the forward.

Requirements and limits:
- f must be deterministic across calls within one forward/backward (dropout masks fixed per forward, as
  `deqzoo.core.VariationalDropout` does; batch norm in eval mode), since the backward calls f again.
- ``beta`` in (0, 2), beta != 1 (at 1 the step cannot be inverted); accuracy against autograd is tested in
  tests/gradients/test_gradients_reversible_steps.py.
- double backward (``create_graph=True``) raises a clear error; use b_mode="unrolled" for second order.
- The tensors f depends on are found by recording, during the first f call, the tensors requiring grad that
  f passes to torch operations (a `TorchFunctionMode`); they become inputs of the autograd node. A tensor
  that reaches f only through a custom ``autograd.Function`` is not seen: f must pass its parameters to
  torch operations (every family in the zoo does; tests/gradients checks each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .caps import MAX_ITER
from .stats import SolverStats

DEFAULT_BETA = 0.8
# coupled steps between kept states by state dtype: a rebuilt state carries at most this many steps of
# rounding (mdeq-tiny-mnist-reversible: relative rebuild error 2.6e-12 after 4 float64 steps, 4.6e-6 after 2
# float32 steps, 1.3e-3 after 4; see docs/engine.md)
DEFAULT_SEGMENT = {torch.float64: 4}
DEFAULT_SEGMENT_LOW = 2  # float32 and below
# largest relative error of a rebuilt state before its segment is recomputed, by state dtype (the gradient's
# relative error stayed below the rebuild error in every measurement; docs/engine.md)
DEFAULT_REBUILD_TOL = {torch.float64: 1e-10}
DEFAULT_REBUILD_TOL_LOW = 1e-4  # float32 and below
MAX_SEGMENT = MAX_ITER  # as the step budget itself


def check_beta(beta: Any) -> float:
    """`beta` as a float, or a clear error unless 0 < beta < 2 and beta != 1."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0 < beta < 2) or beta == 1:
        raise ValueError(
            f"DEQConfig.b_mode_kwargs['beta'] (reversible coupling) must be a number in (0, 2) other than 1, "
            f"got {beta!r}"
        )
    return float(beta)


def check_segment(segment: Any) -> int:
    """`segment` (steps between kept states; 0 = only z0), or a clear error."""
    if isinstance(segment, bool) or not isinstance(segment, int) or not 0 <= segment <= MAX_SEGMENT:
        raise ValueError(f"DEQConfig.b_mode_kwargs['segment'] (reversible: coupled steps between kept "
                         f"states, 0 = none) must be an integer in [0, {MAX_SEGMENT}], got {segment!r}")
    return segment


def check_rebuild_tol(tol: Any) -> float:
    """`rebuild_tol` as a float, or a clear error unless it is a number > 0 (math.inf: never recompute)."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
        raise ValueError(f"DEQConfig.b_mode_kwargs['rebuild_tol'] (reversible: largest relative error of a "
                         f"rebuilt state before its segment is recomputed) must be a number > 0, got {tol!r}")
    return float(tol)


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors inside nested tuples/lists/dicts (torch operations take e.g. torch.cat([a, b]))."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


class _GradInputs(TorchFunctionMode):
    """Records the tensors requiring grad that a call hands to torch operations. The call runs under
    no_grad, so every such tensor was made outside it: the parameters and injections f closes over."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, torch.Tensor] = {}
        # tensors made during the call, kept alive so their ids stay unique; a view of a parameter made
        # under no_grad still requires grad, but it is the parameter that f's later calls use
        self.made: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = _tensors(out, [])
        # only operations that compute tensors count: metadata queries (t.data_ptr(), t.shape) do not
        if made:
            for t in _tensors((args, kwargs), []):
                if t.requires_grad and id(t) not in self.found and id(t) not in self.made:
                    self.found[id(t)] = t
            self.made.update((id(t), t) for t in made)
        return out


class _Substitute(TorchFunctionMode):
    """Hands torch operations a detached alias wherever f passes one of the recorded inputs, so that a
    backward step differentiates f's own use of each input and never enters the graph that made it (an
    input computed from another input, e.g. an offset made from a weight f also uses, then counts once:
    the outer graph routes the offset's gradient to the weight)."""

    def __init__(self, aliases: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.aliases = aliases

    def _swap(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.aliases.get(id(obj), obj)
        if isinstance(obj, (tuple, list)):
            return type(obj)(self._swap(item) for item in obj)
        if isinstance(obj, dict):
            return {k: self._swap(v) for k, v in obj.items()}
        return obj

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*self._swap(args), **self._swap(kwargs or {}))


def first_call_inputs(g: Callable[[torch.Tensor], torch.Tensor],
                      x0: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """f(x0) without a graph, and the tensors requiring grad that f used (in first-use order)."""
    recorder, start = _GradInputs(), x0.detach()  # detached outside the recording: x0 is not f's input
    with torch.no_grad(), recorder:
        f0 = g(start)
    return f0, list(recorder.found.values())


def _residuals(z: torch.Tensor, fz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    abs_r = torch.linalg.vector_norm(fz - z, dim=1)
    return abs_r, abs_r / (torch.linalg.vector_norm(fz, dim=1) + 1e-12)


def coupled_forward(g: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, f0: torch.Tensor,
                    steps: int, beta: float, keep_every: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, dict[int, tuple]]:
    """The N coupled steps from z0 = y0 = x0 with f(x0) = f0, without a graph.

    Returns (z_N, y_N, f(z_N), per-step (abs, rel) residuals of z_n, {n: (z_n, y_n)} for n = 0, k, 2k, ...
    below N with k = ``keep_every``; empty when 0)."""
    z, y, fz = x0, x0, f0
    trace = []
    kept = {0: (x0, x0)} if keep_every else {}
    with torch.no_grad():
        for n in range(1, steps + 1):
            y = (1 - beta) * y + beta * fz
            z = (1 - beta) * z + beta * g(y)
            fz = g(z)
            trace.append(_residuals(z, fz))
            if keep_every and n % keep_every == 0 and n < steps:
                kept[n] = (z, y)
    return z, y, fz, trace, kept


def _recompute(g, z: torch.Tensor, y: torch.Tensor, steps: int, beta: float) -> list[tuple]:
    """[(z_n, y_n)] for n = s .. s + steps from (z_s, y_s), by running the coupled steps again (no graph):
    the same operations on the same values as the forward, so the same states."""
    states = [(z, y)]
    with torch.no_grad():
        for _ in range(steps):
            y = (1 - beta) * y + beta * g(z)
            z = (1 - beta) * z + beta * g(y)
            states.append((z, y))
    return states


def _rebuild_error(rebuilt: tuple, stored: tuple, end: tuple) -> float:
    """Largest per-sample ||rebuilt - stored|| / (||stored|| + ||end||) over z and y, where `end` is the
    segment's end state the rebuild started from (the scale its rounding is relative to; finite at a zero
    start)."""
    worst = 0.0
    for a, b, c in zip(rebuilt, stored, end):
        a, b, c = a.double(), b.double(), c.double()
        err = torch.linalg.vector_norm(a - b, dim=1)
        scale = torch.linalg.vector_norm(b, dim=1) + torch.linalg.vector_norm(c, dim=1)
        rel = torch.where(err == 0, torch.zeros_like(err), err / scale.clamp_min(1e-300))
        worst = max(worst, float(rel.max()) if rel.numel() else 0.0)
    return worst


class _Reversible(torch.autograd.Function):
    """z_N of the coupled iteration; backward rebuilds the states in reverse, segment by segment (see the
    module docstring)."""

    @staticmethod
    def forward(ctx, run: dict, x0: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        z, y, _, trace, kept = coupled_forward(run["g"], x0, run["f0"], run["steps"], run["beta"],
                                               run["segment"])
        run["trace"] = trace
        ctx.run = {k: run[k] for k in ("g", "steps", "beta", "segment", "rebuild_tol", "report")}
        ctx.run["inputs"] = inputs
        ctx.y = y  # no graph: a plain state, not an input or output of this node
        ctx.kept = {n: st for n, st in kept.items() if n > 0}  # n = 0 is (x0, x0), saved below
        ctx.save_for_backward(z, x0)
        return z

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "b_mode='reversible' does not support double backward (create_graph=True, Hessian-vector "
                "products): its backward rebuilds states without a graph. Use b_mode='unrolled' with the "
                "same f_max_iter for second-order derivatives of the same computation."
            )
        g, steps, beta, inputs = (ctx.run[k] for k in ("g", "steps", "beta", "inputs"))
        segment, tol, report = ctx.run["segment"], ctx.run["rebuild_tol"], ctx.run["report"]
        z, x0 = ctx.saved_tensors
        y = ctx.y
        x0 = x0.detach()
        need = [t for t, n in zip(inputs, ctx.needs_input_grad[2:]) if n]
        aliases = {id(t): t.detach().requires_grad_() for t in need}
        swap = _Substitute(aliases)
        leaves = list(aliases.values())
        acc: list[torch.Tensor | None] = [None] * len(need)
        gz, gy = grad_z, torch.zeros_like(y)

        def vjp(state: torch.Tensor, cotangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """f(state) (value) and the state's cotangent; the inputs' cotangents are added to acc."""
            with torch.enable_grad():
                leaf = state.detach().requires_grad_()
                with swap:
                    out = g(leaf)
                grads = torch.autograd.grad(out, [leaf, *leaves], cotangent, allow_unused=True)
            for i, gi in enumerate(grads[1:]):
                if gi is not None:
                    acc[i] = gi if acc[i] is None else acc[i] + gi
            g_state = grads[0] if grads[0] is not None else torch.zeros_like(state)
            return out.detach(), g_state

        def reverse(z, y, gz, gy, length, start, exact):
            """Walk `length` coupled steps back from (z, y), the segment's end state. Each earlier state
            is rebuilt algebraically (exact None) or read from `exact` (the segment's recomputed states);
            the first state of the segment is the stored `start` either way (a rebuilt one would carry
            the segment's rounding into f, at z0 = 0 too where normalisations amplify it most). Returns
            the cotangents at the start and the rebuilt start (None when exact)."""
            rebuilt_z = rebuilt_y = None
            for j in range(length, 0, -1):
                # undo z_n = (1 - beta) z_{n-1} + beta f(y_n)
                fy, dy = vjp(y, beta * gz)
                if exact is not None:
                    z = exact[j - 1][0]
                else:
                    z = (z - beta * fy) / (1 - beta)
                    if j == 1:
                        rebuilt_z, z = z, start[0]
                gy = gy + dy
                gz = (1 - beta) * gz
                # undo y_n = (1 - beta) y_{n-1} + beta f(z_{n-1})
                fz, dz = vjp(z, beta * gy)
                if exact is not None:
                    y = exact[j - 1][1]
                else:
                    y = (y - beta * fz) / (1 - beta)
                    if j == 1:
                        rebuilt_y, y = y, start[1]
                gz = gz + dz
                gy = (1 - beta) * gy
            return gz, gy, (None if exact is not None else (rebuilt_z, rebuilt_y))

        # segments [s, e) between stored states, last first; each ends on its own stored start state, so
        # rounding grows over one segment's steps at most, never over all N
        starts = [0, *sorted(ctx.kept)]
        worst, recomputed = 0.0, 0
        for s in reversed(starts):
            e = min(s + segment, steps) if segment else steps
            start = (x0, x0) if s == 0 else ctx.kept[s]
            snapshot = (gz, gy, list(acc))
            gz_s, gy_s, rebuilt = reverse(z, y, gz, gy, e - s, start, None)
            err = _rebuild_error(rebuilt, start, (z, y))
            worst = max(worst, err)
            if not err <= tol:  # NaN included: redo the segment on recomputed states (exact to rounding)
                gz, gy, acc[:] = snapshot[0], snapshot[1], snapshot[2]
                gz_s, gy_s, _ = reverse(z, y, gz, gy, e - s, start, _recompute(g, *start, e - s, beta))
                recomputed += 1
            gz, gy = gz_s, gy_s
            z, y = start
        report.update(rebuild_error=worst, recomputed_segments=recomputed, segments=len(starts))
        it = iter(acc)
        grads_in = [next(it) if n else None for n in ctx.needs_input_grad[2:]]
        # z_0 = y_0 = x0: both cotangents reach the initial state
        return None, (gz + gy) if ctx.needs_input_grad[1] else None, *grads_in


def default_segment(dtype: torch.dtype) -> int:
    """The default ``segment`` for a state dtype (4 in float64, 2 otherwise)."""
    return DEFAULT_SEGMENT.get(dtype, DEFAULT_SEGMENT_LOW)


def rebuild_tolerance(dtype: torch.dtype) -> float:
    """The default ``rebuild_tol`` for a state dtype (1e-10 in float64, 1e-4 otherwise)."""
    return DEFAULT_REBUILD_TOL.get(dtype, DEFAULT_REBUILD_TOL_LOW)


def reversible_solve(g: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, steps: int, beta: float,
                     tol: float, stop_mode: str, segment: int | None = None,
                     rebuild_tol: float | None = None) -> tuple[torch.Tensor, SolverStats]:
    """The coupled iteration on flat (B, D) states: z_N with the reversible gradient when autograd is on,
    and its statistics (nfe = 2N + 1; residuals of z_N from f(z_N); trace: per-step max residual).

    ``segment`` k: the forward keeps (z_n, y_n) every k steps (0: only z0; None: `default_segment` of x0's
    dtype), the backward rebuilds states within a segment only; ``rebuild_tol``: a segment whose rebuilt
    start differs from the kept one by more (relative, `_rebuild_error`) is redone on recomputed states
    (None: `rebuild_tolerance` of x0's dtype).
    After the backward, ``stats.extra["reversible"]`` holds ``rebuild_error`` (the largest measured),
    ``segments`` and ``recomputed_segments``."""
    beta = check_beta(beta)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"reversible: the number of coupled steps (f_max_iter) must be an integer >= 1, "
                         f"got {steps!r}")
    segment = default_segment(x0.dtype) if segment is None else check_segment(segment)
    rebuild_tol = rebuild_tolerance(x0.dtype) if rebuild_tol is None else check_rebuild_tol(rebuild_tol)
    report: dict[str, Any] = {"steps": steps, "beta": beta, "segment": segment, "rebuild_tol": rebuild_tol}
    if torch.is_grad_enabled():
        f0, inputs = first_call_inputs(g, x0)
        run = {"g": g, "f0": f0, "steps": steps, "beta": beta, "segment": segment,
               "rebuild_tol": rebuild_tol, "report": report}
        z = _Reversible.apply(run, x0, *inputs)
        trace = run["trace"]
    else:
        f0 = g(x0)
        z, _, _, trace, _ = coupled_forward(g, x0, f0, steps, beta)
    abs_r, rel_r = trace[-1]
    res = rel_r if stop_mode == "rel" else abs_r
    per_step = torch.stack([(r if stop_mode == "rel" else a).amax() for a, r in trace]).double().cpu()
    stats = SolverStats(nfe=2 * steps + 1, abs_residual=abs_r, rel_residual=rel_r, trace=per_step,
                        converged=(res < tol).cpu(), solver="reversible", stop_mode=stop_mode, tol=tol,
                        nonfinite=not bool(torch.isfinite(res).all()))
    stats.extra["reversible"] = report  # the backward adds what it measured
    return z, stats


def reversible_mode(g, x_star, ctx) -> torch.Tensor:
    """Backward mode "reversible" (registered in deqzoo.core.backward): runs instead of the forward solve,
    with or without autograd, for ctx.max_iter coupled steps; options ``beta`` (default 0.8), ``segment``
    (default by dtype) and ``rebuild_tol`` (default by dtype), see `reversible_solve`."""
    kw = ctx.config.b_mode_kwargs
    z, ctx.stats = reversible_solve(g, ctx.x0, ctx.max_iter, kw.get("beta", DEFAULT_BETA), ctx.config.f_tol,
                                    ctx.config.f_stop_mode, kw.get("segment"), kw.get("rebuild_tol"))
    return z


reversible_mode.needs_solve = False  # the mode runs the forward computation itself ...
reversible_mode.replaces_solve = True  # ... in inference too: the model is the N-step map it was trained as
