"""Attaching a hypersolver: every DEQ layer is swapped for a `HyperDEQ` (the same config, so backward
modes, `on_nonconvergence` and `deq_stats` keep working) that starts from h_φ(input injection), read by a
forward hook on ``owner.injection_module()``, then solves with the model's settings or HyperAnderson. The
hypersolver is held outside the module tree: the state dict, saving and parameter count do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import DEQ
from ..models.registry import declared_family
from .configuration import USES
from .io import check_compatible
from .modeling import HyperSolver

__all__ = ["CapturingDEQ", "HyperDEQ", "attached_hypersolver", "deq_layers", "injection_of",
           "remove_hypersolver", "set_hypersolver", "state_kind"]


def state_kind(model: nn.Module) -> str:
    """The hypersolver state kind the model's family declares ("vector" when it declares none)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = declared_family(model_type) if isinstance(model_type, str) else None
    return (family.hypersolver_state if family is not None else None) or "vector"


def injection_of(owner: nn.Module) -> nn.Module | None:
    """The module whose output is the input injection, as the DEQ layer's owner names it (none: no h_φ)."""
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


class CapturingDEQ(DEQ):
    """A DEQ layer keeping the injection module's latest output (a forward hook) for its next solve."""

    def __init__(self, config, injection_module: nn.Module | None):
        super().__init__(config)
        self._injection: torch.Tensor | None = None
        self._hook = None
        if injection_module is not None:
            self._hook = injection_module.register_forward_hook(self._capture)

    def _capture(self, _module, _inputs, output) -> None:
        self._injection = output

    def _take_injection(self) -> torch.Tensor | None:
        injection, self._injection = self._injection, None
        return injection

    def detach_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class HyperDEQ(CapturingDEQ):
    """A DEQ layer that solves with a hypersolver (see the module docstring). `config` stays the model's.

    ``use`` is what the hypersolver does (`HyperSolverConfig.use`): "initializer", h_φ's start and then the
    model's own solver settings; "hyperanderson", h_φ's start and the HyperAnderson solver."""

    def __init__(self, config, hypersolver: HyperSolver, injection_module: nn.Module | None, use: str):
        super().__init__(config, injection_module if hypersolver.has_initializer else None)
        self.__dict__["hypersolver"] = hypersolver  # not a submodule: the model's state dict is unchanged
        self.use = use

    def forward(self, f, z0):
        hs: HyperSolver = self.__dict__["hypersolver"]
        injection = self._take_injection()
        tensors = [z0] if isinstance(z0, torch.Tensor) else list(z0)
        shapes = [tuple(t.shape) for t in tensors]  # checked by h_φ and by bind
        if hs.mix1.weight.device != tensors[0].device:  # follow the model (model.to(device) does not see it)
            hs.to(tensors[0].device)
        # h_φ replaces the model's zero initial state; a caller's own z0 (e.g. fixed-point reuse) is kept
        fresh = not any(bool(t.any()) for t in tensors)
        if injection is not None and injection.shape[0] == shapes[0][0] and fresh:
            with torch.no_grad():
                init = hs.initial_state(injection.detach(), shapes)
            z0 = init[0] if isinstance(z0, torch.Tensor) else type(z0)(init)
        if self.use == "initializer":
            return super().forward(f, z0)
        c = hs.config
        # per call, never stored: self.config stays the model's (thread-safe)
        cfg = self.config.update(f_solver="hyperanderson", f_solver_kwargs={
            "net": hs.bind(shapes), "m": c.m, "form": c.form, "base": c.alpha_base})
        return self.solve_with(cfg, f, z0)

    def extra_repr(self) -> str:
        name = self.__dict__["hypersolver"].config.model_id or "?"
        return super().extra_repr() + f", hypersolver={name}, use={self.use}"


def set_hypersolver(model: nn.Module, hypersolver: HyperSolver, *, check: bool = True,
                    use: str | None = None) -> nn.Module:
    """Make every DEQ layer of `model` solve with `hypersolver` (replacing one attached before); with
    ``check`` its recorded fingerprint must be the model's (the error names both); ``use`` overrides its
    config's ("initializer" or "hyperanderson")."""
    if not isinstance(hypersolver, HyperSolver):
        raise TypeError(f"set_hypersolver takes a HyperSolver (or use from_pretrained(..., hypersolver=id)), "
                        f"got {type(hypersolver).__name__}")
    use = hypersolver.config.use if use is None else use
    if use not in USES:
        raise ValueError(f"hypersolver use must be one of {USES}, got {use!r}")
    if use == "initializer" and not hypersolver.has_initializer:
        raise ValueError(f"hypersolver {hypersolver.config.model_id or '?'} has no initializer (injection_"
                         "channels = 0): use='initializer' would change nothing; attach it with "
                         "use='hyperanderson'")
    if check:
        check_compatible(model, hypersolver)
    kind = state_kind(model)
    if kind != hypersolver.config.state_kind:
        raise ValueError(f"hypersolver {hypersolver.config.model_id or '?'} serves "
                         f"{hypersolver.config.state_kind!r} states; model {type(model).__name__} has "
                         f"{kind!r} states")
    if not deq_layers(model):
        raise ValueError(f"{type(model).__name__} has no DEQ layer to attach a hypersolver to")
    remove_hypersolver(model)
    for owner, name, layer in deq_layers(model):
        setattr(owner, name, HyperDEQ(layer.config, hypersolver, injection_of(owner), use))
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
