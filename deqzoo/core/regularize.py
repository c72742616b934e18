"""Regularizers and training aids for DEQs: Jacobian regularization, the equilibrium residual penalty,
fixed-point correction, mixed initialization, variational dropout.

Example:
    >>> import torch
    >>> from deqzoo.core.regularize import VariationalDropout, reset_dropout, mixed_init, jacobian_reg
    >>> drop = VariationalDropout(0.2).train()
    >>> reset_dropout(drop)                     # at the start of each forward: a new mask
    >>> x = torch.ones(4, 8)
    >>> bool((drop(x) == drop(x)).all())        # same mask for every f call of this forward
    True
    >>> z0 = mixed_init(torch.empty(4, 8))      # half zeros, half N(0, 1)
    >>> z = torch.randn(4, 8, requires_grad=True)
    >>> jacobian_reg(torch.tanh(z), z, n_samples=2).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = [
    "VariationalDropout", "fp_correction", "jacobian_reg", "mixed_init", "reset_dropout", "residual_penalty",
]  # fmt: skip

_Tensors = torch.Tensor | Sequence[torch.Tensor]


def _as_list(x: _Tensors) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def jacobian_reg(fz: _Tensors, z: _Tensors, n_samples: int = 1, create_graph: bool = True) -> torch.Tensor:
    """Hutchinson estimate of ||J_f(z)||_F² / dim, averaged over the batch (Bai et al., 2021).

    E_v ||vᵀ J||² = ||J||_F² for v ~ N(0, I); the estimate is divided by the number of state elements (batch
    included), i.e. it is the per-sample ||J_i||_F² over the per-sample dimension, averaged over samples.
    `fz = f(z)` must have been computed from `z` with a graph. Tuple states are supported (J over all parts).
    With `create_graph=True` (default) the result is differentiable, so it can be added to a training loss.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    fzs, zs = _as_list(fz), _as_list(z)
    numel = sum(t.numel() for t in zs)
    total = fzs[0].new_zeros(())
    for _ in range(n_samples):
        vs = [torch.randn_like(t) for t in fzs]
        vjs = torch.autograd.grad(
            fzs, zs, vs, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        total = total + sum((g * g).sum() for g in vjs if g is not None)
    return total / (n_samples * numel)


def residual_penalty(f: Callable, z: _Tensors) -> tuple[_Tensors, torch.Tensor]:
    """One more application of f at a solve's output z, held fixed: returns (f(z), the batch mean of
    ||f(z) - z|| / ||z|| over the whole state, the solver's relative residual). Added to a training loss, it
    teaches f (not the state: z is detached) to stop at the point the solver returns; a family may also
    penalise a part of f(z) - z in its own units (DEQ-Flow: the flow's drift in pixels).

    Example:
        >>> import torch
        >>> from deqzoo.core.regularize import residual_penalty
        >>> W = torch.nn.Linear(4, 4)
        >>> fz, r = residual_penalty(lambda z: torch.tanh(W(z)), torch.ones(2, 4))
        >>> r.requires_grad, fz.shape
        (True, torch.Size([2, 4]))
    """
    z = z.detach() if isinstance(z, torch.Tensor) else tuple(t.detach() for t in z)
    fz = f(z)
    num = sum((a - b).flatten(1).pow(2).sum(1) for a, b in zip(_as_list(fz), _as_list(z))).sqrt()
    den = sum(b.flatten(1).pow(2).sum(1) for b in _as_list(z)).sqrt().clamp_min(1e-6)
    return fz, (num / den).mean()


def mixed_init(like: _Tensors) -> _Tensors:
    """A random initial state shaped like `like`: each element is 0 or N(0, 1) with probability 1/2.

    Mixed initialization (Anil et al., 2022, "Path independent equilibrium models") trains DEQs to reach the
    same fixed point from different starts. Accepts a tensor or a tuple/list of tensors.
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(t) * torch.empty_like(t).bernoulli_(0.5)

    if isinstance(like, torch.Tensor):
        return one(like)
    return type(like)(one(t) for t in like)


class VariationalDropout(nn.Module):
    """Dropout whose mask is drawn once per forward and reused by every f call of that forward.

    Ordinary dropout would draw a new mask per f call, so f would change between solver steps and have no
    fixed point. Call `reset_dropout(model)` at the start of each forward to draw a fresh mask on the next
    call.
    `shared_dims` are dimensions over which one mask value is shared (e.g. (2, 3) drops whole channels of an
    image feature map, as the DEQ/MDEQ "VariationalHidDropout2d" does). Identity in eval mode or with p = 0.
    """

    def __init__(self, p: float = 0.0, shared_dims: Sequence[int] = ()):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.shared_dims = tuple(shared_dims)
        self.mask: torch.Tensor | None = None

    def reset_mask(self) -> None:
        self.mask = None

    def _draw(self, x: torch.Tensor) -> torch.Tensor:
        shape = list(x.shape)
        for d in self.shared_dims:
            shape[d] = 1
        keep = 1.0 - self.p
        return x.new_empty(shape).bernoulli_(keep) / keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        mask = self.mask
        wrong_shape = mask is not None and (
            mask.dim() != x.dim() or any(m not in (1, s) for m, s in zip(mask.shape, x.shape))
        )
        if mask is None or wrong_shape or mask.dtype != x.dtype or mask.device != x.device:
            mask = self.mask = self._draw(x)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}, shared_dims={self.shared_dims}"


def reset_dropout(model: nn.Module) -> None:
    """Make every VariationalDropout in `model` draw a new mask on its next call (once per forward)."""
    for m in model.modules():
        if isinstance(m, VariationalDropout):
            m.reset_mask()


# the weight w(n, k) of state k of n in `fp_correction`
FP_WEIGHTS: dict[str, Callable[..., float]] = {
    "exp": lambda n, k, gamma=0.8: gamma ** (n - k - 1),
    "linear": lambda n, k, gamma=0.9: 1.0 - (n - k - 1) / n * gamma,
    "const": lambda n, k, c=1.0: c,
}


def fp_correction(criterion: Callable[..., torch.Tensor], states: Sequence, *targets, weight: str = "exp",
                  return_losses: bool = False, **weight_kwargs):
    """Fixed-point correction loss (Bai et al., 2022): Σ_k w(n, k) · criterion(states[k], *targets).

    `states` is the list of intermediate predictions (e.g. a head applied to `stats.states`, see DEQConfig
    `n_states`/`state_indices`), ordered from first to last; the last gets weight 1 and earlier ones smaller
    weights: "exp" gives gamma^(n-k-1) (gamma=0.8), "linear" 1 - (n-k-1)/n·gamma, "const" c.
    Returns the total loss (and the list of per-state loss values if `return_losses`).

    Example:
        >>> import torch
        >>> from deqzoo.core.regularize import fp_correction
        >>> preds = [torch.zeros(3), torch.ones(3)]
        >>> round(float(fp_correction(torch.nn.functional.mse_loss, preds, torch.ones(3))), 6)
        0.8
    """
    if weight not in FP_WEIGHTS:
        raise ValueError(f"unknown weight {weight!r}; choose one of {sorted(FP_WEIGHTS)}")
    if len(states) == 0:
        raise ValueError("fp_correction needs at least one state")
    n = len(states)
    losses = [criterion(s, *targets) for s in states]
    total = sum(FP_WEIGHTS[weight](n, k, **weight_kwargs) * loss for k, loss in enumerate(losses))
    if return_losses:
        return total, [float(v.detach()) for v in losses]
    return total
