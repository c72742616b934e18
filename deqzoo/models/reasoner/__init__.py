"""Recursive reasoner family: TRM / HRM-style weight-tied cores over (x, answer y, latent z), deep
supervision, gradient modes (1-step, last cycle, full, DEQ via deqzoo.core) and per-sample halting."""

import importlib

from ..registry import Family

_P = __name__
FAMILY = Family(
    model_type="reasoner",
    config=f"{_P}.configuration_reasoner:ReasonerConfig",
    models={"AutoModel": f"{_P}.modeling_reasoner:ReasonerModel"},
    # no Auto class for grid classification with a halting head: the head is found by config.architectures
    heads={"ReasonerForGridClassification": f"{_P}.modeling_reasoner:ReasonerForGridClassification"},
    architectures=f"{_P}.configuration_reasoner:ARCHITECTURES",
    export="its per-sample halting changes the batch between segments; not checked for tracing",
)

_EXPORTS = {
    **{name: ".configuration_reasoner" for name in (
        "ARCHITECTURES", "GRAD_MODES", "HALTING_RULES", "ReasonerConfig", "one_pass_twin")},
    **{name: ".modeling_reasoner" for name in (
        "ReasonerBlock", "ReasonerCarry", "ReasonerForGridClassification", "ReasonerGridOutput",
        "ReasonerModel", "ReasonerModelOutput", "ReasonerNetwork", "ReasonerPreTrainedModel",
        "SegmentHalting", "exact_solved", "rms_norm")},
}


def __getattr__(name: str):  # the family's modules are imported on first use: its declaration costs nothing
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["FAMILY", *_EXPORTS]
