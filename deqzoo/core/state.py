"""Packing of structured DEQ states (a tensor, or a tuple/list of tensors) into one (B, D) matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

State = torch.Tensor | Sequence[torch.Tensor]


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__name__}"


class StatePacker:
    """Flattens a state into (B, D) and back; checks that f keeps the state's structure, shapes and dtype."""

    def __init__(self, z0: State):
        self.is_tensor = isinstance(z0, torch.Tensor)
        tensors = [z0] if self.is_tensor else list(z0) if isinstance(z0, (tuple, list)) else []
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"z0 must be a tensor or a non-empty tuple/list of tensors, got {_describe(z0)}")
        self.container = None if self.is_tensor else type(z0)
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtype, self.device = tensors[0].dtype, tensors[0].device
        if not self.dtype.is_floating_point:
            raise TypeError(f"the state must be floating point, got dtype {self.dtype}")
        for i, t in enumerate(tensors):
            if t.dtype != self.dtype or t.device != self.device:
                raise TypeError(
                    f"every state tensor needs the same dtype and device: tensor 0 is "
                    f"{self.dtype} on {self.device}, tensor {i} is {t.dtype} on {t.device}"
                )
        # int(): under torch.jit.trace (and the TorchScript ONNX exporter) sizes are traced 0-d tensors, which
        # a set would not deduplicate
        batch = {int(s[0]) if s else None for s in self.shapes}
        if len(batch) != 1 or None in batch:
            raise ValueError(f"every state tensor needs the same leading batch dimension, got {self.shapes}")
        self.batch = batch.pop()
        self.sizes = [int(torch.Size(s[1:]).numel()) for s in self.shapes]

    def flatten(self, z: State) -> torch.Tensor:
        tensors = [z] if self.is_tensor else list(z)
        # explicit sizes, not -1: a batch of zero samples has no size to infer; the batch is the tensors'
        # own (a subset of rows in a compacted solve)
        b = int(tensors[0].shape[0]) if tensors[0].dim() else self.batch
        if len(tensors) == 1:
            return tensors[0].reshape(b, self.sizes[0])
        return torch.cat([t.reshape(b, n) for t, n in zip(tensors, self.sizes)], dim=1)

    def unflatten(self, x: torch.Tensor) -> State:
        """The structured state of a (B, D) matrix. Every tensor is contiguous: a part of a tuple state is a
        column block of the matrix (a strided view) that a convolution would otherwise copy on each use
        inside f; one copy here serves them all."""
        b = x.shape[0]
        if self.is_tensor:
            return x.reshape(b, *self.shapes[0][1:])
        parts = torch.split(x, self.sizes, dim=1)
        return self.container(p.contiguous().reshape(b, *s[1:]) for p, s in zip(parts, self.shapes))

    def check_finite(self, x: torch.Tensor, what: str = "z0") -> None:
        # max |x| is NaN or Inf exactly when some entry is; a fifth of the cost of isfinite(x).all()
        if x.numel() and not torch.isfinite(x.abs().amax()):
            bad = (~torch.isfinite(x)).any(1).nonzero()[:, 0].tolist()
            raise ValueError(f"{what} contains non-finite values (NaN or Inf) in batch sample(s) {bad[:10]}")

    def check(self, out: State, where: str = "f", batch: int | None = None) -> None:
        """Raise a clear error if `out` does not have this state's structure, shapes and dtype (`batch`: the
        rows f was called on, when fewer than the state's)."""
        want = "a tensor" if self.is_tensor else f"a {self.container.__name__} of {len(self.shapes)} tensors"
        if isinstance(out, torch.Tensor) != self.is_tensor or not isinstance(
            out, (torch.Tensor, tuple, list)
        ):
            raise TypeError(f"{where} returned {_describe(out)}, but the state z0 is {want}")
        tensors = [out] if self.is_tensor else list(out)
        if len(tensors) != len(self.shapes):
            raise TypeError(
                f"{where} returned {len(tensors)} tensors, but the state z0 has {len(self.shapes)}"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where} returned {_describe(t)} as state tensor {i}, expected a tensor")
            want = self.shapes[i] if batch is None else (batch, *self.shapes[i][1:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{where} returned shape {tuple(t.shape)} for state tensor {i}, but z0 has "
                    f"shape {want}" + ("" if batch is None else f" (the {batch} rows it was called on)")
                )
            if t.dtype != self.dtype:
                raise TypeError(
                    f"{where} returned dtype {t.dtype} for state tensor {i}, but z0 has dtype {self.dtype}"
                )

    def wrap(self, f: Callable[[State], State]) -> Callable[[torch.Tensor], torch.Tensor]:
        """f on flat (B, D) matrices; checks the structure, shapes and dtype of every output. When f is
        `deqzoo.core.halting.rowwise` (it accepts ``f(z, rows)``), so is the result, on flat rows."""
        from .halting import is_rowwise

        if is_rowwise(f):

            def g(x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
                out = f(self.unflatten(x), rows)
                self.check(out, batch=None if rows is None else x.shape[0])
                return self.flatten(out)

            g.rowwise = True
        else:

            def g(x: torch.Tensor) -> torch.Tensor:
                out = f(self.unflatten(x))
                self.check(out)
                return self.flatten(out)

        g.unflatten = self.unflatten
        return g
