"""Backward modes: how gradients reach f's parameters and inputs from the fixed point, registered by name.

A mode is ``fn(g, x_star, ctx) -> x``: ``g`` is f on flat (B, D) states (autograd enabled), ``x_star`` the
forward solution (no graph), ``ctx`` a `BackwardContext`. The returned ``x`` carries the gradient graph and
equals the fixed point up to the solver's tolerance: hook-based modes (ift, shine, phantom NPG) and
jacobian_free return f(z*) (one refinement step), phantom UPG returns its k damped steps from z*, unrolled
returns the last unrolled iterate. A mode with the attribute ``needs_solve = False`` (unrolled) runs instead
of the forward solve and stores its statistics in ``ctx.stats``.

Options come from ``DEQConfig.b_mode_kwargs``:
- ``ift``: none (the adjoint y = J_fᵀ y + grad is solved by ``b_solver`` with ``b_max_iter``, ``b_tol``...).
- ``phantom``: ``k`` (steps, default 5), ``tau`` (damping in (0, 1], default 0.5), ``variant`` ("upg" =
  unrolled damped steps, "npg" = truncated damped Neumann series of the adjoint; Geng et al., 2021).
- ``shine``: ``refine`` (default 0): extra ``b_solver`` steps started from the SHINE estimate.
- ``unrolled``: ``checkpoint`` (default 0 = off; n = recompute segments of n steps in backward).
- ``truncated``: ``k`` (default 1), ``supervise`` (default False): not IFT. The gradient of the last k plain
  steps f from the detached forward answer (HRM/TRM's 1-step gradient at k = 1); with ``supervise=True``
  the k states are also returned in ``stats.extra["supervised_states"]`` (oldest first, each with its
  graph) for a loss on each (deep supervision). ``stats.extra["gradient"]`` names the approximation.
- ``reversible``: ``beta`` (coupling in (0, 2), not 1; default 0.8), ``segment`` (steps between kept states)
  and ``rebuild_tol`` (recompute threshold): f_max_iter coupled reversible steps replace the forward solve,
  with exact gradients holding states every ``segment`` steps, no graphs (deqzoo.core.reversible).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .caps import check_gmres_memory
from .solvers import get_solver
from .solvers._contract import _Tracker
from .stats import SolverStats

BACKWARD_MODES: dict[str, Callable] = {}

# accepted b_mode_kwargs per built-in mode (validated by DEQConfig)
MODE_KWARGS: dict[str, set[str]] = {
    "ift": set(),
    "jacobian_free": set(),
    "phantom": {"k", "tau", "variant"},
    "shine": {"refine"},
    "unrolled": {"checkpoint"},
    "truncated": {"k", "supervise"},
}


def register_backward(name: str, kwargs: set[str] | None = None):
    """Register a backward mode under `name` (decorator); `kwargs` names its accepted b_mode_kwargs
    (None = anything)."""

    def deco(fn):
        BACKWARD_MODES[name] = fn
        if kwargs is not None:
            MODE_KWARGS[name] = set(kwargs)
        return fn

    return deco


@dataclass
class BackwardContext:
    """What a backward mode may read (config, forward stats, initial state) and leave behind.

    Attributes:
        config: the DEQConfig.
        stats: forward-solve statistics (SHINE reads stats.extra["inverse_jacobian"]); unrolled sets it.
        x0: the flat initial state (may carry a graph).
        max_iter: this forward's f_max_iter (after randomization).
        keep_steps: iterations whose states fixed-point correction wants (unrolled fills ``kept``).
        fx_pair: (x, f(x)) at the fixed point with x a leaf, if the mode built one (reused for the Jacobian
            regularizer instead of another f call).
        kept: {iteration: state with graph}, set by modes that produce correction states themselves.
    """

    config: Any
    stats: SolverStats | None
    x0: torch.Tensor
    max_iter: int
    keep_steps: list[int] = field(default_factory=list)
    fx_pair: tuple[torch.Tensor, torch.Tensor] | None = None
    kept: dict[int, torch.Tensor] | None = None


def _adjoint_hook(g, x_star: torch.Tensor, ctx: BackwardContext, adjoint: Callable) -> torch.Tensor:
    """fx = f(z*) whose incoming gradient `grad` is replaced by adjoint(vjp, grad) during backward."""
    x = x_star.detach().requires_grad_()
    fx = g(x)
    ctx.fx_pair = (x, fx)
    busy = False

    def hook(grad: torch.Tensor) -> torch.Tensor:
        nonlocal busy
        if busy:  # the vector-Jacobian products below flow through fx as well
            return grad
        if torch.is_grad_enabled():  # create_graph=True: the adjoint below is solved without a graph
            raise RuntimeError(
                f"b_mode={ctx.config.b_mode!r} does not support double backward (create_graph=True, "
                "Hessian-vector products): its adjoint is solved without a graph, so the product would be "
                "silently wrong. Use b_mode='unrolled' for second-order derivatives")
        busy = True
        try:

            def vjp(y: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(fx, x, y, retain_graph=True)[0]

            return adjoint(vjp, grad.detach())
        finally:
            busy = False

    # The hook sits on a view of fx, not on fx: tensor hooks live in C++, where Python's cycle collector
    # cannot
    # see them, so a hook on fx whose closure holds fx would keep every step's graph alive forever.
    out = fx.view_as(fx)
    out.register_hook(hook)
    return out


def _solve_adjoint(vjp, grad: torch.Tensor, y0: torch.Tensor, ctx: BackwardContext, max_iter: int
) -> torch.Tensor:
    cfg = ctx.config
    if cfg.b_solver == "gmres":  # its basis grows with the budget: refused before any allocation
        check_gmres_memory("b_max_iter", max_iter, y0)
    with torch.no_grad():
        y, bstats = get_solver(cfg.b_solver)(lambda y: vjp(y) + grad, y0, max_iter=max_iter, tol=cfg.b_tol,
                                             stop_mode=cfg.b_stop_mode, **cfg.b_solver_kwargs)
    if ctx.stats is not None:
        ctx.stats.extra["backward"] = bstats
    return y


@register_backward("ift")
def ift(g, x_star, ctx: BackwardContext):
    """Implicit differentiation: the incoming gradient g is replaced by y solving y = J_fᵀ y + g."""
    return _adjoint_hook(g, x_star, ctx,
                         lambda vjp, grad: _solve_adjoint(vjp, grad, grad, ctx, ctx.config.b_max_iter))


@register_backward("jacobian_free")
def jacobian_free(g, x_star, ctx: BackwardContext):
    """Jacobian-free backprop (Fung et al., 2022): one differentiable step f(z*), the adjoint taken as I."""
    x = x_star.detach().requires_grad_()
    fx = g(x)
    ctx.fx_pair = (x, fx)
    return fx


def phantom_steps(g, x_start: torch.Tensor, k: int, tau: float) -> torch.Tensor:
    """k damped steps z <- (1 - tau) z + tau f(z) from a detached start, with graph (phantom UPG)."""
    z = x_start.detach()
    for _ in range(k):
        fz = g(z)
        z = fz if tau == 1.0 else torch.lerp(z, fz, tau)
    return z


@register_backward("phantom")
def phantom(g, x_star, ctx: BackwardContext):
    """Phantom gradients (Geng et al., 2021): UPG unrolls k damped steps from z*; NPG replaces the adjoint
    (I - J)^{-T} grad by tau · Σ_{i<k} ((1 - tau) I + tau Jᵀ)^i grad, a truncated damped Neumann series."""
    kw = ctx.config.b_mode_kwargs
    k, tau, variant = int(kw.get("k", 5)), float(kw.get("tau", 0.5)), kw.get("variant", "upg")
    if variant == "upg":
        return phantom_steps(g, x_star, k, tau)

    def neumann(vjp, grad):
        with torch.no_grad():
            v, acc = grad, grad
            for _ in range(k - 1):
                v = vjp(v) if tau == 1.0 else torch.lerp(v, vjp(v), tau)
                acc = acc + v  # never in place: acc starts as the incoming gradient itself
            # tau = 1 (Implicit²'s NPG) skips the identity lerp and scaling: three full-size passes per step
            return acc if tau == 1.0 else acc * tau

    return _adjoint_hook(g, x_star, ctx, neumann)


@register_backward("truncated")
def truncated(g, x_star, ctx: BackwardContext):
    """Truncated backpropagation, not implicit differentiation: k differentiable steps of f from the detached
    forward answer; the gradient is that of the last k steps only (deep-supervision style)."""
    kw = ctx.config.b_mode_kwargs
    k, supervise = int(kw.get("k", 1)), bool(kw.get("supervise", False))
    z, states = x_star.detach(), []
    for _ in range(k):
        z = g(z)
        states.append(z)
    if ctx.stats is not None:
        ctx.stats.extra["gradient"] = f"truncated: last {k} step(s) backpropagated (not IFT)"
        if supervise:
            ctx.stats.extra["supervised_states"] = states
    return z


@register_backward("shine")
def shine(g, x_star, ctx: BackwardContext):
    """SHINE (Ramzi et al., 2022): the adjoint from the forward Broyden inverse-Jacobian estimate,
    y = -Bᵀ grad, optionally refined by `refine` steps of b_solver started from it."""
    inv = ctx.stats.extra.get("inverse_jacobian") if ctx.stats is not None else None
    if inv is None:
        raise RuntimeError(
            f"b_mode='shine' needs a forward solver that returns an inverse-Jacobian estimate "
            f"(broyden); f_solver={ctx.config.f_solver!r} did not"
        )
    refine = int(ctx.config.b_mode_kwargs.get("refine", 0))

    def adjoint(vjp, grad):
        with torch.no_grad():
            y = -inv.rmatvec(grad)
        return _solve_adjoint(vjp, grad, y, ctx, refine) if refine > 0 else y

    return _adjoint_hook(g, x_star, ctx, adjoint)


def _unrolled_segment(g, n: int):
    def run(z):
        prev = z
        for _ in range(n):
            prev, z = z, g(z)
        return prev, z

    return run


@register_backward("unrolled")
def unrolled(g, x_star, ctx: BackwardContext):
    """Backpropagation through up to f_max_iter fixed-point steps from z0 (memory grows with the steps).
    `checkpoint=n` recomputes each segment of n steps in backward instead of storing it. Stops early once
    every sample's residual is below f_tol; the statistics are those of the last iterate f was applied to."""
    cfg = ctx.config
    seg = int(cfg.b_mode_kwargs.get("checkpoint", 0)) or 1
    use_ckpt = int(cfg.b_mode_kwargs.get("checkpoint", 0)) > 0
    x0 = ctx.x0
    tracker = _Tracker(x0.detach(), ctx.max_iter, cfg.f_tol, cfg.f_stop_mode, "unrolled")
    bounds = sorted(
        {min(s, ctx.max_iter) for s in range(seg, ctx.max_iter + seg, seg)}
        | {s for s in ctx.keep_steps if s < ctx.max_iter}
    )
    z, done, kept = x0, 0, {}
    last_abs = last_rel = None
    for end in bounds:
        run = _unrolled_segment(g, end - done)
        prev, z = checkpoint(run, z, use_reentrant=False) if use_ckpt else run(z)
        done = end
        with torch.no_grad():
            pd, zd = prev.detach(), z.detach()
            last_abs = torch.linalg.vector_norm(zd - pd, dim=1)
            last_rel = last_abs / (torch.linalg.vector_norm(zd, dim=1) + 1e-12)
            tracker.update(pd, zd, last_abs)
        if end in ctx.keep_steps:
            kept[end] = z
        if tracker.done:  # every sample stopped (converged, non-finite or diverged)
            break
    stats = tracker.stats(done)
    stats.abs_residual, stats.rel_residual = last_abs, last_rel
    stats.converged = stats.residual < cfg.f_tol
    ctx.stats, ctx.kept = stats, kept
    return z


