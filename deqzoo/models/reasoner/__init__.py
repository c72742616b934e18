"""Recursive reasoner family: TRM / HRM-style weight-tied cores over (x, answer y, latent z), deep
supervision, gradient modes (1-step, last cycle, full, DEQ via deqzoo.core) and per-sample halting."""

from .configuration_reasoner import ARCHITECTURES, GRAD_MODES, HALTING_RULES, ReasonerConfig, one_pass_twin
from .modeling_reasoner import (
    ReasonerBlock,
    ReasonerCarry,
    ReasonerForGridClassification,
    ReasonerGridOutput,
    ReasonerModel,
    ReasonerModelOutput,
    ReasonerNetwork,
    ReasonerPreTrainedModel,
    SegmentHalting,
    exact_solved,
    rms_norm,
)

__all__ = [
    "ARCHITECTURES", "GRAD_MODES", "HALTING_RULES", "ReasonerBlock", "ReasonerCarry", "ReasonerConfig",
    "ReasonerForGridClassification", "ReasonerGridOutput", "ReasonerModel", "ReasonerModelOutput",
    "ReasonerNetwork", "ReasonerPreTrainedModel", "SegmentHalting", "exact_solved", "one_pass_twin",
    "rms_norm",
]
