"""Implicit² family: implicit SIREN / Fourier / Gabor MFN representations and their explicit baselines."""

from .configuration_implicit2 import ARCHITECTURES, Implicit2Config
from .modeling_implicit2 import (
    Implicit2Filter,
    Implicit2ForSignalRepresentation,
    Implicit2Layer,
    Implicit2Model,
    Implicit2ModelOutput,
    Implicit2Output,
    Implicit2PreTrainedModel,
    coordinate_grid,
)

__all__ = [
    "ARCHITECTURES", "Implicit2Config", "Implicit2Filter", "Implicit2ForSignalRepresentation",
    "Implicit2Layer", "Implicit2Model", "Implicit2ModelOutput", "Implicit2Output", "Implicit2PreTrainedModel",
    "coordinate_grid",
]
