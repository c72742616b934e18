"""DEQ-Flow family: deep equilibrium optical flow on torchvision's RAFT blocks, and its explicit RAFT twin."""

from .configuration_deq_flow import ARCHITECTURES, DEQFlowConfig
from .modeling_deq_flow import (
    REUSE_MODES,
    DEQFlowForOpticalFlow,
    DEQFlowModel,
    DEQFlowOutput,
    DEQFlowPreTrainedModel,
    forward_interpolate,
    prepare_images,
    sequence_loss,
    unpad,
    warp,
)
from .training import two_stage_backward

__all__ = [
    "ARCHITECTURES", "DEQFlowConfig", "DEQFlowForOpticalFlow", "DEQFlowModel", "DEQFlowOutput",
    "DEQFlowPreTrainedModel", "REUSE_MODES", "forward_interpolate", "prepare_images", "sequence_loss",
    "two_stage_backward", "unpad", "warp",
]
