"""HyperAnderson (Bai, Koltun & Kolter, "Neural Deep Equilibrium Solvers", ICLR 2022): Anderson's update with
the mixing weights α and the step β predicted by a small learned network instead of a least-squares solve.

The engine knows nothing about the network except two calls (`HyperNet`): ``compress(g)`` maps a flat residual
(B, D) to a few features (B, c), once per step; ``mix(C)`` maps the compressed residuals of the window, oldest
first (B, n, c) with n <= m + 1, to raw weights α̂ (B, n) and steps β (B,). Family-specific compressors and the
trained networks live in `deqzoo.hypersolver`, so core still imports no model.

One step (`step`), shared by the registered solver (`deqzoo.core.solvers.hyperanderson`: no autograd,
preallocated ring buffers) and by the differentiable unroll that trains the network (`unroll` in the
repository's examples/hypersolver/_problems.py):

* α = α̂ + (1 - 1ᵀα̂) / n  (`normalize_alpha`: the weights sum to one, as Anderson's do);
* ``form="anderson"``: z⁺ = Σ_i α_i (z_i + β g_i), the Anderson-consistent update: with α from Anderson's
  least squares and β = 1 it is Anderson's iterate Σ_i α_i f(z_i);
* ``form="simplified"``: z⁺ = β Σ_i g_i + Σ_i α_i z_i, the update as printed in the paper.

``base="none"`` is the paper's method: α̂ comes from the network alone. ``base="anderson"`` (an extension) adds
the network's output to Anderson's own least-squares weights (from the window's Gram matrix, kept one row per
step as Anderson does): α̂ = α_LS + δ. A network whose δ is 0 and β is 1 is then exactly Anderson, so
training only has to learn corrections and the step size.

Example:
    >>> import torch
    >>> from deqzoo.core import solve
    >>> from deqzoo.core.hyper import MeanPoolNet
    >>> A = 0.5 * torch.eye(4); b = torch.ones(2, 4)
    >>> z, stats = solve(lambda z: z @ A + b, torch.zeros(2, 4), solver="hyperanderson",
    ...                  max_iter=60, tol=1e-5, net=MeanPoolNet(), m=0)
    >>> stats.solver, bool(stats.converged.all()), torch.allclose(z, 2 * b, atol=1e-4)
    ('hyperanderson', True, True)
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

__all__ = [
    "BASES",
    "FORMS",
    "HyperNet",
    "least_squares_alpha",
    "MeanPoolNet",
    "hyper_update",
    "normalize_alpha",
    "step",
]

FORMS = ("anderson", "simplified")
BASES = ("none", "anderson")
LAM = 1e-5  # Anderson's relative regularization of the Gram matrix (as `deqzoo.core.solvers.anderson`)


class HyperNet(Protocol):
    """What the engine needs from a learned mixer (see the module docstring)."""

    def compress(self, g: torch.Tensor) -> torch.Tensor: ...

    def mix(self, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class MeanPoolNet:
    """A parameter-free HyperNet: equal weights over the window and β = `beta` (a reference and a doctest
    helper; with m = 0 windows it is damped fixed-point iteration)."""

    def __init__(self, beta: float = 1.0, bins: int = 4):
        self.beta, self.bins = beta, bins

    def compress(self, g: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool1d(g[:, None], self.bins)[:, 0]

    def mix(self, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = C.shape
        return C.new_full((b, n), 1.0 / n), C.new_full((b,), self.beta)


def normalize_alpha(alpha_hat: torch.Tensor) -> torch.Tensor:
    """α = α̂ + (1 - 1ᵀα̂)/n over the last dimension (n weights): the result sums to one.

    Example:
        >>> round(normalize_alpha(torch.tensor([[0.2, 0.2, 0.2]])).sum().item(), 6)
        1.0
    """
    n = alpha_hat.shape[-1]
    return alpha_hat + (1.0 - alpha_hat.sum(-1, keepdim=True)) / n


def hyper_update(X: torch.Tensor, G: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                 form: str = "anderson") -> torch.Tensor:
    """The next iterate from iterates X (B, n, D), residuals G = f(X) - X (B, n, D), normalized weights
    alpha (B, n) and steps beta (B,); `form` as in the module docstring. Two batched products into one
    output, no (B, n, D) temporary."""
    if form not in FORMS:
        raise ValueError(f"HyperAnderson form must be one of {FORMS}, got {form!r}")
    a = alpha.unsqueeze(1)
    # one output buffer, accumulated in place (two separate products and a sum allocate three large tensors)
    w_g = a * beta[:, None, None] if form == "anderson" else beta[:, None, None].expand_as(a)
    out = torch.bmm(a, X)
    return out.baddbmm_(w_g, G).squeeze(1)  # bmm's backward does not need its output: in place is safe


def least_squares_alpha(H: torch.Tensor, lam: float = LAM) -> torch.Tensor:
    """Anderson's weights from the Gram matrix H (B, n, n) of the window's residuals: (H + reg I) a = 1,
    α = a / 1ᵀa, reg = lam · max_j H_jj (float64). A sample whose system fails gets NaN (caller falls back).

    Example:
        >>> G = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]], dtype=torch.float64)
        >>> least_squares_alpha(G @ G.transpose(1, 2)).tolist()
        [[0.5, 0.5]]
    """
    A = H.to(torch.float64, copy=True)
    reg = lam * A.diagonal(dim1=1, dim2=2).amax(1) + 1e-300
    A.diagonal(dim1=1, dim2=2).add_(reg[:, None])  # H + reg I, as a sum with the identity rounds
    # a non-finite Gram entry comes with a non-finite diagonal one (|g_i·g_j| <= max(|g_i|², |g_j|²)), hence a
    # non-finite reg; such a system is factorised anyway (cholesky_ex never raises) and its row marked below
    L, info = torch.linalg.cholesky_ex(A)
    a = torch.cholesky_solve(A.new_ones(A.shape[0], A.shape[1], 1), L)[:, :, 0]
    alpha = a / a.sum(1, keepdim=True)
    good = (reg < math.inf) & (info == 0)  # reg >= 0: `< inf` is isfinite in one op
    return alpha.masked_fill_(~good[:, None], math.nan)


def step(net: HyperNet, X: torch.Tensor, G: torch.Tensor, C: torch.Tensor, order: torch.Tensor,
         form: str = "anderson", H: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One HyperAnderson step, the solver's and the unroll's: the next iterate from the window's iterates X
    and residuals G = f(X) - X (B, n, D), their compressed residuals C (B, n, c) and, for ``base="anderson"``,
    their Gram matrix H (B, n, n), all stored in slot order; `order` (n,) lists the slots oldest first.
    Returns (next iterate, α (B, n) oldest first, β (B,)). α and β are the network's (plus Anderson's
    least-squares weights from H when given), in the state's dtype and on its device; a sample whose α or β is
    not finite takes a plain fixed-point step from the newest iterate, as Anderson does on a failed system."""
    C = C.index_select(1, order)
    alpha_hat, beta = net.mix(C)
    b, n = C.shape[:2]
    if tuple(alpha_hat.shape) != (b, n) or tuple(beta.shape) != (b,):
        raise ValueError(
            f"hypersolver network returned alpha {tuple(alpha_hat.shape)} and beta "
            f"{tuple(beta.shape)}, expected ({b}, {n}) and ({b},)"
        )
    alpha_hat, beta = alpha_hat.to(X.device), beta.to(X.device, X.dtype)  # the network may live elsewhere
    if H is not None:
        alpha_hat = least_squares_alpha(H[:, order][:, :, order]).to(alpha_hat.dtype) + alpha_hat
    alpha = normalize_alpha(alpha_hat.to(X.dtype))
    # unconditional torch.where: no host sync per step on an accelerator to ask whether any sample failed
    ok = torch.isfinite(alpha).all(1) & torch.isfinite(beta)
    newest = torch.zeros_like(alpha)
    newest[:, -1] = 1.0
    alpha = torch.where(ok[:, None], alpha, newest)
    beta = torch.where(ok, beta, torch.ones_like(beta))
    return hyper_update(X, G, alpha.index_select(1, torch.argsort(order)), beta, form), alpha, beta
