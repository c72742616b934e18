"""DEQ-Flow configuration: RAFT's update operator solved for its fixed point over (hidden state, flow).

Bai, Geng, Savani & Kolter, "Deep Equilibrium Optical Flow Estimation", CVPR 2022 (locuslab/deq-flow).
The blocks are torchvision's RAFT blocks (`torchvision.models.optical_flow.raft`): a feature encoder (instance
norm) for both frames, a context encoder for the first frame, the all-pairs correlation pyramid, a motion
encoder, a separable ConvGRU (1x5 then 5x1), a flow head and the convex-upsampling mask predictor. As in the
original DEQ-Flow, the context encoder outputs only the context (the hidden state starts at zero, not at tanh
of a split) and f_θ(h, flow) = (GRU(h, [context, motion(flow, corr(flow))]), flow + Δflow(h')).

``implicit=False`` is the explicit RAFT baseline with the very same blocks (same parameter count): the update
block unrolled ``num_flow_updates`` times from zero, every iterate supervised (RAFT's sequence loss).
"""

from typing import Any, Literal

from ...configuration_utils import ConfigError, DEQPretrainedConfig, preset, ranged, strict_config

_Norm = Literal["instance", "batch", "group", "none"]

# how `estimate_sequence` starts each solve from the previous pair's fixed point (hidden h, 1/8 flow):
REUSE_MODES = {
    # the previous fixed point as it is
    "fixed_point": "previous (h, flow) as is",
    # the original DEQ-Flow's `fixed_point_reuse` (evaluate.py): h as is, flow forward-interpolated
    "forward_interpolate": "previous h, previous flow forward-interpolated",
    # RAFT's `warm_start` (and DEQ-Flow's): h from zero, flow forward-interpolated
    "warm_start": "h = 0, previous flow forward-interpolated",
    # motion-compensated: the whole state moves with the content it describes. Typical motions are below
    # one cell of the 1/8-resolution state, where nearest-neighbour splatting moves nothing; bilinear
    # backward warping moves the state by the fraction of a cell the content moved
    "warp": "previous (h, flow) warped bilinearly along the forward-interpolated flow",
}
DEFAULT_REUSE = "warp"  # DEQFlowConfig.sequence_reuse's default: what reuse=True does unless a config says
# DEQFlowConfig.sequence_reuse: a reuse mode, or "none" (every pair of a video solved from zero)
SEQUENCE_REUSE = (*REUSE_MODES, "none")
_Reuse = Literal[SEQUENCE_REUSE]
_Widths = list[int] | tuple[int, ...]

# The original's CPU-free recipe, adapted: plain fixed-point iteration (its naive_solver), a one-step phantom
# gradient (its --phantom_grad 1, tau 1) and fixed-point correction states (its --n_losses).
DEFAULT_DEQ: dict[str, Any] = {"f_solver": "fixed_point", "f_max_iter": 24, "f_tol": 1e-3,
                               "f_stop_mode": "rel", "b_mode": "phantom",
                               "b_mode_kwargs": {"k": 1, "tau": 1.0, "variant": "upg"}, "n_states": 3}


