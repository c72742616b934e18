"""MDEQ family: multiscale deep equilibrium models (Bai et al. 2020) and Lipschitz MDEQ (Sato & Iiduka).

Example:
    >>> from deqzoo.models.mdeq import lipschitz_bound
    >>> round(lipschitz_bound(0.5, 0.3, 2.0, 1.0, 0.35, 4, 0.3), 2)
    0.9
"""

from .configuration_mdeq import ARCHITECTURES, MDEQConfig
from .lipschitz import conv_operator_norm, lipschitz_bound, project_lipschitz
from .modeling_mdeq import (
    MDEQForImageClassification,
    MDEQForSemanticSegmentation,
    MDEQModel,
    MDEQPreTrainedModel,
)

__all__ = [
    "ARCHITECTURES", "LipschitzProjectionCallback", "MDEQConfig", "MDEQForImageClassification",
    "MDEQForSemanticSegmentation", "MDEQModel", "MDEQPreTrainedModel", "conv_operator_norm",
    "lipschitz_bound", "project_lipschitz",
]


def __getattr__(name: str):  # the Trainer callback's module imports transformers' Trainer: only on first use
    if name == "LipschitzProjectionCallback":
        from .lipschitz_callback import LipschitzProjectionCallback

        return LipschitzProjectionCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
