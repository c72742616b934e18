"""Export DEQ models (``torch.export``, ONNX, ``torch.jit.trace``) under fixed-iteration inference.

A DEQ's adaptive solve reads tensor values every step and cannot be traced. Exported programs run every DEQ
for exactly ``max_iter`` damped steps ``z <- (1 - tau) z + tau f(z)`` (the engine's `phantom_steps`; defaults:
the model's ``f_max_iter``, ``tau=1``), with a dynamic batch and no statistics (docs/export.md gives the
measured accuracy). What cannot be exported raises :class:`ExportError` naming the reason. The wrapper kind
serving each head is named in its family's declaration (:mod:`deqzoo.models.registry`):

* image classifier (MDEQ): ``(pixel_values,) -> logits``;
* signal (Implicit²): ``(coords,) -> values``, any number of points;
* causal LM (DEQ-Transformer): ``(input_ids,) -> logits`` at the example's sequence length, through
  ``torch.export`` and ``jit.trace`` only (the declaration says why not ONNX);
* graph node classifier (IGNN): ``(x, operator) -> logits`` with ``operator = graph_operator(...)``, the
  weight projection applied once for the graph given to :func:`exportable`.

Example:
    >>> import torch, deqzoo
    >>> from deqzoo.export import exportable
    >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    >>> module = exportable(model, max_iter=20)
    >>> pixels = torch.rand(2, 1, 28, 28)
    >>> program = torch.export.export(module, (pixels,))  # doctest: +SKIP
    >>> torch.allclose(program.module()(pixels), module(pixels), atol=1e-4)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .core import DEQ, SolverStats, remove_norm
from .core.backward import phantom_steps
from .errors import DeqzooError
from .models.registry import declared_families

__all__ = ["ExportError", "FixedIterationDEQ", "batch_dynamic_shapes", "export_onnx", "export_program",
           "exportable", "graph_operator", "trace"]


class ExportError(DeqzooError, RuntimeError):
    """A model (or an input) that cannot be exported; the message names the reason."""


class FixedIterationDEQ(DEQ):
    """A DEQ layer taking exactly ``max_iter`` damped fixed-point steps (``phantom_steps``): traceable.

    Example:
        >>> import torch
        >>> from deqzoo.core import DEQConfig
        >>> deq = FixedIterationDEQ(DEQConfig(), max_iter=60)
        >>> z, stats = deq(lambda z: 0.5 * z + 1, torch.zeros(1, 3))
        >>> round(float(z[0, 0]), 6), stats.nfe
        (2.0, 60)
    """

    traceable = True  # checked by the models' tracing guard (deqzoo.modeling_utils)

    def __init__(self, config, max_iter: int, tau: float = 1.0):
        super().__init__(config)
        if int(max_iter) < 1:
            raise ValueError(f"max_iter must be >= 1 for fixed-iteration inference, got {max_iter}")
        if not 0.0 < float(tau) <= 1.0:
            raise ValueError(f"tau must be in (0, 1] (damping of z <- (1 - tau) z + tau f(z)), got {tau}")
        self.max_iter, self.tau = int(max_iter), float(tau)

    def extra_repr(self) -> str:
        return f"fixed_iteration, max_iter={self.max_iter}, tau={self.tau}"

    def forward(self, f, z0):
        packer = _SymbolicPacker(z0)
        g = packer.wrap(f)
        x = phantom_steps(g, packer.flatten(z0), self.max_iter - 1, self.tau)
        fx = g(x)  # the last step, kept to report its residual
        z = fx if self.tau == 1.0 else torch.lerp(x, fx, self.tau)
        abs_res = (fx - x).norm(dim=1)
        rel_res = abs_res / fx.norm(dim=1).clamp_min(1e-30)
        cfg = self.config
        res = rel_res if cfg.f_stop_mode == "rel" else abs_res
        stats = SolverStats(nfe=self.max_iter, abs_residual=abs_res, rel_residual=rel_res,
                            trace=res.max().reshape(1), converged=res <= cfg.f_tol, solver="fixed_iteration",
                            stop_mode=cfg.f_stop_mode, tol=cfg.f_tol)
        return packer.unflatten(z), stats


class _SymbolicPacker:
    """The engine's state packing ((B, D) matrices) without taking an ``int()`` of a size: under a dynamic
    batch the sizes are symbols, and an int would specialise the program to the example's batch."""

    def __init__(self, z0):
        self.is_tensor = isinstance(z0, torch.Tensor)
        tensors = [z0] if self.is_tensor else list(z0)
        if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
            raise ExportError("fixed-iteration inference needs a state of tensors with a batch dimension")
        self.container = None if self.is_tensor else type(z0)
        self.shapes = [t.shape for t in tensors]
        self.widths = [t.flatten(1).shape[1] if t.dim() > 1 else 1 for t in tensors]

    def flatten(self, z) -> torch.Tensor:
        tensors = [z] if self.is_tensor else list(z)
        flat = [t.reshape(t.shape[0], -1) for t in tensors]
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)

    def unflatten(self, x: torch.Tensor):
        if self.is_tensor:
            return x.reshape(self.shapes[0])
        parts = torch.split(x, self.widths, dim=1)
        return self.container(p.reshape(s) for p, s in zip(parts, self.shapes))

    def wrap(self, f):
        return lambda x: self.flatten(f(self.unflatten(x)))