@strict_config
class DEQFlowConfig(DEQPretrainedConfig):
    """Configuration of a DEQ-Flow (or explicit RAFT) optical-flow model.

    Args:
        encoder_layers: widths of the encoders' stem and three residual stages (the original: 64, 64, 96,
        128). feature_dim: feature-encoder output channels (correlation features; original 256, tiny 64).
        context_dim: context-encoder output channels (original: equal to hidden_dim).
        hidden_dim: ConvGRU hidden state channels.
        feature_norm, context_norm: "instance", "batch", "group" or "none" (original: instance, batch).
        corr_levels, corr_radius: correlation pyramid levels and lookup radius (original 4, 4).
        motion_corr_layers, motion_flow_layers: motion encoder widths (original B: (256, 192), (128, 64)).
        motion_dim: motion encoder output channels including the 2 flow channels (original B: 128).
        flow_head_dim: flow head hidden width (original: 2 * motion_dim).
        mask_dim: mask predictor hidden width (original 256); 0 upsamples bilinearly instead of convexly.
        gma: global motion aggregation (the original's --gma): attention over the context features aggregates
            the motion features, which the GRU reads beside the local ones.
        weight_norm: weight-normalise the update block (the original's --wnorm), reset once per forward.
        detach_flow_input: f reads the flow through a detached copy (RAFT's ``coords1.detach()``, the
            original's default; False is its --all_grad).
        implicit: DEQ-Flow (True) or the explicit RAFT baseline (False).
        num_flow_updates: update iterations of the explicit baseline (RAFT: 12); unused when implicit.
        jac_loss_weight: weight of the engine's Jacobian regularizer (``deq={"jac_reg_samples": k}``) added to
            the training loss (0: off; Bai et al., 2021); only DEQ-Flow (implicit) has one.
        residual_loss_weight: weight of the equilibrium residual ||f(z) - z|| / ||z|| at the solve's output z
            (held fixed: only f learns to map it onto itself) added to the training loss; 0: off.
        flow_residual_weight: weight of the flow part alone of that residual, the mean |Δflow| f would
            still add at the output, in full-resolution pixels (the flow's drift per step); 0: off.
        sequence_reuse: what ``estimate_sequence(frames, reuse=True)`` (its default) and ``deqzoo predict``
            on a folder of frames do between pairs: one of ``REUSE_MODES`` ("warp": the previous state warped
            along the flow), or "none" (every pair from zero) for a checkpoint whose flow depends on where
            its solve starts, which its card's reuse bench shows.
        deq: solver settings (DEQConfig dict); defaults follow the original (see DEFAULT_DEQ).

    Example:
        >>> from deqzoo.models.deq_flow import DEQFlowConfig
        >>> cfg = DEQFlowConfig()
        >>> cfg.model_type, cfg.hidden_dim, cfg.deq_config.b_mode
        ('deq_flow', 128, 'phantom')
    """

    model_type = "deq_flow"
    attribute_map = {"hidden_size": "hidden_dim"}  # the name ecosystem tools read: the ConvGRU state width
    default_deq = DEFAULT_DEQ

    encoder_layers: _Widths = ranged(1, 4096, default=(64, 64, 96, 128))
    feature_dim: int = ranged(1, 4096, default=256)
    context_dim: int = ranged(1, 4096, default=128)
    hidden_dim: int = ranged(1, 4096, default=128)
    feature_norm: _Norm = "instance"
    context_norm: _Norm = "batch"
    corr_levels: int = ranged(1, 6, default=4)
    corr_radius: int = ranged(0, 16, default=4)
    motion_corr_layers: _Widths = ranged(1, 4096, default=(256, 192))
    motion_flow_layers: _Widths = ranged(1, 4096, default=(128, 64))
    motion_dim: int = ranged(3, 4096, default=128)
    flow_head_dim: int = ranged(1, 4096, default=256)
    mask_dim: int = ranged(0, 4096, default=256)
    gma: bool = False
    weight_norm: bool = False
    detach_flow_input: bool = True
    implicit: bool = True
    num_flow_updates: int = ranged(1, 1000, default=12)
    jac_loss_weight: float | int = ranged(0.0, None, default=0.0, as_float=True)
    residual_loss_weight: float | int = ranged(0.0, None, default=0.0, as_float=True)
    flow_residual_weight: float | int = ranged(0.0, None, default=0.0, as_float=True)
    sequence_reuse: _Reuse = DEFAULT_REUSE

    def __post_init__(self, **kwargs: Any) -> None:
        for key in ("encoder_layers", "motion_corr_layers", "motion_flow_layers"):
            setattr(self, key, list(getattr(self, key)))
        super().__post_init__(**kwargs)

    def validate_layers(self) -> None:
        """The encoders have a stem and three stages; the motion encoder one or two correlation layers and
        two flow layers."""
        for key, low, high in (("encoder_layers", 4, 4), ("motion_corr_layers", 1, 2),
                               ("motion_flow_layers", 2, 2)):
            if not low <= len(getattr(self, key)) <= high:
                raise ConfigError(f"key {key!r} must be a list of {low} to {high} integers, got "
                                  f"{getattr(self, key)!r}")

    @property
    def min_image_size(self) -> int:
        """Smallest padded input side: the coarsest correlation level keeps 2 cells (torchvision's check)."""
        return 8 * 2 * 2 ** (self.corr_levels - 1)


