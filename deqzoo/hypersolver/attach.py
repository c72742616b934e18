"""Attaching a hypersolver to a zoo model: every DEQ layer of the model solves with HyperAnderson, starting
from h_φ(input injection).

The model files stay untouched: the DEQ layer is swapped for a `HyperDEQ` (a DEQ with the same config, so
every backward mode, `on_nonconvergence` and `deq_stats` keep working), and the input injection is read by a
forward hook on the module the DEQ layer's owner names (``owner.injection_module()``); the state kind comes
from the family's declaration (`deqzoo.models.registry`). The hypersolver is held outside the model's module
tree, so the model's state dict, saving and parameter count do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..core import DEQ
from ..core.state import StatePacker
from .configuration import HyperSolverConfig
from .modeling import HyperSolver

__all__ = [
    "HyperDEQ",
    "default_config",
    "deq_layers",
    "family_of",
    "record_problems",
    "remove_hypersolver",
    "set_hypersolver",
]


def family_of(model: nn.Module) -> tuple[str, Callable[[nn.Module], nn.Module] | None]:
    """(state kind, owner -> injection module or None) of a model: the kind its family declares ("vector" when
    it declares none), the injection through the owner's `injection_module()` method."""
    from ..models.registry import declared_family

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = declared_family(model_type) if isinstance(model_type, str) else None
    kind = (family.hypersolver_state if family is not None else None) or "vector"
    return kind, _injection_of


def _injection_of(owner: nn.Module) -> nn.Module | None:
    method = getattr(owner, "injection_module", None)
    return method() if callable(method) else None


def deq_layers(model: nn.Module) -> list[tuple[nn.Module, str, DEQ]]:
    """(owner, attribute name, DEQ layer) for every DEQ layer of the model."""
    found = []
    for owner in model.modules():
        for name, child in owner.named_children():
            if isinstance(child, DEQ):
                found.append((owner, name, child))
    return found


def default_config(model: nn.Module, model_id: str, **overrides) -> HyperSolverConfig:
    """A hypersolver config sized for `model` (state kind, channels, injection width from its config)."""
    from .io import model_fingerprint

    kind, _ = family_of(model)
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


class HyperDEQ(DEQ):
    """A DEQ layer that solves with a hypersolver (see the module docstring). `config` stays the model's."""

    def __init__(self, config, hypersolver: HyperSolver, injection_module: nn.Module | None):
        super().__init__(config)
        self.__dict__["hypersolver"] = hypersolver  # not a submodule: the model's state dict is unchanged
        self._injection: torch.Tensor | None = None
        self._hook = None
        if injection_module is not None and hypersolver.has_initializer:
            self._hook = injection_module.register_forward_hook(self._capture)

    def _capture(self, _module, _inputs, output) -> None:
        self._injection = output

    def detach_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def forward(self, f, z0):
        hs: HyperSolver = self.__dict__["hypersolver"]
        injection, self._injection = self._injection, None
        tensors = [z0] if isinstance(z0, torch.Tensor) else list(z0)
        shapes = [tuple(t.shape) for t in tensors]
        hs.check_shapes(shapes)
        if hs.mix1.weight.device != tensors[0].device:  # follow the model (model.to(device) does not see it)
            hs.to(tensors[0].device)
        # h_φ replaces the model's zero initial state; a caller's own z0 (e.g. fixed-point reuse) is kept
        if (
            injection is not None
            and hs.has_initializer
            and injection.shape[0] == shapes[0][0]
            and not any(bool(t.any()) for t in tensors)
        ):
            with torch.no_grad():
                init = hs.initial_state(injection.detach(), shapes)
            z0 = init[0] if isinstance(z0, torch.Tensor) else type(z0)(init)
        c = hs.config
        cfg = self.config.update(  # per call, never stored: self.config stays the model's (thread-safe)
            f_solver="hyperanderson",
            f_solver_kwargs={"net": hs.bind(shapes), "m": c.m, "form": c.form, "base": c.alpha_base},
        )
        return self.solve_with(cfg, f, z0)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hypersolver={self.__dict__['hypersolver'].config.model_id or '?'}"