def _fixed_iteration_copy(model: nn.Module, max_iter: int | None, tau: float) -> nn.Module:
    """A copy of `model` in eval mode whose DEQ layers run fixed-iteration inference; rebuilt from config and
    state dict, not deepcopied: weight-normed layers hold computed (non-leaf) tensors."""
    fresh = type(model)(copy.deepcopy(model.config))
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise ExportError(f"{type(model).__name__}: could not rebuild the model for export "
                          f"(missing keys {missing[:5]}, unexpected keys {unexpected[:5]})")
    model = fresh.to(next(model.parameters()).dtype).eval()
    # weight/spectral norms are recomputed per forward behind a data-pointer cache: fold them into plain
    # weights (the engine's remove_norm leaves outputs unchanged)
    remove_norm(model)
    model.set_deq(on_nonconvergence="ignore")  # the convergence warning reads tensor values: off here
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, DEQ) and not isinstance(child, FixedIterationDEQ):
                budget = max_iter if max_iter is not None else child.config.f_max_iter
                setattr(module, name, FixedIterationDEQ(child.config, budget, tau))
    return model


class _Head(nn.Module):
    """A tensor-in, tensor-out head. `inputs`: argument name -> dynamic axes (axis -> a Dim name shared
    between inputs); `onnx_refused`, `graph_of` (dense operator -> ``graph``): the family declaration's."""

    inputs: dict[str, dict[int, str]] = {"pixel_values": {0: "batch"}}
    output = "logits"

    def __init__(self, model: nn.Module, onnx_refused: str = "", graph_of: Any = None):
        super().__init__()
        self.model, self.onnx_refused, self.graph_of = model, onnx_refused, graph_of


class _ImageClassifier(_Head):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values, return_dict=True).logits


class _SignalRepresenter(_Head):
    inputs = {"coords": {0: "points"}}  # (N, d) coordinates: the number of points
    output = "values"

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        return self.model(coords, return_dict=True).values


class _LanguageModel(_Head):
    inputs = {"input_ids": {0: "batch"}}  # (batch, length) token ids at the example's length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, use_cache=False, return_dict=True).logits


class _GraphNodeClassifier(_Head):
    inputs = {"x": {0: "nodes"}, "operator": {0: "nodes", 1: "nodes"}}

    def forward(self, x: torch.Tensor, operator: torch.Tensor) -> torch.Tensor:
        return self.model(x, graph=self.graph_of(operator), return_dict=True).logits


# the wrapper kinds a family's declaration (deqzoo.models.registry.Family.export) names for its heads
_WRAPPERS: dict[str, type[_Head]] = {"image classifier": _ImageClassifier, "signal": _SignalRepresenter,
                                     "causal LM": _LanguageModel,
                                     "graph node classifier": _GraphNodeClassifier}


