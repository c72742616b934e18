"""Initialisation shared by the families' ``_init_weights``, drawn with transformers' guarded functions.

transformers' ``initialization`` functions leave a tensor that was loaded (flagged ``_is_hf_initialized``)
untouched, so a model materialised from the meta device with missing weights draws exactly those, as a model
built directly draws all of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init


def default_init_(module: nn.Module) -> None:
    """PyTorch's own initialisation of a Linear or Conv layer: kaiming-uniform(a=√5) weight, bias
    U(±1/sqrt(fan_in)). Under weight norm (`deqzoo.core.norm`) the direction v gets the draw and g its norm
    per output, as attaching the norm to a freshly built layer gives."""
    weight = module._parameters.get("weight", module._parameters.get("weight_v"))
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if module.bias is not None:
        bound = 1 / math.sqrt(weight[0].numel())
        init.uniform_(module.bias, -bound, bound)
    if "weight_g" in module._parameters:
        dims = tuple(range(1, weight.dim()))
        init.copy_(module.weight_g, torch.linalg.vector_norm(weight, dim=dims, keepdim=True))