unrolled.needs_solve = False


def neumann_backward(terms: float) -> dict[str, Any]:
    """DEQConfig fields for a Neumann phantom gradient with `terms` extra terms (Implicit²'s NPG with T
    terms):
    the adjoint (I - Jᵀ)^{-1} g approximated by Σ_{i=0..T} (Jᵀ)^i g. T = 0 is Jacobian-free backprop,
    T = math.inf is implicit differentiation (IFT), T = 1 is Implicit²'s default (one extra term).

    Example:
        >>> from deqzoo.core import DEQConfig, neumann_backward
        >>> DEQConfig(**neumann_backward(1)).b_mode_kwargs
        {'k': 2, 'tau': 1.0, 'variant': 'npg'}
    """
    if terms == float("inf"):
        return {"b_mode": "ift", "b_mode_kwargs": {}}
    if isinstance(terms, bool) or not float(terms).is_integer() or terms < 0:
        raise ValueError(f"neumann_backward: terms must be an integer >= 0 or math.inf, got {terms!r}")
    if terms == 0:
        return {"b_mode": "jacobian_free", "b_mode_kwargs": {}}
    return {"b_mode": "phantom", "b_mode_kwargs": {"k": int(terms) + 1, "tau": 1.0, "variant": "npg"}}


def backward_in_stages(shared: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor],
                       terms: Iterable[Callable[[], torch.Tensor]]) -> torch.Tensor | None:
    """Backpropagate a sum of loss terms sharing an expensive prefix, one term's graph alive at a time.

    `shared` are the prefix's outputs (with their graph), `leaves` the same values detached into leaves that
    require grad, and each term builds its loss from the leaves when called (e.g. `DeferredState` losses).
    Each term is built, backpropagated and freed in turn while the leaves collect its gradient; then the
    collected gradients go back through the prefix once. Gradients equal ``sum(terms).backward()`` to
    rounding; the peak holds the prefix's graph and one term's graph instead of every term's. Returns the
    total loss (detached), or None without terms.

    Example:
        >>> import torch
        >>> w = torch.tensor(2.0, requires_grad=True)
        >>> h = w * 3                              # the shared prefix
        >>> leaf = h.detach().requires_grad_()
        >>> backward_in_stages([h], [leaf], [lambda: leaf ** 2, lambda: 5 * leaf])
        tensor(66.)
        >>> w.grad                                 # d/dw ((3w)^2 + 15w) = 18w + 15
        tensor(51.)
    """
    total = None
    for term in terms:
        loss = term()
        # retain_graph: parts built once and shared by every term (not under the leaves, e.g.
        # weight-normalised weights) stay for the next term; this term's own graph is freed with `loss`
        loss.backward(retain_graph=True)
        total = loss.detach() if total is None else total + loss.detach()
        del loss
    pairs = [(t, leaf.grad) for t, leaf in zip(shared, leaves) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return total



# b_mode="reversible" (RevDEQ): the algorithm lives in deqzoo.core.reversible
from .reversible import reversible_mode  # noqa: E402

register_backward("reversible", {"beta", "segment", "rebuild_tol"})(reversible_mode)