def set_hypersolver(model: nn.Module, hypersolver: HyperSolver, *, check: bool = True) -> nn.Module:
    """Make every DEQ layer of `model` solve with `hypersolver` (replacing one attached before).

    With ``check`` the hypersolver's recorded model fingerprint must equal the model's
    (`deqzoo.hypersolver.model_fingerprint`); a mismatch is an error naming both.
    """
    from .io import check_compatible

    if not isinstance(hypersolver, HyperSolver):
        raise TypeError(
            f"set_hypersolver takes a HyperSolver (or use from_pretrained(..., hypersolver=id)), "
            f"got {type(hypersolver).__name__}"
        )
    if check:
        check_compatible(model, hypersolver)
    kind, injection_of = family_of(model)
    if kind != hypersolver.config.state_kind:
        raise ValueError(
            f"hypersolver {hypersolver.config.model_id or '?'} serves {hypersolver.config.state_kind!r}"
            f" states; model {type(model).__name__} has {kind!r} states"
        )
    layers = deq_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no DEQ layer to attach a hypersolver to")
    remove_hypersolver(model)
    for owner, name, layer in deq_layers(model):
        inj = injection_of(owner)
        setattr(owner, name, HyperDEQ(layer.config, hypersolver, inj))
    return model


def remove_hypersolver(model: nn.Module) -> nn.Module:
    """Back to the model's own solver settings (`config.deq`); a no-op without a hypersolver."""
    for owner, name, layer in deq_layers(model):
        if isinstance(layer, HyperDEQ):
            layer.detach_hook()
            setattr(owner, name, DEQ(layer.config))
    return model


def attached_hypersolver(model: nn.Module) -> HyperSolver | None:
    for _, _, layer in deq_layers(model):
        if isinstance(layer, HyperDEQ):
            return layer.__dict__["hypersolver"]
    return None


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


class _Recorder(DEQ):
    def __init__(self, config, sink: list, injection_module: nn.Module | None, solve: Callable | None):
        super().__init__(config)
        self.__dict__["sink"] = sink
        self.__dict__["solve_fn"] = solve
        self._injection = None
        self._hook = injection_module.register_forward_hook(self._capture) if injection_module else None

    def _capture(self, _module, _inputs, output) -> None:
        self._injection = output

    def forward(self, f, z0):
        packer = StatePacker(z0)
        p = Problem(
            g=packer.wrap(f),
            packer=packer,
            injection=None if self._injection is None else self._injection.detach(),
            x0=packer.flatten(z0).detach(),
        )
        self._injection = None
        solve = self.__dict__["solve_fn"]
        if solve is not None:
            p.x_star, p.stats = solve(p)
            self.__dict__["sink"].append(p)
            return packer.unflatten(p.x_star), p.stats
        self.__dict__["sink"].append(p)
        return super().forward(f, z0)


@contextlib.contextmanager
def record_problems(model: nn.Module, solve: Callable | None = None) -> Iterator[list[Problem]]:
    """Within the block, every DEQ solve of `model` is recorded as a `Problem` into the yielded list. With
    `solve(problem) -> (x_star, stats)` the recorder solves it that way (e.g. a long classic solve for the
    ground truth) and the model continues from that answer (no gradient)."""
    sink: list[Problem] = []
    _, injection_of = family_of(model)
    saved = []
    for owner, name, layer in deq_layers(model):
        inj = injection_of(owner)
        rec = _Recorder(layer.config, sink, inj, solve)
        saved.append((owner, name, layer, rec))
        setattr(owner, name, rec)
    try:
        yield sink
    finally:
        for owner, name, layer, rec in saved:
            if rec._hook is not None:
                rec._hook.remove()
            setattr(owner, name, layer)
