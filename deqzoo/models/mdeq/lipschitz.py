"""Lipschitz MDEQ (Sato & Iiduka, "Lipschitz Multiscale Deep Equilibrium Models", AISTATS 2026): the pieces
whose Lipschitz constants compose into a bound on f_θ, the bound, and the projection that keeps it true.

Pieces (all used by ``MDEQConfig(lipschitz=True)``):

* :class:`MeanOnlyGroupNorm`: ``γ ⊙ (x - mean_group(x)) + β`` with ``|γ| <= γ̄``. Without the division by the
  standard deviation it is affine in x; subtracting the group mean is an orthogonal projection (norm <= 1) and
  the per-channel scale adds at most γ̄, so its Lipschitz constant is <= γ̄.
* :class:`ScaledReLU`: ``a · ReLU(x)``, Lipschitz constant a.
* convolutions whose operator norm (as maps between feature maps, not the norm of the reshaped kernel) is at
  most c, kept so by :func:`project_lipschitz` after each optimizer step (for the transformers Trainer,
  ``deqzoo.models.mdeq.LipschitzProjectionCallback``). The norm is computed exactly for the circular
  convolution on an N x N torus by FFT (max over frequencies of the largest singular value of the kernel's
  transfer matrix). A zero-padded convolution on an H x W map with H, W <= N - kernel + 1 is that circular
  convolution applied to a zero-padded embedding and then cropped (both of norm <= 1), and a
  stride-2 convolution is the stride-1 one followed by
  subsampling (norm <= 1), so the FFT value bounds all of them.
* variational dropout with rate p: the fixed mask scales kept channels by 1/(1-p), Lipschitz <= 1/(1-p) (1 in
  eval mode, where dropout is the identity, so the bound below also holds at inference).
* :class:`IsometricUpsample`: nearest upsampling by s = 2^k divided by s, an isometry.

Derivation of :func:`lipschitz_bound` (Euclidean norm over all resolutions' states together), with the unit
``σ∘GN∘conv`` of Lipschitz constant acγ̄:

1. Residual block of stream i: ``b_i = α₁ z_i + (1-α₁) σ(GN₂(drop(conv₂(σ(GN₁(conv₁ z_i)))) + u_i))``. The
   injection u_i does not depend on z, so the branch has constant (acγ̄)²/(1-p) and the convex residual gives
   ``L_block = α₁ + (1-α₁)·a²c²γ̄²/(1-p)``.
2. Transitions between streams: downsampling by k levels is k units with stride-2 convs; upsampling is one
   unit with a 1x1 conv followed by the isometric upsample. Every transition T_ij therefore has Lipschitz
   constant at most ``L_T = max_{1<=k<=n-1} (acγ̄)^k = max(acγ̄, (acγ̄)^(n-1))``.
3. Softmax-weighted fusion: ``z'_i = (1-α₂) b_i + α₂ Σ_{j≠i} π_ij T_ij(b_j)``, π_i = softmax of learned
   logits (each row of π sums to 1). Then ``||Δz'|| <= (1-α₂)||Δb|| + α₂·L_T·||Π||₂·||Δb||``, and for a
   row-stochastic Π with zero diagonal ``||Π||₂ <= sqrt(||Π||₁·||Π||_∞) <= sqrt(n-1)`` (attained when every
   row puts its mass on one stream). So ``L_fuse = (1-α₂) + α₂·sqrt(n-1)·L_T`` (1 when n = 1).
4. ``Lip(f_θ) <= L_block · L_fuse``. The paper's example (α₁=0.5, α₂=0.3, c=2, γ̄=1, a=0.35, n=4, p=0.3)
   gives 0.85 · 1.0637 = 0.904 < 1, so f_θ is a contraction and fixed-point iteration converges linearly
   (the paper reports 0.86 for its own accounting of the same pieces).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IsometricUpsample", "MeanOnlyGroupNorm", "ScaledReLU",
    "conv_operator_norm", "lipschitz_bound", "project_lipschitz",
]


def lipschitz_bound(alpha1: float, alpha2: float, conv_norm: float, gamma_bound: float, relu_slope: float,
                    num_branches: int, dropout: float) -> float:
    """Upper bound on the Lipschitz constant of the Lipschitz-MDEQ layer f_θ (see the module docstring).

    Args:
        alpha1: convex residual weight α₁ of the blocks.
        alpha2: weight α₂ of the other resolutions in the softmax-weighted fusion.
        conv_norm: c, bound on every convolution's operator norm.
        gamma_bound: γ̄, bound on the mean-only GroupNorm scales.
        relu_slope: a, slope of the scaled ReLU.
        num_branches: n, number of resolutions.
        dropout: p, variational dropout rate inside the blocks.

    Example:
        >>> from deqzoo.models.mdeq import lipschitz_bound
        >>> round(lipschitz_bound(0.5, 0.3, 2.0, 1.0, 0.35, 4, 0.3), 3)
        0.904
    """
    checks = {
        "alpha1": 0 <= alpha1 <= 1,
        "alpha2": 0 <= alpha2 <= 1,
        "conv_norm": conv_norm > 0,
        "gamma_bound": gamma_bound > 0,
        "relu_slope": relu_slope > 0,
        "num_branches": num_branches >= 1,
        "dropout": 0 <= dropout < 1,
    }
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"lipschitz_bound: {name}={locals()[name]!r} is out of range")
    unit = relu_slope * conv_norm * gamma_bound  # σ∘GN∘conv
    l_block = alpha1 + (1 - alpha1) * unit**2 / (1 - dropout)
    if num_branches == 1:
        return float(l_block)
    l_transition = max(unit, unit ** (num_branches - 1))
    l_fuse = (1 - alpha2) + alpha2 * math.sqrt(num_branches - 1) * l_transition
    return float(l_block * l_fuse)


class ScaledReLU(nn.Module):
    """a · ReLU(x), Lipschitz constant a."""

    def __init__(self, slope: float = 1.0):
        super().__init__()
        self.slope = float(slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.slope * F.relu(x)

    def extra_repr(self) -> str:
        return f"slope={self.slope}"


class MeanOnlyGroupNorm(nn.Module):
    """GroupNorm without variance division, with |γ| <= γ̄ (clamped in forward and by the projection)."""

    def __init__(self, num_groups: int, num_channels: int, gamma_bound: float = 1.0):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_channels={num_channels} is not divisible by num_groups={num_groups}")
        self.num_groups, self.num_channels, self.gamma_bound = num_groups, num_channels, float(gamma_bound)
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        g = x.reshape(b, self.num_groups, -1)
        x = (g - g.mean(dim=-1, keepdim=True)).reshape(x.shape)
        shape = (1, c) + (1,) * (x.dim() - 2)
        gamma = self.weight.clamp(-self.gamma_bound, self.gamma_bound)
        return x * gamma.reshape(shape) + self.bias.reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, gamma_bound={self.gamma_bound}"


class IsometricUpsample(nn.Module):
    """Nearest upsampling to `size` divided by the scale factor: ||up(x)|| = ||x|| for integer scales."""

    def __init__(self, scale_factor: int):
        super().__init__()
        self.scale_factor = int(scale_factor)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        size = size or (x.shape[-2] * self.scale_factor, x.shape[-1] * self.scale_factor)
        return F.interpolate(x, size=size, mode="nearest") / self.scale_factor


@torch.no_grad()
def conv_operator_norm(weight: torch.Tensor, fft_size: int = 64) -> float:
    """Operator norm (largest singular value) of the stride-1 circular 2-D convolution with `weight` on an
    ``fft_size`` x ``fft_size`` torus; it bounds the zero-padded and strided convolutions on maps up to
    ``fft_size - kernel + 1`` pixels (see module docstring).

    Example:
        >>> import torch
        >>> w = torch.zeros(1, 1, 3, 3); w[0, 0, 1, 1] = 2.0   # 2 x identity
        >>> round(conv_operator_norm(w, 16), 4)
        2.0
    """
    out_c, in_c, kh, kw = weight.shape
    if fft_size < max(kh, kw):
        raise ValueError(f"fft_size={fft_size} is smaller than the kernel {kh}x{kw}")
    w = weight.detach().to(torch.float64)
    transfer = torch.fft.fft2(w, s=(fft_size, fft_size))  # (out, in, N, N)
    mats = transfer.permute(2, 3, 0, 1).reshape(-1, out_c, in_c)
    return float(torch.linalg.matrix_norm(mats, ord=2).max())


def _lipschitz_convs(model: nn.Module):
    for mod in model.modules():
        if getattr(mod, "_deqzoo_lipschitz_conv", False) and isinstance(mod, nn.Conv2d):
            yield mod


@torch.no_grad()
def project_lipschitz(model: nn.Module) -> dict[str, float]:
    """Project f_θ's parameters back onto the Lipschitz constraints: every marked conv's operator norm <= c
    (rescale     the kernel) and every mean-only GroupNorm's |γ| <= γ̄ (clamp). Call after each optimizer step.

    The constants are the model config's (``conv_norm``, ``gamma_bound``, ``spectral_fft_size``). Returns the
    largest conv norm before projection and the number of projected convs.

    Example:
        >>> import deqzoo
        >>> model = deqzoo.create_model("lipschitz-mdeq-tiny-mnist")
        >>> stats = project_lipschitz(model)
        >>> stats["max_conv_norm_after"] <= model.config.conv_norm * (1 + 1e-6)
        True
    """
    c, g, n = model.config.conv_norm, model.config.gamma_bound, model.config.spectral_fft_size
    before, after, projected = 0.0, 0.0, 0
    for conv in _lipschitz_convs(model):
        if conv.weight.device.type == "meta":
            continue
        sigma = conv_operator_norm(conv.weight, n)
        before = max(before, sigma)
        if sigma > c:
            conv.weight.mul_(c / sigma)
            projected += 1
            sigma = c
        after = max(after, sigma)
    for mod in model.modules():
        if isinstance(mod, MeanOnlyGroupNorm) and mod.weight.device.type != "meta":
            mod.weight.clamp_(-g, g)
    return {"max_conv_norm_before": before, "max_conv_norm_after": after, "projected": float(projected)}
