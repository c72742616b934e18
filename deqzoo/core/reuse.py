"""Fixed-point reuse across training steps: the previous step's z* as this step's initial guess.

Full-batch fitting (implicit neural representations, Huang, Bai & Kolter 2021) solves the same equilibrium,
for the same inputs, at every training step while the weights move a little. Starting each solve from the last
step's fixed point instead of zeros makes the solve one or two f-evaluations long (amortized constant cost).

The cache belongs to the caller (the training loop), never to the model: a model stays a pure function of its
weights and inputs, and evaluation, which starts from zeros, is not affected by what training left behind.
Entries are keyed by a name the caller chooses and guarded by a fingerprint of the inputs (shape, dtype,
device, and a cheap checksum), so a different batch silently falls back to the default initial state.

Example:
    >>> import torch
    >>> from deqzoo.core import DEQ, DEQConfig, FixedPointCache
    >>> lin = torch.nn.Linear(4, 4); x = torch.randn(3, 4)
    >>> deq, cache = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=100, f_tol=1e-5)), FixedPointCache()
    >>> f = lambda z: torch.tanh(0.5 * lin(z) + x)
    >>> z, first = deq(f, cache.initial("batch", torch.zeros(3, 4), key_input=x))
    >>> cache.store("batch", z, key_input=x)
    >>> z, again = deq(f, cache.initial("batch", torch.zeros(3, 4), key_input=x))
    >>> first.nfe > again.nfe == 1
    True

Two ways to use a hit (``FixedPointCache(hit_max_iter=...)``, applied by `FixedPointCache.solve`):
- ``None`` (default): a normal tolerance-checked solve started from the cached state (the solve stops at
  f_tol; the count of f-evaluations is what reuse saves).
- ``0``: the original Implicit² training forward (locuslab/ImpSq, ``skip_solver`` after step 0): no solve,
  the cached state is taken as z* and the backward mode's one differentiable f step starts from it; no
  tolerance is checked (stats report the cached state's residual). ``k >= 1``: at most k solver steps.
A miss (the first step, other inputs) always solves with the DEQ's own budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FixedPointCache"]


def _fingerprint(t: torch.Tensor | None) -> tuple | None:
    """Shape, dtype, device and two checksums: distinguishes batches without keeping them alive."""
    if t is None:
        return None
    with torch.no_grad():
        flat = t.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        sums = (float(flat.sum()), float((flat * weights).sum())) if flat.numel() else (0.0, 0.0)
    return (tuple(t.shape), t.dtype, str(t.device), sums)


@dataclass
class _Entry:
    state: torch.Tensor
    fingerprint: tuple | None


class FixedPointCache:
    """Fixed points kept between training steps, keyed by name, owned by the caller.

    ``initial(key, default, key_input=x)`` returns the stored state for `key` when one exists with the shape,
    dtype and device of `default` and was stored for the same `key_input` (same fingerprint), else `default`.
    ``store(key, z, key_input=x)`` keeps a detached copy of z (no graph, no link to the caller's tensor).
    ``hits`` and ``misses`` count what `initial` returned.
    """

    def __init__(self, hit_max_iter: int | None = None) -> None:
        if hit_max_iter is not None and (
            isinstance(hit_max_iter, bool) or not isinstance(hit_max_iter, int) or hit_max_iter < 0
        ):
            raise ValueError(
                f"FixedPointCache: hit_max_iter must be None or an integer >= 0, got {hit_max_iter!r}"
            )
        self.hit_max_iter = hit_max_iter
        self._entries: dict[str, _Entry] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def initial(self, key: str, default: torch.Tensor, *, key_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The cached state for `key` if it fits `default` and `key_input`, else `default`."""
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry.state.shape == default.shape
            and entry.state.dtype == default.dtype
            and entry.state.device == default.device
            and entry.fingerprint == _fingerprint(key_input)
        ):
            self.hits += 1
            return entry.state.clone()  # a solver may update its initial state in place
        self.misses += 1
        return default

    def solve(self, deq, key: str, f, default: torch.Tensor, *, key_input: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """``deq(f, z0)`` started from `initial(key, default, key_input=...)`, the result stored under `key`.

        On a hit with ``hit_max_iter`` set, the solve runs with that budget (``deq.solve_with(deq.config,
        f, z0, max_iter=hit_max_iter)``; 0 = no solve, see the module docstring); otherwise ``deq(f, z0)``.

        Example:
            >>> import torch
            >>> from deqzoo.core import DEQ, DEQConfig, FixedPointCache, neumann_backward
            >>> deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=50, f_tol=1e-4, **neumann_backward(1)))
            >>> w = torch.nn.Parameter(torch.tensor(0.5)); f = lambda z: w * z + 1
            >>> cache = FixedPointCache(hit_max_iter=0)
            >>> [cache.solve(deq, "k", f, torch.zeros(1, 3))[1].nfe for _ in range(3)]
            [14, 0, 0]
        """
        z0 = self.initial(key, default, key_input=key_input)
        if z0 is not default and self.hit_max_iter is not None:
            z, stats = deq.solve_with(deq.config, f, z0, max_iter=self.hit_max_iter)
        else:
            z, stats = deq(f, z0)
        self.store(key, z, key_input=key_input)
        return z, stats

    def fork(self, hit_max_iter: int | None = None) -> FixedPointCache:
        """A new cache holding this one's entries (e.g. a probe solve from the stored states that must
        not change what the next training step starts from).

        Example:
            >>> import torch
            >>> from deqzoo.core import FixedPointCache
            >>> cache = FixedPointCache(); cache.store("k", torch.ones(2))
            >>> probe = cache.fork(hit_max_iter=0); probe.store("k", torch.zeros(2))
            >>> cache.initial("k", torch.zeros(2)).tolist(), probe.hit_max_iter
            ([1.0, 1.0], 0)
        """
        other = FixedPointCache(hit_max_iter=hit_max_iter)
        other._entries = dict(self._entries)  # entries are never changed in place: sharing them is safe
        return other

    def store(self, key: str, state: torch.Tensor, *, key_input: torch.Tensor | None = None) -> None:
        """Keep a detached copy of `state` (e.g. this step's z*) for the next `initial(key, ...)`."""
        if not isinstance(state, torch.Tensor):
            raise TypeError(
                f"FixedPointCache.store({key!r}): state must be a tensor, got {type(state).__name__}"
            )
        if not bool(torch.isfinite(state).all()):
            self._entries.pop(key, None)  # never start the next solve from NaN/inf
            return
        self._entries[key] = _Entry(state.detach().clone(), _fingerprint(key_input))

    def clear(self, key: str | None = None) -> None:
        """Forget one entry (or all)."""
        if key is None:
            self._entries.clear()
        else:
            self._entries.pop(key, None)
