"""Weight normalization and spectral normalization of f_θ's weights, registered by name.

A DEQ calls f many times per forward with the same weights, so the normalized weight is computed once per
forward by `reset_norm(model)` (call it at the start of the forward, before the solve) and reused by every f
call; recomputing it inside each f call would store one copy of the reparametrization graph per call.

Parameter names follow TorchDEQ so its checkpoints load unchanged: weight norm keeps ``{name}_v`` (direction)
and ``{name}_g`` (learnable per-output scale); spectral norm keeps ``{name}_orig``, ``{name}_g`` and the power
iteration buffers ``{name}_u``, ``{name}_v``. The normalized weight is a plain attribute ``{name}``.

Rescaling: ``w = v * factor`` with ``factor = g / ||v||`` (weight norm, per output) or ``g / σ(v)`` (spectral
norm), where ``g`` is learned (``learn_scale=True``) or fixed to ``target_norm``; with ``clip=True`` the
factor is clipped to at most ``clip_value`` (a normalization may only shrink a weight), as TorchDEQ
does for IGNN.

Example:
    >>> import torch
    >>> from deqzoo.core.norm import apply_norm, reset_norm, remove_norm
    >>> layer = torch.nn.Linear(8, 8)
    >>> apply_norm(layer, "spectral_norm", learn_scale=True, clip=True)
    >>> reset_norm(layer)             # once per forward
    >>> y = layer(torch.randn(2, 8))
    >>> remove_norm(layer)            # back to a plain Parameter `weight`
    >>> isinstance(layer.weight, torch.nn.Parameter)
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NORMS", "SpectralNorm", "WeightNorm", "apply_norm", "register_norm", "remove_norm", "reset_norm"]

# (parameter name, the dimension that indexes outputs) for common layers
_TARGETS: dict[type, tuple[str, int]] = {
    nn.Linear: ("weight", 0),
    nn.Bilinear: ("weight", 0),
    nn.Conv1d: ("weight", 0),
    nn.Conv2d: ("weight", 0),
    nn.Conv3d: ("weight", 0),
    nn.ConvTranspose1d: ("weight", 1),
    nn.ConvTranspose2d: ("weight", 1),
    nn.ConvTranspose3d: ("weight", 1),
}


def _as_matrix(w: torch.Tensor, dim: int) -> torch.Tensor:
    moved = w.transpose(0, dim) if dim != 0 else w
    return moved.reshape(moved.shape[0], -1)


def power_iteration(mat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, n: int, eps: float = 1e-12) -> None:
    """n steps of power iteration towards mat's top singular vectors, updating the unit vectors u and v in
    place (spectral norm here, `deqzoo.core.projection`); σ(mat) ≈ u · (mat v) afterwards."""
    for _ in range(n):
        v.copy_(F.normalize(mat.t() @ u, dim=0, eps=eps))
        u.copy_(F.normalize(mat @ v, dim=0, eps=eps))


def _per_output_norm(w: torch.Tensor, dim: int) -> torch.Tensor:
    """||w|| over every dimension except `dim`, shaped to broadcast against w."""
    shape = [1] * w.dim()
    shape[dim] = w.shape[dim]
    return _as_matrix(w, dim).norm(dim=1).reshape(shape)


class _Norm:
    """One reparametrization of one parameter of one module (state lives on the module itself): a subclass
    stores the weight's source as ``{name}{source}`` (with ``{name}_g`` when the scale is learned) and its
    other tensors under the suffixes in `owned`."""

    kind = ""
    source = ""
    owned: tuple[str, ...] = ()

    def __init__(self, name: str, dim: int, learn_scale: bool, target_norm: float, clip: bool,
                 clip_value: float):
        self.name, self.dim = name, dim
        self.learn_scale, self.target_norm = learn_scale, float(target_norm)
        self.clip, self.clip_value = clip, float(clip_value)
        self.n_resets = 0  # how many times the weight was recomputed (tests count this)
        self._stamp: tuple | None = None

    def _factor(self, module: nn.Module, denom: torch.Tensor) -> torch.Tensor:
        scale = getattr(module, self.name + "_g") if self.learn_scale else self.target_norm
        factor = scale / denom
        if self.clip:
            factor = torch.clamp(factor, max=self.clip_value)
        return factor

    def _sources(self, module: nn.Module) -> list[torch.Tensor]:
        src = [getattr(module, self.name + self.source)]
        return src + ([getattr(module, self.name + "_g")] if self.learn_scale else [])

    def compute(self, module: nn.Module, update: bool) -> torch.Tensor:
        raise NotImplementedError

    def reset(self, module: nn.Module) -> None:
        sources = self._sources(module)
        if sources[0].is_meta:
            # a skeleton (transformers builds every model on the meta device before loading): there are no
            # values to normalize, and tracing the formula through meta kernels costs ~1/3 of a tiny
            # model's load; the stamp then differs from the loaded weights', so the first forward recomputes
            weight = torch.empty_like(sources[0]).requires_grad_(sources[0].requires_grad)
        else:
            weight = self.compute(module, update=module.training)
        setattr(module, self.name, weight)
        if torch.compiler.is_compiling():  # a Python counter and data pointers in a compiled forward would
            return  # be guarded on and recompile every call; the next eager forward's check recomputes
        self.n_resets += 1
        self._stamp = self._current_stamp(module)

    def _current_stamp(self, module: nn.Module) -> tuple:
        return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in self._sources(module))

    def refresh_if_stale(self, module: nn.Module) -> None:
        """Safety net for a forward that forgot reset_norm: recompute after the parameters changed (optimizer
        step, load_state_dict, .to()) or when gradients are wanted but the weight was computed without a
        graph.
        Grad mode alone switching off (the no-grad forward solve) does not trigger a recomputation."""
        w = getattr(module, self.name, None)
        wants_graph = torch.is_grad_enabled() and any(t.requires_grad for t in self._sources(module))
        if self._stamp != self._current_stamp(module) or (
            wants_graph and not (w is not None and w.requires_grad)
        ):
            self.reset(module)

    def remove(self, module: nn.Module) -> None:
        with torch.no_grad():
            w = self.compute(module, update=False).detach().clone()
        self._delete(module)
        if hasattr(module, self.name):
            delattr(module, self.name)
        module.register_parameter(self.name, nn.Parameter(w))

    def _delete(self, module: nn.Module) -> None:
        for suffix in (self.source, *self.owned, *(["_g"] if self.learn_scale else [])):
            if module._parameters.pop(self.name + suffix, None) is None:
                del module._buffers[self.name + suffix]


class WeightNorm(_Norm):
    """w = v · g / ||v|| per output (Salimans & Kingma), g learnable or fixed; factor optionally clipped."""

    kind = "weight_norm"
    source = "_v"

    @classmethod
    def attach(cls, module: nn.Module, name: str, dim: int, **kw) -> WeightNorm:
        fn = cls(name, dim, **kw)
        w = module._parameters.pop(name)
        if fn.learn_scale:
            module.register_parameter(name + "_g", nn.Parameter(_per_output_norm(w.data, dim).clone()))
        module.register_parameter(name + "_v", nn.Parameter(w.data))
        return fn

    def compute(self, module, update):
        v = getattr(module, self.name + "_v")
        return v * self._factor(module, _per_output_norm(v, self.dim))


class SpectralNorm(_Norm):
    """w = w_orig · g / σ(w_orig), σ by power iteration (one step per forward in training), g per output."""

    kind = "spectral_norm"
    source = "_orig"
    owned = ("_u", "_v")  # the power iteration's buffers

    def __init__(self, *args, n_power_iterations: int = 1, eps: float = 1e-12, **kw):
        super().__init__(*args, **kw)
        if n_power_iterations < 1:
            raise ValueError(f"n_power_iterations must be >= 1, got {n_power_iterations}")
        self.n_power_iterations, self.eps = n_power_iterations, eps

    @classmethod
    def attach(cls, module: nn.Module, name: str, dim: int, n_power_iterations: int = 1, eps: float = 1e-12,
               **kw) -> SpectralNorm:
        fn = cls(name, dim, n_power_iterations=n_power_iterations, eps=eps, **kw)
        w = module._parameters.pop(name)
        mat = _as_matrix(w.data, dim)
        h, wd = mat.shape
        module.register_parameter(name + "_orig", w)
        if fn.learn_scale:
            shape = [1] * w.dim()
            shape[dim] = h
            module.register_parameter(
                name + "_g", nn.Parameter(torch.full(shape, fn.target_norm, dtype=w.dtype, device=w.device))
            )
        u = F.normalize(w.new_empty(h).normal_(), dim=0, eps=eps)
        v = F.normalize(w.new_empty(wd).normal_(), dim=0, eps=eps)
        module.register_buffer(name + "_u", u)
        module.register_buffer(name + "_v", v)
        # start from a converged estimate of σ so the first forward is already normalized
        with torch.no_grad():
            power_iteration(mat, u, v, 15, eps)
        return fn

    def compute(self, module, update):
        w = getattr(module, self.name + "_orig")
        u, v = getattr(module, self.name + "_u"), getattr(module, self.name + "_v")
        mat = _as_matrix(w, self.dim)
        if update:
            with torch.no_grad():
                power_iteration(mat.detach(), u, v, self.n_power_iterations, self.eps)
        sigma = torch.dot(u.clone(), mat @ v.clone())
        return w * self._factor(module, sigma)


NORMS: dict[str, type[_Norm]] = {"weight_norm": WeightNorm, "spectral_norm": SpectralNorm}


def register_norm(name: str, cls: type[_Norm], targets: dict[type, tuple[str, int]] | None = None) -> None:
    """Register a normalization class (a `_Norm` subclass with `attach`, `compute`, `source`, `owned`)."""
    NORMS[name] = cls
    _TARGETS.update(targets or {})


def _norms_of(module: nn.Module) -> list[_Norm]:
    return module.__dict__.get("_deqzoo_norms", [])


_scope = threading.local()  # the current check-once scope of this thread (`checked_once`)


@contextlib.contextmanager
def checked_once() -> Iterator[None]:
    """Within: each normalized module's staleness check (`_Norm.refresh_if_stale`) runs at its first call
    only, not at every call. `deqzoo.core.DEQ` wraps its no-grad forward solve in it: f runs tens of times
    there with parameters that cannot change in between, and the check (a stamp over every source tensor)
    cost ~8% of an MNIST solve at batch 1. Nested scopes are separate; the backward pass is outside.

    Example:
        >>> import torch
        >>> from deqzoo.core.norm import apply_norm, checked_once
        >>> layer = torch.nn.Linear(3, 3)
        >>> apply_norm(layer)
        >>> with checked_once(), torch.no_grad():
        ...     _ = [layer(torch.ones(1, 3)) for _ in range(5)]
    """
    previous = getattr(_scope, "token", None)
    token = object()
    _scope.token = token
    try:
        yield
    finally:
        _scope.token = previous


def _pre_hook(module: nn.Module, _args) -> None:
    if torch.compiler.is_compiling():  # a compiled f (DEQ.compile_f): the stamp compares data pointers, which
        return  # breaks the graph; the model's forward has reset the weights before the solve (reset_norm)
    token = getattr(_scope, "token", None)
    for fn in _norms_of(module):
        if token is not None and fn.__dict__.get("_checked_in") is token:
            continue  # checked already in this scope
        fn.refresh_if_stale(module)
        fn._checked_in = token


def apply_norm(model: nn.Module, kind: str = "weight_norm", *, learn_scale: bool = True,
               target_norm: float = 1.0, clip: bool = False, clip_value: float = 1.0,
               filter_out: Iterable[str] = (), names: dict[type, tuple[str, int]] | None = None, **kind_kwargs
) -> None:
    """Normalize the weights of every supported submodule of `model` (Linear, Conv*, ConvTranspose*).

    Args:
        kind: "weight_norm" or "spectral_norm" (or a registered name); "none" does nothing.
        learn_scale: learn the per-output scale g (initialized to ||w|| for weight norm, to target_norm for
            spectral norm).
        target_norm: the scale when learn_scale is False.
        clip, clip_value: clip the rescaling factor g/||v|| (or g/σ) to at most clip_value.
        filter_out: skip submodules whose qualified name contains any of these strings.
        names: extra {module class: (parameter name, output dim)} targets.
        kind_kwargs: e.g. n_power_iterations for spectral norm.
    """
    if kind == "none":
        return
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; registered norms: {sorted(NORMS)} or 'none'")
    targets = {**_TARGETS, **(names or {})}
    filter_out = [filter_out] if isinstance(filter_out, str) else list(filter_out)
    options = dict(learn_scale=learn_scale, target_norm=target_norm, clip=clip, clip_value=clip_value)
    for qual, mod in model.named_modules():
        target = targets.get(type(mod))
        if target is None or any(s in qual for s in filter_out):
            continue
        pname, dim = target
        if pname not in mod._parameters or mod._parameters[pname] is None:
            continue  # already normalized, or no such weight
        fn = NORMS[kind].attach(mod, pname, dim, **options, **kind_kwargs)
        if not _norms_of(mod):
            mod.register_forward_pre_hook(_pre_hook)
        mod.__dict__.setdefault("_deqzoo_norms", []).append(fn)
        fn.reset(mod)


def reset_norm(model: nn.Module) -> None:
    """Recompute every normalized weight of `model` once (call at the start of each forward)."""
    for mod in model.modules():
        for fn in _norms_of(mod):
            fn.reset(mod)


def remove_norm(model: nn.Module) -> None:
    """Fold every normalization back into a plain Parameter (outputs unchanged)."""
    for mod in model.modules():
        norms = _norms_of(mod)
        for fn in norms:
            fn.remove(mod)
        if norms:
            del mod.__dict__["_deqzoo_norms"]
            for key in [k for k, h in mod._forward_pre_hooks.items() if h is _pre_hook]:
                del mod._forward_pre_hooks[key]
