"""Solver buffers reused across solves, per thread.

Why: a DEQ solves the same shapes over and over (every forward of a training or inference loop), and on CPU
the first write to freshly allocated memory costs a page fault per 4 KiB page. A solver history written one
slot per sample per step touches a new page on almost every write, so fresh buffers can cost more than the
arithmetic. `borrow` lends buffers kept from earlier solves of this thread, and `take`/`give` whole sets of
them (a fused solver's arrays, with their numpy views made once); what is on loan is removed from the pool,
so nested or concurrent solves never share it. The pool keeps at most ``DEQZOO_WORKSPACE_MB``
(default 256) MiB per thread; larger requests are allocated and dropped as usual. Contents are undefined.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["borrow", "clear", "give", "pooled_bytes", "take"]

_local = threading.local()


def _limit() -> int:
    return int(float(os.environ.get("DEQZOO_WORKSPACE_MB", "256")) * 2**20)


def _pool() -> dict:
    if not hasattr(_local, "pool"):
        _local.pool, _local.bytes = {}, 0
    return _local.pool


def pooled_bytes() -> int:
    """Bytes held by this thread's pool (buffers on loan excluded)."""
    _pool()
    return _local.bytes


def clear() -> None:
    """Drop this thread's pooled buffers."""
    _pool().clear()
    _local.bytes = 0


def take(key: Hashable) -> Any | None:
    """Remove and return the object pooled under `key`, or None. It is the caller's until `give`.

    Example:
        >>> from deqzoo.core import workspace
        >>> workspace.give("demo", [0.0] * 4, nbytes=32)
        >>> workspace.take("demo"), workspace.take("demo")
        ([0.0, 0.0, 0.0, 0.0], None)
    """
    entry = _pool().pop(key, None)
    if entry is None:
        return None
    _local.bytes -= entry[1]
    return entry[0]


def give(key: Hashable, obj: Any, nbytes: int) -> None:
    """Pool `obj` (holding `nbytes` of buffers) under `key` for a later `take`; dropped if the key is taken
    already (a nested solve's copy) or the pool would exceed its limit."""
    pool = _pool()
    if key not in pool and _local.bytes + nbytes <= _limit():
        pool[key] = (obj, nbytes)
        _local.bytes += nbytes


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
    flats = {}
    for name, shape in shapes.items():
        key = (name, like.dtype, like.device)
        need = math.prod(shape)
        flat = take(key)
        if flat is None or flat.numel() < need:
            flat = torch.empty(need, dtype=like.dtype, device=like.device)
        flats[key] = flat
    try:
        yield {name: flats[(name, like.dtype, like.device)][: math.prod(shape)].view(shape)
               for name, shape in shapes.items()}  # fmt: skip
    finally:
        for key, flat in flats.items():
            give(key, flat, flat.numel() * flat.element_size())
