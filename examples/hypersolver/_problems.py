"""Training tools for hypersolvers (used by train.py, initializer_capacity.py, benchmarks/hypersolver.py and
the tests): the fixed-point problems a model solves, recorded (`record_problems`); h_φ's start on one
(`initial_flat`); a config sized for a model (`default_config`); and the differentiable HyperAnderson unroll
that trains s_ξ (`unroll`, taking the solver's own step, `deqzoo.core.hyper.step`). Repository code, not
part of the installed package: a hypersolver is used by attaching it (`deqzoo.hypersolver`), not trained
there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from deqzoo.core.hyper import HyperNet, step
from deqzoo.core.state import StatePacker
from deqzoo.hypersolver import HyperSolver, HyperSolverConfig, model_fingerprint
from deqzoo.hypersolver.attach import CapturingDEQ, deq_layers, injection_of, state_kind

__all__ = ["Problem", "UnrollStep", "default_config", "initial_flat", "record_problems", "unroll"]


def default_config(model: nn.Module, model_id: str, **overrides) -> HyperSolverConfig:
    """A hypersolver config sized for `model` (state kind, channels, injection width from its config)."""
    kind = state_kind(model)
    cfg = model.config
    if kind == "multires":
        base = dict(
            state_kind=kind,
            state_channels=list(cfg.branch_channels),
            injection_channels=int(cfg.branch_channels[0]),
            pool=1,
            mix_hidden=8,
        )
    elif kind == "sequence":
        base = dict(
            state_kind=kind,
            state_channels=[int(cfg.d_model)],
            injection_channels=3 * int(cfg.n_head) * int(cfg.d_head),
            init_hidden=6,
            mix_hidden=8,
        )
    else:
        raise ValueError(f"no default hypersolver for model type {getattr(cfg, 'model_type', '?')!r}")
    base.update(model_id=model_id, model_fingerprint=model_fingerprint(model))
    base.update(overrides)
    return HyperSolverConfig(**base)


@dataclass
class Problem:
    """One captured fixed-point problem: f on flat states, the packer, the injection and the model's z0."""

    g: Callable[[torch.Tensor], torch.Tensor]
    packer: StatePacker
    injection: torch.Tensor | None
    x0: torch.Tensor
    x_star: torch.Tensor | None = None
    stats: object | None = None


def initial_flat(hs: HyperSolver, p: Problem) -> torch.Tensor:
    """h_φ(injection) for a recorded problem, flat (B, D) like its x0."""
    init = hs.initial_state(p.injection, p.packer.shapes)
    return p.packer.flatten(init[0] if p.packer.is_tensor else init)


class _Recorder(CapturingDEQ):
    def __init__(self, config, sink: list, injection_module: nn.Module | None, solve: Callable | None):
        super().__init__(config, injection_module)
        self.__dict__["sink"] = sink
        self.__dict__["solve_fn"] = solve

    def forward(self, f, z0):
        packer = StatePacker(z0)
        injection = self._take_injection()
        p = Problem(
            g=packer.wrap(f),
            packer=packer,
            injection=None if injection is None else injection.detach(),
            x0=packer.flatten(z0).detach(),
        )
        self.__dict__["sink"].append(p)
        solve = self.__dict__["solve_fn"]
        if solve is None:
            return super().forward(f, z0)
        p.x_star, p.stats = solve(p)
        return packer.unflatten(p.x_star), p.stats


@contextlib.contextmanager
def record_problems(model: nn.Module, solve: Callable | None = None) -> Iterator[list[Problem]]:
    """Within the block, every DEQ solve of `model` is recorded as a `Problem` into the yielded list. With
    `solve(problem) -> (x_star, stats)` the recorder solves it that way (e.g. a long classic solve for the
    ground truth) and the model continues from that answer (no gradient)."""
    sink: list[Problem] = []
    saved = []
    for owner, name, layer in deq_layers(model):
        rec = _Recorder(layer.config, sink, injection_of(owner), solve)
        saved.append((owner, name, layer, rec))
        setattr(owner, name, rec)
    try:
        yield sink
    finally:
        for owner, name, layer, rec in saved:
            rec.detach_hook()
            setattr(owner, name, layer)


@dataclass
class UnrollStep:
    """One differentiable step of `unroll`: the iterate x_k, its residual g_k = f(x_k) - x_k, and the
    normalized weights α (B, n) and window residuals G (B, n, D) that produced x_{k+1}."""

    x: torch.Tensor
    g: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    G: torch.Tensor


def unroll(
    g: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    net: HyperNet,
    steps: int,
    *,
    m: int = 5,
    form: str = "anderson",
    base: str = "none",
) -> tuple[list[UnrollStep], torch.Tensor]:
    """`steps` HyperAnderson steps with autograd (for training the network by backpropagation through the
    unrolled solve): the same update as the solver, on plain lists. Returns the per-step records and the
    final iterate x_steps (x_0 = x0; f is evaluated at x_0 .. x_{steps-1}).

    Example:
        >>> import torch
        >>> from deqzoo.core.hyper import MeanPoolNet
        >>> recs, x = unroll(lambda z: 0.5 * z + 1, torch.zeros(2, 3), MeanPoolNet(), 3, m=1)
        >>> len(recs), x.shape
        (3, torch.Size([2, 3]))
    """
    xs: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    cs: list[torch.Tensor] = []
    records: list[UnrollStep] = []
    x = x0
    for _ in range(steps):
        gx = g(x) - x
        xs, gs, cs = (xs + [x])[-(m + 1) :], (gs + [gx])[-(m + 1) :], (cs + [net.compress(gx)])[-(m + 1) :]
        X, G = torch.stack(xs, 1), torch.stack(gs, 1)
        H = torch.bmm(G, G.transpose(1, 2)) if base == "anderson" else None
        order = torch.arange(len(xs), device=x.device)  # the lists are oldest first
        x_next, alpha, beta = step(net, X, G, torch.stack(cs, 1), order, form, H)
        records.append(UnrollStep(x=x, g=gx, alpha=alpha, beta=beta, G=G))
        x = x_next
    return records, x