_TASK = "optical-flow"


def _upstream(size: str, what: str, gma: bool = False) -> dict[str, Any]:
    """The original's presets (locuslab/deq-flow code.v.2.0 core/deq_flow.py and update.py)."""
    if size == "tiny":
        dims = {"feature_dim": 64, "hidden_dim": 32, "context_dim": 32, "motion_corr_layers": [64, 48],
                "motion_flow_layers": [32, 16], "motion_dim": 32, "flow_head_dim": 64}
    else:
        extra = {"B": 0, "H": 128}[size]
        dims = {"feature_dim": 256, "hidden_dim": 128 + extra, "context_dim": 128 + extra,
                "motion_corr_layers": [256 + 2 * extra, 192 + 3 * extra // 2],
                "motion_flow_layers": [128 + extra, 64 + extra // 2], "motion_dim": 128 + extra,
                "flow_head_dim": 2 * (128 + extra)}
    return preset(_TASK, what, **dims, gma=gma, weight_norm=True, architectures=["DEQFlowForOpticalFlow"])


# A CPU-sized preset (trained here) and its explicit RAFT twin: same blocks, same parameter count.
_CPU = {"encoder_layers": [32, 32, 48, 64], "feature_dim": 64, "context_dim": 48, "hidden_dim": 48,
        "feature_norm": "instance", "context_norm": "instance", "corr_levels": 3, "corr_radius": 3,
        "motion_corr_layers": [64, 48], "motion_flow_layers": [32, 16], "motion_dim": 48, "flow_head_dim": 64,
        "mask_dim": 64, "weight_norm": True, "architectures": ["DEQFlowForOpticalFlow"]}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deq-flow-tiny": _upstream("tiny", "DEQ-Flow tiny (the original's --tiny), 2.49 M parameters"),
    "deq-flow-b": _upstream("B", "DEQ-Flow-B (the original's default size), 5.24 M parameters"),
    "deq-flow-h": _upstream("H", "DEQ-Flow-H (the original's --huge), 13.39 M parameters"),
    "deq-flow-tiny-gma": _upstream("tiny", "DEQ-Flow tiny with GMA, 2.52 M parameters", True),
    "deq-flow-b-gma": _upstream("B", "DEQ-Flow-B with GMA, 5.78 M parameters", True),
    "deq-flow-h-gma": _upstream("H", "DEQ-Flow-H with GMA, 15.56 M parameters", True),
    "deq-flow-cpu-synth": preset(_TASK, "a CPU-sized DEQ-Flow on torchvision RAFT blocks", **_CPU),
    "deq-flow-cpu-raft-baseline": preset(
        _TASK, "the explicit RAFT twin of deq-flow-cpu-synth: same blocks, 12 unrolled updates",
        **_CPU, implicit=False, num_flow_updates=12),
}
# the 20k-step checkpoints: the same two architectures, trained longer (examples/deq_flow/long_runs.sh)
for _name in ("deq-flow-cpu-synth", "deq-flow-cpu-raft-baseline"):
    ARCHITECTURES[f"{_name}-20k"] = {**ARCHITECTURES[_name], "description": ARCHITECTURES[_name][
        "description"] + f"; deqzoo/{_name}-20k (20k steps)"}
