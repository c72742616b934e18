"""Solver buffers reused across solves, per thread.

Why: a DEQ solves the same shapes over and over (every forward of a training or inference loop), and on CPU
the first write to freshly allocated memory costs a page fault per 4 KiB page. A solver history written one
slot per sample per step touches a new page on almost every write, so fresh buffers can cost more than the
arithmetic. `borrow` lends buffers kept from earlier solves of this thread; buffers on loan are removed from
the pool, so nested or concurrent solves never share one. The pool keeps at most ``DEQZOO_WORKSPACE_MB``
(default 256) MiB per thread; larger requests are allocated and dropped as usual. Contents are undefined.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["borrow", "clear", "pooled_bytes"]

_local = threading.local()


def _limit() -> int:
    return int(float(os.environ.get("DEQZOO_WORKSPACE_MB", "256")) * 2**20)


def _pool() -> dict:
    if not hasattr(_local, "pool"):
        _local.pool = {}
    return _local.pool


def pooled_bytes() -> int:
    """Bytes held by this thread's pool (buffers on loan excluded)."""
    return sum(t.numel() * t.element_size() for t in _pool().values())


def clear() -> None:
    """Drop this thread's pooled buffers."""
    _pool().clear()


@contextmanager
def borrow(like: torch.Tensor, **shapes: tuple[int, ...]) -> Iterator[dict[str, torch.Tensor]]:
    """Buffers of the given shapes with `like`'s dtype and device, by name, for the duration of the block.

    Example:
        >>> import torch
        >>> from deqzoo.core.workspace import borrow
        >>> with borrow(torch.zeros(2, 3), hist=(2, 4, 3)) as ws:
        ...     ws["hist"].shape
        torch.Size([2, 4, 3])
    """
    pool = _pool()
    flats = {}
    for name, shape in shapes.items():
        key = (name, like.dtype, like.device)
        need = math.prod(shape)
        flat = pool.pop(key, None)
        if flat is None or flat.numel() < need:
            flat = torch.empty(need, dtype=like.dtype, device=like.device)
        flats[key] = flat
    try:
        yield {name: flats[(name, like.dtype, like.device)][: math.prod(shape)].view(shape)
               for name, shape in shapes.items()}  # fmt: skip
    finally:
        budget = _limit() - pooled_bytes()
        for key, flat in flats.items():
            size = flat.numel() * flat.element_size()
            if size <= budget:
                pool[key] = flat
                budget -= size
