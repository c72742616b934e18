"""Implicit² family: implicit SIREN / Fourier / Gabor MFN representations and their explicit baselines."""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="implicit2",
    config=f"{_P}.configuration_implicit2:Implicit2Config",
    models={"AutoModel": f"{_P}.modeling_implicit2:Implicit2Model"},
    # no Auto class for coordinate-to-signal networks: heads found by config.architectures
    heads={"Implicit2ForSignalRepresentation": f"{_P}.modeling_implicit2:Implicit2ForSignalRepresentation"},
    architectures=f"{_P}.configuration_implicit2:ARCHITECTURES",
    names=("implicit2-isiren-camera", "implicit2-igabor-mfn-camera"),
    app=("implicit2-isiren-camera", "implicit2-igabor-mfn-camera"),
    task="implicit2",
    export={"Implicit2ForSignalRepresentation": "signal"},
)

_EXPORTS = {
    "ARCHITECTURES": ".configuration_implicit2", "Implicit2Config": ".configuration_implicit2",
    **{name: ".modeling_implicit2" for name in (
        "Implicit2Filter", "Implicit2ForSignalRepresentation", "Implicit2Layer", "Implicit2Model",
        "Implicit2ModelOutput", "Implicit2Output", "Implicit2PreTrainedModel", "coordinate_grid")},
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