def graph_operator(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor,
                   edge_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The dense normalized adjacency Â an exported graph model takes beside ``x`` (validated by the model).

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification
        >>> model = IGNNForNodeClassification(IGNNConfig(in_features=3, num_labels=2))
        >>> graph_operator(model, torch.randn(4, 3), torch.tensor([[0, 1, 2], [1, 2, 3]])).shape
        torch.Size([4, 4])
    """
    base = getattr(model, "base_model", model)
    if not hasattr(base, "prepare_graph"):
        raise ExportError(f"{type(model).__name__} is not a graph model (it has no prepare_graph)")
    return base.prepare_graph(x, edge_index, edge_weight).operator.to_dense()


def _served_as(model: nn.Module):
    """The wrapper serving `model` and its family's declaration; ExportError says why not."""
    families, name = declared_families(), type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = families.get(model_type)
    heads = family.export if family is not None else "it is not a declared deqzoo family"
    if isinstance(heads, str):
        served = sorted(t for t, f in families.items() if not isinstance(f.export, str))
        raise ExportError(f"{name} (model_type {model_type!r}) cannot be exported: {heads} (export is "
                          f"implemented for {served})")
    mro = [cls.__name__ for cls in type(model).__mro__]  # the head's class or a subclass
    kind = next((heads[c] for c in mro if c in heads), None)
    if kind not in _WRAPPERS:
        why = next((family.export_refused[c] for c in mro if c in family.export_refused),
                   "it is not a head export serves" if kind is None else
                   f"its declared wrapper kind {kind!r} is not one of {sorted(_WRAPPERS)}")
        raise ExportError(f"{name} (model_type {model_type!r}) cannot be exported: {why}; export supports "
                          f"{', '.join(f'{head} ({k})' for head, k in heads.items())}")
    return _WRAPPERS[kind], family


def exportable(model: nn.Module, *, max_iter: int | None = None, tau: float = 1.0, graph: Any = None
               ) -> nn.Module:
    """A tensor-in, tensor-out copy of `model` under fixed-iteration inference (module docstring); the model
    is not modified. `graph` (IGNN with ``kappa``): the :class:`IGNNGraph` whose λ_pf sets the projection.

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification
        >>> model = IGNNForNodeClassification(IGNNConfig(in_features=3, num_labels=2, kappa=None))
        >>> x, edges = torch.randn(4, 3), torch.tensor([[0, 1, 2], [1, 2, 3]])
        >>> module = exportable(model, max_iter=30)
        >>> module(x, graph_operator(model, x, edges)).shape
        torch.Size([4, 2])
    """
    wrapper, family = _served_as(model)
    if not any(isinstance(m, DEQ) for m in model.modules()):
        raise ExportError(f"{type(model).__name__} has no DEQ layer to run at a fixed iteration budget")
    copy_ = _fixed_iteration_copy(model, max_iter, tau)
    prepare = family.export_prepare  # the family's own (IGNN: the weight projection; returns Â -> its graph)
    try:
        graph_of = family.load(prepare)(copy_, graph) if prepare else None
    except ValueError as err:
        raise ExportError(f"{type(model).__name__}: {err}") from err
    return wrapper(copy_, family.onnx_refused, graph_of).eval()


def _as_tuple(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def batch_dynamic_shapes(module: nn.Module):
    """``dynamic_shapes`` for ``torch.export`` leaving the batch free (an IGNN's nodes: x's rows, Â's sides).

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification
        >>> model = IGNNForNodeClassification(IGNNConfig(in_features=3, num_labels=2, kappa=None))
        >>> [sorted(d) for d in batch_dynamic_shapes(exportable(model))]
        [[0], [0, 1]]
    """
    _check_module(module)
    dims: dict[str, torch.export.Dim] = {}  # one Dim per name: x's rows and the operator's sides agree
    return tuple({axis: dims.setdefault(name, torch.export.Dim(name, min=1, max=2**31 - 2))
                  for axis, name in axes.items()} for axes in module.inputs.values())


def export_program(module: nn.Module, example_inputs, *, dynamic_batch: bool = True,
                   **kwargs) -> torch.export.ExportedProgram:
    """``torch.export.export`` of an :func:`exportable` module (``dynamic_batch``: any batch size, through
    :func:`batch_dynamic_shapes`); failures raise :class:`ExportError`."""
    _check_module(module)
    if dynamic_batch:
        kwargs.setdefault("dynamic_shapes", batch_dynamic_shapes(module))
    try:
        return torch.export.export(module, _as_tuple(example_inputs), **kwargs)
    except Exception as err:
        raise ExportError(f"torch.export failed for {type(module).__name__}: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}") from err


def export_onnx(module: nn.Module, example_inputs, path: str | os.PathLike, *, dynamic_batch: bool = True,
                **kwargs) -> Path:
    """Write a new ONNX file of an :func:`exportable` module (the ``export`` extra). ``dynamic_batch``: a
    symbolic batch axis, as ``dynamic_shapes`` (``dynamo=True``) or ``dynamic_axes`` (``dynamo=False``, the
    TorchScript exporter: several times faster for a long unrolled solve)."""
    _check_module(module)
    if module.onnx_refused:
        raise ExportError(f"ONNX export of {type(module.model).__name__} is refused: {module.onnx_refused}")
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; choose a new path (an existing file is never overwritten)")
    kwargs.setdefault("input_names", list(module.inputs))
    kwargs.setdefault("output_names", [module.output])
    if dynamic_batch and "dynamic_shapes" not in kwargs and "dynamic_axes" not in kwargs:
        if kwargs.get("dynamo", True):
            kwargs["dynamic_shapes"] = batch_dynamic_shapes(module)
        else:  # the output's rows follow the first input's
            first = next(iter(module.inputs.values()))
            kwargs["dynamic_axes"] = {**module.inputs, module.output: {0: first[0]}}
    try:
        torch.onnx.export(module, _as_tuple(example_inputs), str(path), **kwargs)
    except Exception as err:
        raise ExportError(f"ONNX export failed for {type(module).__name__}: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}") from err
    return path


def trace(module: nn.Module, example_inputs) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` of an :func:`exportable` module; it serves any batch size (no int of a size)."""
    _check_module(module)
    with torch.no_grad():
        return torch.jit.trace(module, _as_tuple(example_inputs), check_trace=False)


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, _Head):
        raise ExportError(f"{type(module).__name__}: pass the module deqzoo.export.exportable(model) returns "
                          "(a DEQ's adaptive solve cannot be traced: its stopping test reads tensor values)")
