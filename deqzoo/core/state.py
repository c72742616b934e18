"""Packing of structured DEQ states (a tensor, or a tuple/list of tensors) into one (B, D) matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

State = torch.Tensor | Sequence[torch.Tensor]


class StatePacker:
    """Flattens a state into (B, D) and back; checks that f keeps the state's structure."""

    def __init__(self, z0: State):
        self.is_tensor = isinstance(z0, torch.Tensor)
        tensors = [z0] if self.is_tensor else list(z0)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"z0 must be a tensor or a non-empty tuple/list of tensors, got {type(z0).__name__}")
        self.container = None if self.is_tensor else type(z0)
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtype = tensors[0].dtype
        batch = {s[0] if s else None for s in self.shapes}
        if len(batch) != 1 or None in batch:
            raise ValueError(f"every tensor of the state needs the same leading batch dimension, got shapes {self.shapes}")
        self.batch = batch.pop()
        self.sizes = [int(torch.Size(s[1:]).numel()) for s in self.shapes]

    def flatten(self, z: State) -> torch.Tensor:
        tensors = [z] if self.is_tensor else list(z)
        if len(tensors) == 1:
            return tensors[0].reshape(self.batch, -1)
        return torch.cat([t.reshape(self.batch, -1) for t in tensors], dim=1)

    def unflatten(self, x: torch.Tensor) -> State:
        if self.is_tensor:
            return x.reshape(self.shapes[0])
        parts = torch.split(x, self.sizes, dim=1)
        return self.container(p.reshape(s) for p, s in zip(parts, self.shapes))

    def check(self, out: State, where: str = "f") -> None:
        """Raise a clear error if `out` does not have this state's structure, shapes and dtype."""
        if isinstance(out, torch.Tensor) != self.is_tensor:
            got = "a tensor" if isinstance(out, torch.Tensor) else type(out).__name__
            want = "a tensor" if self.is_tensor else f"a {self.container.__name__} of {len(self.shapes)} tensors"
            raise TypeError(f"{where} returned {got}, but the state z0 is {want}")
        tensors = [out] if self.is_tensor else list(out)
        if len(tensors) != len(self.shapes):
            raise TypeError(f"{where} returned {len(tensors)} tensors, but the state z0 has {len(self.shapes)}")
        for i, t in enumerate(tensors):
            if tuple(t.shape) != self.shapes[i]:
                raise ValueError(f"{where} returned shape {tuple(t.shape)} for state tensor {i}, expected {self.shapes[i]}")
            if t.dtype != self.dtype:
                raise TypeError(f"{where} returned dtype {t.dtype} for state tensor {i}, expected {self.dtype}")

    def wrap(self, f: Callable[[State], State]) -> Callable[[torch.Tensor], torch.Tensor]:
        """f on flat (B, D) matrices; checks the structure on the first call only (it does not change)."""
        checked = False

        def g(x: torch.Tensor) -> torch.Tensor:
            nonlocal checked
            out = f(self.unflatten(x))
            if not checked:
                self.check(out)
                checked = True
            return self.flatten(out)

        return g
