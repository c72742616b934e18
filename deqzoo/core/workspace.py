"""Solver buffers reused across solves, per thread.

Why: a DEQ solves the same shapes over and over (every forward of a training or inference loop), and on CPU
the first write to freshly allocated memory costs a page fault per 4 KiB page. A solver history written one
slot per sample per step touches a new page on almost every write, so fresh buffers can cost more than the
arithmetic. `take` lends what `give` pooled after an earlier solve of this thread (a fused solver's history
arrays); what is on loan is removed from the pool, so nested or concurrent solves never share it.

What stays resident, per thread: pooled entries up to ``DEQZOO_WORKSPACE_MB`` (read at import, default 256)
MiB, or what `set_limit` sets, plus at most one entry that alone exceeds that limit (the last such one
given: a large solve repeated with the same shape reuses its buffers instead of faulting them in again, about
40% of the time at d = 4096, B = 512; giving another oversized entry replaces it). An entry that fits alone
but not beside the others is dropped. Of two entries under one key the larger is kept. A limit of 0 pools
nothing. `clear` drops all.
Contents are undefined.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from typing import Any

__all__ = ["clear", "give", "pooled_bytes", "set_limit", "take"]

_local = threading.local()


def _env_limit() -> int:
    return int(float(os.environ.get("DEQZOO_WORKSPACE_MB", "256")) * 2**20)


# read once, not per `give`: right after f, with cold caches, an os.environ lookup costs ~30 us
_limit_bytes = _env_limit()


def set_limit(mb: float | None) -> None:
    """Set the pool's limit per thread to `mb` MiB (None: ``DEQZOO_WORKSPACE_MB`` again); pooled buffers
    stay until `clear` or a `take`.

    Example:
        >>> from deqzoo.core import workspace
        >>> workspace.set_limit(0)  # pool nothing
        >>> workspace.give("demo", [0.0], nbytes=8); workspace.take("demo") is None
        True
        >>> workspace.set_limit(None)
    """
    global _limit_bytes
    _limit_bytes = _env_limit() if mb is None else int(float(mb) * 2**20)


def _pool() -> dict:
    if not hasattr(_local, "pool"):
        _local.pool, _local.bytes, _local.big = {}, 0, None
    return _local.pool


def pooled_bytes() -> int:
    """Bytes held by this thread's pool (buffers on loan excluded), the oversized entry included."""
    _pool()
    big = getattr(_local, "big", None)
    return _local.bytes + (big[2] if big is not None else 0)


def clear() -> None:
    """Drop this thread's pooled buffers."""
    _pool().clear()
    _local.bytes = 0
    _local.big = None


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
        big = getattr(_local, "big", None)
        if big is not None and big[0] == key:
            _local.big = None
            return big[1]
        return None
    _local.bytes -= entry[1]
    return entry[0]


def give(key: Hashable, obj: Any, nbytes: int) -> None:
    """Pool `obj` (holding `nbytes` of buffers) under `key` for a later `take`. Under a key pooled already (a
    nested solve's copy) the larger entry stays; an entry larger than the whole limit becomes the one
    oversized entry; one that does not fit beside the others is dropped."""
    pool = _pool()
    old = pool.get(key)
    if old is not None:
        if nbytes <= old[1]:
            return
        del pool[key]
        _local.bytes -= old[1]
    if nbytes > _limit_bytes:
        if _limit_bytes <= 0:  # a limit of 0 turns pooling off
            return
        big = getattr(_local, "big", None)
        if big is None or big[0] != key or big[2] < nbytes:
            _local.big = (key, obj, nbytes)
    elif _local.bytes + nbytes <= _limit_bytes:
        pool[key] = (obj, nbytes)
        _local.bytes += nbytes
