"""Backward modes: how gradients reach f's parameters and inputs from the fixed point.

A mode is `fn(f, z_star, packer, config) -> z` where z equals z_star in value and carries the gradient graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .solvers import get_solver
from .state import StatePacker

BACKWARD_MODES: dict[str, Callable] = {}


def register_backward(name: str):
    """Register a backward mode under `name` (decorator)."""

    def deco(fn):
        BACKWARD_MODES[name] = fn
        return fn

    return deco


@register_backward("ift")
def ift(f, z_star, packer: StatePacker, config):
    """Implicit differentiation: the incoming gradient g is replaced by y solving y = J_f^T y + g."""
    x = packer.flatten(z_star).detach().requires_grad_()
    fx = packer.flatten(f(packer.unflatten(x)))
    solver = get_solver(config.b_solver)
    busy = False

    def hook(grad: torch.Tensor) -> torch.Tensor:
        nonlocal busy
        if busy:  # the vector-Jacobian products below pass through fx too
            return grad
        busy = True
        try:
            def vjp_step(y: torch.Tensor) -> torch.Tensor:
                return torch.autograd.grad(fx, x, y, retain_graph=True)[0] + grad

            y, _ = solver(vjp_step, grad.detach(), max_iter=config.b_max_iter, tol=config.b_tol,
                          stop_mode=config.b_stop_mode, **config.b_solver_kwargs)
        finally:
            busy = False
        return y

    fx.register_hook(hook)
    return packer.unflatten(fx)


@register_backward("jacobian_free")
def jacobian_free(f, z_star, packer: StatePacker, config):
    """Jacobian-free backprop (Fung et al.): one differentiable step from the fixed point."""
    return f(packer.unflatten(packer.flatten(z_star).detach()))
