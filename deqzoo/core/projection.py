"""Spectral-norm projection after each optimizer step: W <- W · c / σ(W) when σ(W) > c.

Unlike the spectral-norm reparametrization in `deqzoo.core.norm` (a normalized weight recomputed in every
forward, with a gradient through σ), the projection leaves the forward a plain linear map and costs a few
warm-started power iterations per optimizer step; it is what Implicit² (Huang, Bai & Kolter, 2021) describes:
rescale W after the update whenever its spectral norm exceeds the bound, so f stays contractive.

The power-iteration vectors persist in the projector (one per weight, owned by the caller like an optimizer's
state), so after the first call a couple of iterations per step track σ closely. Power iteration approaches σ
from below; ``margin`` shrinks the target slightly so a tiny underestimate cannot leave σ above the bound.

Example:
    >>> import torch
    >>> from deqzoo.core import SpectralProjector
    >>> lin = torch.nn.Linear(16, 16)
    >>> with torch.no_grad(): _ = lin.weight.mul_(10)
    >>> proj = SpectralProjector([lin.weight], max_norm=1.0)
    >>> sigmas = proj.step()                       # after optimizer.step()
    >>> bool(torch.linalg.matrix_norm(lin.weight, ord=2) <= 1.0 + 1e-3)
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from .norm import power_iteration

__all__ = ["SpectralProjector", "spectral_norm_estimate"]


def spectral_norm_estimate(w: torch.Tensor, u: torch.Tensor | None = None, n_iter: int = 20,
                           eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """σ(w) of a matrix by power iteration from `u` (random if None); returns (σ, u) for the next call."""
    if w.dim() != 2:
        raise ValueError(f"spectral_norm_estimate expects a matrix, got shape {tuple(w.shape)}")
    with torch.no_grad():
        if u is None:
            gen = torch.Generator(device="cpu").manual_seed(0)
            u = torch.randn(w.shape[0], generator=gen, dtype=w.dtype).to(w.device)
        u, v = F.normalize(u, dim=0, eps=eps), w.new_empty(w.shape[1])
        power_iteration(w, u, v, n_iter, eps)
        return torch.dot(u, w @ v), u


class SpectralProjector:
    """Rescale each given weight matrix to spectral norm `max_norm` whenever it exceeds it.

    Args:
        weights: the 2-D parameters to keep bounded (e.g. the z-to-z maps of f).
        max_norm: the bound c (Implicit² uses 1 to keep f contractive; 0.97 leaves a margin).
        n_iter: power iterations per `step` (warm-started; `init_iter` on the first call).
        margin: relative slack subtracted from the target, covering the power-iteration underestimate.

    ``step()`` returns the σ estimates before projection; ``last_scaled`` counts the weights it rescaled.
    """

    def __init__(self, weights: Iterable[torch.Tensor], max_norm: float = 1.0, *, n_iter: int = 3,
                 init_iter: int = 100, margin: float = 1e-3):
        self.weights = list(weights)
        for i, w in enumerate(self.weights):
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(f"SpectralProjector: weight {i} must be a 2-D tensor, got {shape}")
        if not max_norm > 0:
            raise ValueError(f"SpectralProjector: max_norm must be > 0, got {max_norm!r}")
        if n_iter < 1 or init_iter < 1:
            raise ValueError(
                f"SpectralProjector: n_iter and init_iter must be >= 1, got {n_iter}, {init_iter}"
            )
        self.max_norm, self.n_iter, self.init_iter, self.margin = float(max_norm), n_iter, init_iter, margin
        self._u: list[torch.Tensor | None] = [None] * len(self.weights)
        self.last_scaled = 0

    @torch.no_grad()
    def step(self) -> list[float]:
        """Project every weight whose estimated σ exceeds max_norm; returns the σ estimates before it."""
        sigmas, scaled = [], 0
        for i, w in enumerate(self.weights):
            n = self.init_iter if self._u[i] is None else self.n_iter
            sigma, self._u[i] = spectral_norm_estimate(w.detach(), self._u[i], n)
            s = float(sigma)
            sigmas.append(s)
            if s > self.max_norm:
                w.mul_(self.max_norm * (1.0 - self.margin) / s)
                scaled += 1
        self.last_scaled = scaled
        return sigmas
