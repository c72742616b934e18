"""Solver buffers reused across solves, per thread.

Why: a DEQ solves the same shapes over and over (every forward of a training or inference loop), and on CPU
the first write to freshly allocated memory costs a page fault per 4 KiB page. A solver history written one
slot per sample per step touches a new page on almost every write, so fresh buffers can cost more than the
arithmetic. `take` lends what `give` pooled after an earlier solve of this thread (a fused solver's whole set
of arrays, with their numpy views made once); what is on loan is removed from the pool, so nested or
concurrent solves never share it. The pool keeps at most ``DEQZOO_WORKSPACE_MB`` (read at import, default
256) MiB per thread, or what `set_limit` sets; what does not fit is dropped as usual. Contents are undefined.
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
    if key not in pool and _local.bytes + nbytes <= _limit_bytes:
        pool[key] = (obj, nbytes)
        _local.bytes += nbytes
