"""DEQ-Flow family: deep equilibrium optical flow on torchvision's RAFT blocks, and its explicit RAFT twin."""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="deq_flow",
    config=f"{_P}.configuration_deq_flow:DEQFlowConfig",
    models={"AutoModel": f"{_P}.modeling_deq_flow:DEQFlowModel"},
    # no Auto class for optical flow: the head is found by config.architectures
    heads={"DEQFlowForOpticalFlow": f"{_P}.modeling_deq_flow:DEQFlowForOpticalFlow"},
    architectures=f"{_P}.configuration_deq_flow:ARCHITECTURES",
    names=("deq-flow-cpu-synth", "deq-flow-cpu-raft-baseline", "deq-flow-cpu-synth-20k",
           "deq-flow-cpu-raft-baseline-20k"),
    app=("deq-flow-cpu-synth",),  # the app's flow tab compares solves: DEQ-Flow, not the explicit twin
    task="flow",
    extra="vision",  # torchvision's RAFT blocks
    requires=("torchvision",),
    export="its solve reuses frame-to-frame state and its padding, correlation pyramid and convex "
           "upsampling are not checked for a dynamic image size or batch",
)

_EXPORTS = {
    "ARCHITECTURES": ".configuration_deq_flow", "DEQFlowConfig": ".configuration_deq_flow",
    "two_stage_backward": ".training",
    **{name: ".modeling_deq_flow" for name in (
        "REUSE_MODES", "DEQFlowForOpticalFlow", "DEQFlowModel", "DEQFlowOutput", "DEQFlowPreTrainedModel",
        "forward_interpolate", "prepare_images", "sequence_loss", "unpad", "warp")},
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
