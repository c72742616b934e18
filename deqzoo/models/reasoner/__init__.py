"""Recursive reasoner family: TRM / HRM-style weight-tied cores over (x, answer y, latent z), deep
supervision, gradient modes (1-step, last cycle, full, DEQ via deqzoo.core) and per-sample halting."""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="reasoner",
    config=f"{_P}.configuration_reasoner:ReasonerConfig",
    models={"AutoModel": f"{_P}.modeling_reasoner:ReasonerModel"},
    # no Auto class for grid classification with a halting head: the head is found by config.architectures
    heads={"ReasonerForGridClassification": f"{_P}.modeling_reasoner:ReasonerForGridClassification"},
    architectures=f"{_P}.configuration_reasoner:ARCHITECTURES",
    names=("trm-sudoku6", "trm-sudoku6-twin"),
    app=("trm-sudoku6",),  # the app's reasoner tab runs the reasoner, not its twin
    export="its per-sample halting changes the batch between segments; not checked for tracing",
)

_EXPORTS = {
    **{name: ".configuration_reasoner" for name in (
        "ARCHITECTURES", "GRAD_MODES", "HALTING_RULES", "ReasonerConfig", "grid_groups", "one_pass_twin")},
    **{name: ".modeling_reasoner" for name in (
        "GroupMixer", "ReasonerBlock", "ReasonerCarry", "ReasonerForGridClassification", "ReasonerGridOutput",
        "ReasonerModel", "ReasonerModelOutput", "ReasonerNetwork", "ReasonerPreTrainedModel",
        "SegmentHalting", "SegmentOutputs", "exact_solved", "rms_norm")},
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
