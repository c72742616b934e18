"""DEQ-Flow models: RAFT's update operator solved for its fixed point by the engine, on torchvision's blocks.

The encoders, the correlation pyramid, the motion encoder, the separable ConvGRU, the flow head and the mask
predictor are `torchvision.models.optical_flow.raft` classes. f_θ(h, flow) is one application of the update
block at 1/8 resolution; `deqzoo.core.DEQ` owns the solve, the backward mode (phantom / Jacobian-free / IFT)
and the fixed-point correction states (``deq.n_states``). The explicit RAFT baseline (``implicit=False``)
applies the same f_θ ``num_flow_updates`` times from zero, as torchvision's RAFT.forward does.

Images are (B, C, H, W) float in [0, 1] or uint8 in [0, 255]; grayscale (C = 1) is repeated to RGB, RGBA
(C = 4) drops alpha; sides not divisible by 8 (or below the correlation pyramid's minimum) are padded by edge
replication and the flow is cropped back, as RAFT's InputPadder does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torchvision.models.optical_flow import raft as tv_raft
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ...core import DEQ, DeferredState, SolverStats, apply_norm, fp_correction, reset_norm, residual_penalty
from ...core.regularize import FP_WEIGHTS
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from ..initialization import default_init_
from .configuration_deq_flow import DEFAULT_REUSE, REUSE_MODES, DEQFlowConfig

__all__ = [
    "DEQFlowForOpticalFlow", "DEQFlowModel", "DEQFlowOutput", "DEQFlowPreTrainedModel", "FlowFeatures",
    "GMAUpdateBlock", "GlobalAggregate", "GlobalAttention", "DEFAULT_REUSE", "REUSE_MODES",
    "forward_interpolate", "prepare_images", "sequence_loss", "warp",
]

_SEQUENCE_GAMMA = 0.8  # RAFT's (and DEQ-Flow's fixed-point correction) exponential weighting



def forward_interpolate(flow: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """Splat a (B, 2, H, W) or (2, H, W) flow forward along itself, RAFT's warm start for the next pair.

    Each pixel x moves to x + flow(x); the points landing strictly inside the frame carry their flow, and
    every pixel takes the flow of the nearest landed point (nearest-neighbour scattered interpolation, as
    RAFT's ``forward_interpolate`` does with scipy's griddata). If nothing lands inside, the result is 0.

    Example:
        >>> import torch
        >>> flow = torch.zeros(2, 4, 6); flow[0] = 1.5       # everything moves 1.5 px right
        >>> bool((forward_interpolate(flow) == flow).all())   # a constant flow stays the same constant
        True
    """
    single = flow.dim() == 3
    batch = flow[None] if single else flow
    if batch.dim() != 4 or batch.shape[1] != 2:
        raise ValueError(
            f"forward_interpolate expects a (B, 2, H, W) or (2, H, W) flow, got {tuple(flow.shape)}"
        )
    _, _, h, w = batch.shape
    data = batch.detach().double()
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64, device=flow.device),
                            torch.arange(w, dtype=torch.float64, device=flow.device), indexing="ij")
    grid = torch.stack([xs, ys], dim=-1).reshape(-1, 2)
    out = torch.zeros_like(data)
    for b, f in enumerate(data):
        values = f.reshape(2, -1).T  # (H*W, 2)
        land = grid + values
        inside = (land[:, 0] > 0) & (land[:, 0] < w) & (land[:, 1] > 0) & (land[:, 1] < h)
        if not bool(inside.any()):
            continue
        points, values = land[inside], values[inside]
        rows = max(1, chunk // len(points))  # bound the (rows, points) distance block
        nearest = torch.cat(
            [
                torch.cdist(grid[i : i + rows], points, compute_mode="donot_use_mm_for_euclid_dist").argmin(1)
                for i in range(0, len(grid), rows)
            ]
        )
        out[b] = values[nearest].T.reshape(2, h, w)
    out = out.to(flow.dtype)
    return out[0] if single else out


def warp(image: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Backward warp out(x) = image(x + flow(x)), bilinear, border-clamped; (B, C, H, W), (B, 2, H, W).

    Example:
        >>> import torch
        >>> image = torch.arange(12.0).reshape(1, 1, 3, 4)
        >>> flow = torch.zeros(1, 2, 3, 4); flow[:, 0] = 1.0        # sample one pixel to the right
        >>> warp(image, flow)[0, 0, 0].tolist()                      # the last column clamps at the border
        [1.0, 2.0, 3.0, 3.0]
    """
    b, _, h, w = image.shape
    if flow.shape != (b, 2, h, w):
        raise ValueError(
            f"warp expects a flow of shape {(b, 2, h, w)} for this image, got {tuple(flow.shape)}"
        )
    x, y = (coords_grid(b, h, w, device=flow.device).to(flow.dtype) + flow).unbind(1)
    norm = torch.stack([2 * x / max(w - 1, 1) - 1, 2 * y / max(h - 1, 1) - 1], dim=-1)
    return F.grid_sample(image, norm, mode="bilinear", padding_mode="border", align_corners=True)


def coords_grid(batch: int, h: int, w: int, device: torch.device | str | None = None) -> torch.Tensor:
    """RAFT's pixel grid, (batch, 2, h, w) float32 with channel 0 = x (column) and 1 = y (row): the
    look-up positions that flow moves. Ours because torchvision keeps its copy in a private module.

        >>> coords_grid(1, 2, 3)[0, :, 1, 2].tolist()   # row 1, column 2
        [2.0, 1.0]
    """
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack((xs, ys)).float()[None].repeat(batch, 1, 1, 1)


def upsample_flow(flow: torch.Tensor, mask: torch.Tensor | None, factor: int = 8) -> torch.Tensor:
    """Flow at 1/`factor` resolution -> full resolution, in pixels of the full image (hence × factor).
    With `mask` (B, 9·factor², h, w): RAFT's convex upsampling, each fine pixel a softmax-weighted
    combination of its coarse pixel's 3×3 neighbourhood; without: bilinear. (torchvision's version is
    private; the operations are in the order the original RAFT and DEQ-Flow code use, so converted
    checkpoints match bit for bit.)"""
    b, c, h, w = flow.shape
    if mask is None:
        return factor * F.interpolate(flow, scale_factor=factor, mode="bilinear", align_corners=True)
    weights = torch.softmax(mask.view(b, 1, 9, factor, factor, h, w), dim=2)
    patches = F.unfold(factor * flow, kernel_size=3, padding=1).view(b, c, 9, 1, 1, h, w)
    fine = torch.sum(weights * patches, dim=2)  # (b, c, factor, factor, h, w)
    return fine.permute(0, 1, 4, 2, 5, 3).reshape(b, c, factor * h, factor * w)


def _norm_layer(kind: str):
    if kind == "instance":
        return nn.InstanceNorm2d  # affine=False: no parameters, as the original
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "group":
        return lambda c: nn.GroupNorm(max(1, c // 8), c)
    return None


def _as_rgb(image: torch.Tensor, name: str) -> torch.Tensor:
    """(B, C, H, W) or (C, H, W) float [0, 1] / uint8 -> (B, 3, H, W) float32 in [0, 1]."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor (B, C, H, W) or (C, H, W), got {type(image).__name__}"
        )
    if image.dim() == 3:
        image = image.unsqueeze(0)
    if image.dim() != 4:
        raise ValueError(f"{name} must have shape (B, C, H, W) or (C, H, W), got {tuple(image.shape)}")
    channels = image.shape[1]
    if channels not in (1, 3, 4):
        raise ValueError(
            f"{name} has {channels} channels (shape {tuple(image.shape)}); expected 1 (grayscale), 3 (RGB) "
            "or 4 (RGBA) channels first"
        )
    if image.dtype == torch.uint8:
        image = image.float() / 255.0
    elif not image.is_floating_point():
        raise TypeError(f"{name} must be float in [0, 1] or uint8, got dtype {image.dtype}")
    if channels == 1:
        image = image.expand(-1, 3, -1, -1)
    elif channels == 4:
        image = image[:, :3]
    if not bool(torch.isfinite(image).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return image


def prepare_images(image1: torch.Tensor, image2: torch.Tensor, min_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """Validate a pair of image batches and pad both to sides divisible by 8 (at least `min_size`).

    Returns the two padded (B, 3, H', W') float batches in [0, 1] and the padding (left, right, top, bottom)
    that `unpad` removes. Mismatched shapes raise a ValueError naming both.

    Example:
        >>> import torch
        >>> a, b, pad = prepare_images(torch.rand(1, 1, 30, 45), torch.rand(1, 1, 30, 45))
        >>> tuple(a.shape), pad
        ((1, 3, 32, 48), (1, 2, 1, 1))
    """
    if isinstance(image1, (list, tuple)) or isinstance(image2, (list, tuple)):
        image1, image2 = _stack_pairs(image1, image2)
    a, b = _as_rgb(image1, "image1"), _as_rgb(image2, "image2")
    if a.shape != b.shape:
        raise ValueError(
            f"image1 and image2 must have the same batch size and spatial size, got {tuple(image1.shape)} "
            f"and {tuple(image2.shape)}"
        )
    h, w = a.shape[-2:]
    ph = max(-(-h // 8) * 8, min_size) - h
    pw = max(-(-w // 8) * 8, min_size) - w
    pad = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
    if ph or pw:
        if ph >= h or pw >= w:  # replicate padding cannot invent more than the image: refuse tiny inputs
            raise ValueError(
                f"images of size {h}x{w} are too small for this model (needs at least {min_size // 2}x"
                f"{min_size // 2} before padding to {max(h + ph, min_size)}x{max(w + pw, min_size)})"
            )
        a, b = F.pad(a, pad, mode="replicate"), F.pad(b, pad, mode="replicate")
    return a, b, pad


def _stack_pairs(image1, image2) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of (C, H, W) images -> batches; every pair (and all pairs of the batch) must share a size."""
    ones = list(image1) if isinstance(image1, (list, tuple)) else list(image1.unbind(0))
    twos = list(image2) if isinstance(image2, (list, tuple)) else list(image2.unbind(0))
    if len(ones) != len(twos):
        raise ValueError(f"got {len(ones)} first images and {len(twos)} second images")
    if not ones:
        raise ValueError("got an empty list of images")
    shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in zip(ones, twos)]
    for i, (sa, sb) in enumerate(shapes):
        if sa[-2:] != sb[-2:]:
            raise ValueError(f"pair {i}: image1 has shape {sa} but image2 has shape {sb}")
    if len({s[0][-2:] for s in shapes}) > 1:
        raise ValueError(
            "the pairs of a batch must share one size; got pair sizes "
            f"{[s[0][-2:] for s in shapes]} (run pairs of different sizes one at a time)"
        )
    rgb = [
        (_as_rgb(a, f"image1[{i}]"), _as_rgb(b, f"image2[{i}]")) for i, (a, b) in enumerate(zip(ones, twos))
    ]
    return torch.cat([a for a, _ in rgb]), torch.cat([b for _, b in rgb])


def unpad(flow: torch.Tensor, pad: tuple[int, int, int, int]) -> torch.Tensor:
    """Crop a full-resolution (B, 2, H', W') flow back to the unpadded size."""
    left, right, top, bottom = pad
    h, w = flow.shape[-2:]
    return flow[..., top : h - bottom, left : w - right]


def sequence_loss(predictions: Sequence[torch.Tensor], flow_gt: torch.Tensor,
                  valid: torch.Tensor | None = None, gamma: float = _SEQUENCE_GAMMA) -> torch.Tensor:
    """RAFT's sequence loss Σ_i γ^(n-i-1) · mean(valid · |flow_i - gt|₁) (DEQ-Flow's fixed-point correction
    applies the same weighting to its correction states).

    Example:
        >>> import torch
        >>> gt = torch.zeros(1, 2, 4, 4)
        >>> round(float(sequence_loss([gt + 1, gt], gt)), 6)  # 0.8 · 1 (first state) + 1 · 0 (last)
        0.8
    """
    if valid is None:
        valid = torch.ones_like(flow_gt[:, 0])

    def l1(pred: torch.Tensor) -> torch.Tensor:
        if pred.shape != flow_gt.shape:
            raise ValueError(f"predicted flow {tuple(pred.shape)} and flow_gt {tuple(flow_gt.shape)} differ")
        return (valid[:, None] * (pred - flow_gt).abs()).mean()

    return fp_correction(l1, list(predictions), weight="exp", gamma=gamma)


class GlobalAttention(nn.Module):
    """GMA's attention over the context features (Jiang et al., 2021; the original's `Attention` without
    positional terms, as DEQ-Flow builds it): softmax(q·k / sqrt(d)) over all positions, (B, heads, HW,
    HW)."""

    def __init__(self, dim: int, heads: int = 1, dim_head: int = 128):
        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_qk = nn.Conv2d(dim, heads * dim_head * 2, 1, bias=False)

    def forward(self, fmap: torch.Tensor) -> torch.Tensor:
        b, _, h, w = fmap.shape
        q, k = self.to_qk(fmap).chunk(2, dim=1)
        q = q.reshape(b, self.heads, -1, h * w).transpose(-1, -2) * self.scale
        k = k.reshape(b, self.heads, -1, h * w)
        return torch.softmax(q @ k, dim=-1)


class GlobalAggregate(nn.Module):
    """GMA's aggregation of motion features by the context attention: fmap + γ · attn · to_v(fmap) (γ starts
    at 0 so the block starts as the local one)."""

    def __init__(self, dim: int, heads: int = 1, dim_head: int = 128):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_v = nn.Conv2d(dim, inner, 1, bias=False)
        self.gamma = nn.Parameter(torch.zeros(1))
        self.project = nn.Conv2d(inner, dim, 1, bias=False) if dim != inner else None

    def forward(self, attention: torch.Tensor, fmap: torch.Tensor) -> torch.Tensor:
        b, _, h, w = fmap.shape
        v = self.to_v(fmap).reshape(b, self.heads, -1, h * w).transpose(-1, -2)
        out = (attention @ v).transpose(-1, -2).reshape(b, -1, h, w)
        if self.project is not None:
            out = self.project(out)
        return fmap + self.gamma * out


class GMAUpdateBlock(tv_raft.UpdateBlock):
    """torchvision's update block with GMA's global motion aggregation: the GRU reads
    [context, motion, aggregated motion]."""

    def __init__(self, *, motion_encoder, recurrent_block, flow_head, aggregate: GlobalAggregate):
        super().__init__(motion_encoder=motion_encoder, recurrent_block=recurrent_block, flow_head=flow_head)
        self.aggregate = aggregate

    def forward(self, hidden_state, context, corr_features, flow, attention=None):
        motion = self.motion_encoder(flow, corr_features)
        x = torch.cat([context, motion, self.aggregate(attention, motion)], dim=1)
        hidden_state = self.recurrent_block(hidden_state, x)
        return hidden_state, self.flow_head(hidden_state)


@dataclass
class DEQFlowOutput(DEQModelOutput):
    """loss: sequence / fixed-point-correction loss against `flow_gt` (if given; plus ``jac_loss_weight``
    times the engine's Jacobian regularizer when ``deq.jac_reg_samples`` > 0 in training); flow: (B, 2, H, W)
    at full resolution (x then y displacement, in pixels); flow_low: (B, 2, H/8, W/8) at 1/8 resolution
    (padded); hidden_state: the final GRU state (B, hidden_dim, H/8, W/8); fixed_point: (hidden_state,
    flow_low), to pass as the next pair's ``initial_state``; flow_predictions: the supervised full-
    resolution flows in training (correction states or unrolled iterates, first to last); hidden_states:
    (context features, final hidden state) with ``output_hidden_states=True``; deq_stats: solver statistics
    (None when explicit); loss_terms: with ``defer_loss=True`` in training, the loss as independent weighted
    terms (one per supervised state, plus the drift term), zero-argument callables that each build and
    return their own graph (`loss` is then None)."""

    loss: torch.Tensor | None = None
    flow: torch.Tensor | None = None
    flow_low: torch.Tensor | None = None
    hidden_state: torch.Tensor | None = None
    fixed_point: tuple[torch.Tensor, torch.Tensor] | None = None
    flow_predictions: list[torch.Tensor] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    deq_stats: SolverStats | None = None
    residual_loss: torch.Tensor | None = None
    loss_terms: list[Callable[[], torch.Tensor]] | None = None


@dataclass
class FlowFeatures:
    """What the encoders compute once per pair, the part of the training graph every supervised state shares:
    the context features (ReLU) of frame 1 and the correlation pyramid (level 0 first). From
    `DEQFlowModel.features`; passed back as ``forward(..., features=)`` (e.g. detached into leaves by a
    two-stage training step, `two_stage_backward` (this package))."""

    context: torch.Tensor
    pyramid: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        return [self.context, *self.pyramid]

    def detached(self) -> FlowFeatures:
        """The same values as leaves that require grad (their .grad collects what the states send back)."""
        leaf = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
        return FlowFeatures(leaf(self.context), [leaf(t) for t in self.pyramid])


class CheckpointedResidualBlock(GradientCheckpointingLayer, tv_raft.ResidualBlock):
    """torchvision's RAFT residual block (same parameters and forward) as a transformers
    GradientCheckpointingLayer: ``activation_checkpointing_enable()`` makes it recompute in backward, as
    transformers' own layers do."""


class DEQFlowPreTrainedModel(DEQPreTrainedModel):
    """Weights I/O for DEQ-Flow models (config class, prefix, torchvision's initialisation)."""

    config_class = DEQFlowConfig
    base_model_prefix = "deq_flow"
    main_input_name = "image1"
    # transformers' activation_checkpointing_enable() (gradient_checkpointing_enable() before v6) recomputes
    # the feature and context encoders in backward instead of keeping their activations: the same option for
    # DEQ-Flow and its explicit RAFT twin (the update iterations are not checkpointed)
    supports_gradient_checkpointing = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # torchvision's initialisation of its RAFT blocks: PyTorch's default for every conv, kaiming-normal
        # (fan_out) weights in the encoders as FeatureEncoder does; norms at 1 / 0; GMA's gate at 0
        if isinstance(module, nn.Conv2d):
            default_init_(module)
            if getattr(module, "encoder_conv", False):
                init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
            super()._init_weights(module)  # transformers': weight 1, bias 0, fresh running statistics
        elif isinstance(module, GlobalAggregate):
            init.zeros_(module.gamma)


class DEQFlowModel(DEQFlowPreTrainedModel):
    """Encoders, correlation, update block and upsampler of DEQ-Flow (or of its explicit RAFT twin).

    ``forward(image1, image2, flow_gt=None, valid=None, initial_state=None, num_flow_updates=None)``:
    `initial_state` is a previous pair's ``fixed_point`` (hidden state, 1/8-resolution flow) from which the
    solve starts (frame-to-frame reuse); without it the solve starts at h = 0, flow = 0. `num_flow_updates`
    (torchvision RAFT's argument) is this call's budget: DEQ-Flow's solve runs at most that many steps (still
    stopping at the tolerance; None: the config's f_max_iter), the explicit twin unrolls that many updates.

    Example:
        >>> import torch
        >>> import deqzoo
        >>> model = deqzoo.create_model("deq-flow-cpu-synth").eval()
        >>> out = model(torch.rand(1, 3, 60, 70), torch.rand(1, 3, 60, 70))
        >>> tuple(out.flow.shape), out.deq_stats.nfe > 0
        ((1, 2, 60, 70), True)
    """

    def __init__(self, config: DEQFlowConfig):
        super().__init__(config)
        c = config
        enc = c.encoder_layers
        self.feature_encoder = tv_raft.FeatureEncoder(block=CheckpointedResidualBlock,
                                                      layers=(*enc, c.feature_dim),
                                                      norm_layer=_norm_layer(c.feature_norm))
        self.context_encoder = tv_raft.FeatureEncoder(block=CheckpointedResidualBlock,
                                                      layers=(*enc, c.context_dim),
                                                      norm_layer=_norm_layer(c.context_norm))
        for conv in [*self.feature_encoder.modules(), *self.context_encoder.modules()]:
            conv.encoder_conv = True  # read by _init_weights, which meets each conv alone
        self.corr_block = tv_raft.CorrBlock(num_levels=c.corr_levels, radius=c.corr_radius)
        motion = tv_raft.MotionEncoder(in_channels_corr=self.corr_block.out_channels,
                                       corr_layers=tuple(c.motion_corr_layers),
                                       flow_layers=tuple(c.motion_flow_layers), out_channels=c.motion_dim)
        gru = tv_raft.RecurrentBlock(input_size=c.motion_dim * (2 if c.gma else 1) + c.context_dim,
                                     hidden_size=c.hidden_dim)
        head = tv_raft.FlowHead(in_channels=c.hidden_dim, hidden_size=c.flow_head_dim)
        if c.gma:  # one head of width context_dim / motion_dim, as DEQ-Flow's GMA variants
            self.attention = GlobalAttention(c.context_dim, heads=1, dim_head=c.context_dim)
            self.update_block = GMAUpdateBlock(
                motion_encoder=motion,
                recurrent_block=gru,
                flow_head=head,
                aggregate=GlobalAggregate(c.motion_dim, heads=1, dim_head=c.motion_dim),
            )
        else:
            self.attention = None
            self.update_block = tv_raft.UpdateBlock(
                motion_encoder=motion, recurrent_block=gru, flow_head=head
            )
        self.mask_predictor = (
            tv_raft.MaskPredictor(in_channels=c.hidden_dim, hidden_size=c.mask_dim, multiplier=0.25)
            if c.mask_dim
            else None
        )
        if c.weight_norm:
            apply_norm(self.update_block, "weight_norm")
        self.deq = DEQ(c.deq_config)
        self.gradient_checkpointing = False
        self.post_init()

    def upsample(self, hidden: torch.Tensor, flow_low: torch.Tensor) -> torch.Tensor:
        """1/8-resolution flow -> full resolution: convex combination by the mask predictor's weights."""
        mask = None if self.mask_predictor is None else self.mask_predictor(hidden)
        return upsample_flow(flow_low, mask)

    def build_pyramid(self, fmap1: torch.Tensor, fmap2: torch.Tensor) -> list[torch.Tensor]:
        """The correlation pyramid of a pair's features (level 0 first), returned, never stored: torchvision's
        ``CorrBlock`` keeps its pyramid on itself, so each call uses its own block (one model can serve
        several threads at once; ``self.corr_block`` only names the configuration)."""
        corr = tv_raft.CorrBlock(num_levels=self.corr_block.num_levels, radius=self.corr_block.radius)
        corr.build_pyramid(fmap1, fmap2)
        return list(corr.corr_pyramid)

    def index_pyramid(self, pyramid: Sequence[torch.Tensor], coords: torch.Tensor) -> torch.Tensor:
        """Correlation features around `coords` (B, 2, H/8, W/8) looked up in this call's `pyramid`."""
        corr = tv_raft.CorrBlock(num_levels=self.corr_block.num_levels, radius=self.corr_block.radius)
        corr.corr_pyramid = list(pyramid)
        return corr.index_pyramid(centroids_coords=coords)

    def update_fn(self, context: torch.Tensor, coords0: torch.Tensor, pyramid: Sequence[torch.Tensor]):
        """f_θ(h, flow) over the state (hidden state, 1/8-resolution flow), a closure over the context (and
        its GMA attention) and the correlation pyramid built for this pair (both from `features`)."""
        detach = self.config.detach_flow_input
        extra = () if self.attention is None else (self.attention(context),)
        pyramid = list(pyramid)

        def f(state):
            h, flow = state
            if detach:  # RAFT's coords1.detach(): no gradient through the correlation lookup
                flow = flow.detach()
            corr = self.index_pyramid(pyramid, coords0 + flow)
            h, delta = self.update_block(h, context, corr, flow, *extra)
            return h, flow + delta

        return f

    def _encoder(self, encoder: tv_raft.FeatureEncoder, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # activation checkpointing (transformers' convention, per block as per decoder layer there): only
            # each stage's input is kept and the backward recomputes one stage at a time (the whole encoder as
            # one checkpoint would bring all its activations back at once in the backward). The residual
            # blocks checkpoint themselves (CheckpointedResidualBlock), the stem and the final conv here, in
            # torchvision's FeatureEncoder.forward order. The stem's input (the images) never requires grad,
            # so it is always checkpointed without reentrance: a reentrant checkpoint would return an output
            # without grad and the stem's weights would get none. BatchNorm updates its running statistics
            # twice per step, as under any checkpointing.
            x = torch.utils.checkpoint.checkpoint(encoder.convnormrelu, x, use_reentrant=False)
            x = encoder.layer3(encoder.layer2(encoder.layer1(x)))
            return self._gradient_checkpointing_func(encoder.conv.__call__, x)
        return encoder(x)

    def _features(self, image1: torch.Tensor, image2: torch.Tensor) -> FlowFeatures:
        fmaps = self._encoder(self.feature_encoder, torch.cat([2 * image1 - 1, 2 * image2 - 1], dim=0))
        fmap1, fmap2 = torch.chunk(fmaps, 2, dim=0)
        pyramid = self.build_pyramid(fmap1, fmap2)
        return FlowFeatures(F.relu(self._encoder(self.context_encoder, 2 * image1 - 1)), pyramid)

    def features(self, image1: torch.Tensor, image2: torch.Tensor) -> FlowFeatures:
        """The encoders' outputs for a pair of image batches (validated and padded as in `forward`).

        Example:
            >>> import torch
            >>> import deqzoo
            >>> model = deqzoo.create_model("deq-flow-cpu-synth")
            >>> feats = model.features(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64))
            >>> tuple(feats.context.shape), len(feats.pyramid)
            ((1, 48, 8, 8), 3)
        """
        a, b, _ = prepare_images(image1, image2, self.config.min_image_size)
        return self._features(a, b)

    def _check_features(self, features: FlowFeatures, a: torch.Tensor) -> FlowFeatures:
        want = (a.shape[0], self.config.context_dim, a.shape[-2] // 8, a.shape[-1] // 8)
        if not isinstance(features, FlowFeatures) or tuple(features.context.shape) != want:
            got = tuple(features.context.shape) if isinstance(features, FlowFeatures) else type(features)
            raise ValueError(f"features must be FlowFeatures of these images (context {want}), got {got}")
        if len(features.pyramid) != self.config.corr_levels:
            raise ValueError(
                f"features.pyramid has {len(features.pyramid)} levels, the model {self.config.corr_levels}"
            )
        return features

    def forward(self, image1: torch.Tensor, image2: torch.Tensor, flow_gt: torch.Tensor | None = None,
                valid: torch.Tensor | None = None,
                initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                features: FlowFeatures | None = None, defer_loss: bool = False,
                num_flow_updates: int | None = None) -> DEQFlowOutput | tuple:
        """`features`: the encoders' outputs for these images (`features()`), used instead of running the
        encoders. `defer_loss` (DEQ-Flow in training, with `flow_gt`): no gradient graph is built here; the
        loss comes back as ``loss_terms`` (see `DEQFlowOutput`) for a training step that backpropagates one
        supervised state at a time (`two_stage_backward` (this package)); the outputs' values are those
        of the eager forward, without graphs."""
        c = self.config
        budget = _check_updates(num_flow_updates)
        a, b, pad = prepare_images(image1, image2, c.min_image_size)
        if flow_gt is not None and flow_gt.shape != (a.shape[0], 2, *_unpadded(a, pad)):
            raise ValueError(
                f"flow_gt must have shape {(a.shape[0], 2, *_unpadded(a, pad))}, got {tuple(flow_gt.shape)}"
            )
        train = torch.is_grad_enabled()
        defer = defer_loss and train and flow_gt is not None
        if defer and not c.implicit:
            raise ValueError(
                "defer_loss needs the DEQ (implicit=True): RAFT's unrolled updates form one chain"
            )
        if c.weight_norm:
            reset_norm(self.update_block)
        features = self._features(a, b) if features is None else self._check_features(features, a)
        context = features.context
        bsz, _, h8, w8 = context.shape
        coords0 = coords_grid(bsz, h8, w8).to(context)
        z0 = self._initial(initial_state, (bsz, c.hidden_dim, h8, w8), context)
        f = self.update_fn(context, coords0, features.pyramid)
        stats, supervised, terms = None, [], None
        if defer:
            output, stats = self._solve(f, z0, budget, defer_graphs=True)
            states = stats.states or [output]
            hidden, flow_low = output.value()  # the output's values, as the eager forward returns them
            with torch.no_grad():
                flow = unpad(self.upsample(hidden, flow_low), pad)
            weights = [FP_WEIGHTS["exp"](len(states), k, gamma=_SEQUENCE_GAMMA) for k in range(len(states))]
            terms = [
                functools.partial(self._state_loss, state, w, flow_gt, valid, pad)
                for state, w in zip(states, weights)
            ]
            jac = getattr(stats, "jac_loss", None)
            if jac is not None and c.jac_loss_weight:  # built in the solve, at z*
                terms.append(lambda: c.jac_loss_weight * jac)
            if c.residual_loss_weight or c.flow_residual_weight:
                terms.append(functools.partial(self._drift_loss, f, hidden, flow_low))
            loss = residual = None
        else:
            if c.implicit:
                (hidden, flow_low), stats = self._solve(f, z0, budget)
                if train and getattr(stats, "states", None):
                    supervised = [self.upsample(hs, fs) for hs, fs in stats.states]
            else:  # explicit RAFT: the update block applied num_flow_updates times, every iterate supervised
                z = z0
                for _ in range(c.num_flow_updates if budget is None else budget):
                    z = f(z)
                    if train:
                        supervised.append(self.upsample(*z))
                hidden, flow_low = z
            flow = supervised[-1] if supervised else self.upsample(hidden, flow_low)
            flow = unpad(flow, pad)
            supervised = [unpad(p, pad) for p in supervised] or [flow]
            loss = sequence_loss(supervised, flow_gt, valid) if flow_gt is not None else None
            loss = self._add_jac_loss(loss, stats)
            residual = None
            equilibrium = c.residual_loss_weight or c.flow_residual_weight
            if loss is not None and c.implicit and train and equilibrium:
                drift, residual = self._drift_loss(f, hidden, flow_low, with_residual=True)
                loss = loss + drift
        return self._output(
            DEQFlowOutput(
                loss=loss,
                flow=flow,
                flow_low=flow_low,
                hidden_state=hidden,
                fixed_point=(hidden.detach(), flow_low.detach()),
                flow_predictions=supervised if train and not defer else None,
                hidden_states=(context, hidden)
                if self._flag(output_hidden_states, "output_hidden_states")
                else None,
                deq_stats=stats,
                residual_loss=residual,
                loss_terms=terms,
            ),
            return_dict,
        )

    def _solve(self, f, z0, budget: int | None, defer_graphs: bool = False):
        if budget is None:
            return self.deq(f, z0, defer_graphs=defer_graphs)
        return self.deq.solve_with(self.deq.config, f, z0, max_iter=budget, defer_graphs=defer_graphs)

    def _state_loss(self, state: DeferredState, weight: float, flow_gt: torch.Tensor, valid, pad
    ) -> torch.Tensor:
        """One supervised state's weighted sequence-loss term, its graph built now."""
        return weight * sequence_loss([unpad(self.upsample(*state()), pad)], flow_gt, valid)

    def _drift_loss(self, f, hidden: torch.Tensor, flow_low: torch.Tensor, with_residual: bool = False):
        """The equilibrium terms at the solve's output (held fixed): the relative residual and the flow's
        drift, mean |Δflow| that one more f would add, in full-resolution pixels (1/8 resolution x 8)."""
        c = self.config
        fz, residual = residual_penalty(f, (hidden, flow_low))
        drift = 8 * (fz[1] - flow_low.detach()).abs().mean()
        loss = c.residual_loss_weight * residual + c.flow_residual_weight * drift
        return (loss, residual) if with_residual else loss

    def get_input_embeddings(self) -> nn.Module:
        """The feature encoder's stem (the first map from pixels into features)."""
        return self.feature_encoder.convnormrelu

    def _initial(self, state, shape: tuple[int, ...], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = (like.new_zeros(shape), like.new_zeros(shape[0], 2, *shape[2:]))
        if state is None:
            return zeros
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError(
                "initial_state must be a (hidden_state, flow_low) pair, e.g. a previous fixed_point"
            )
        for got, want, name in zip(state, zeros, ("hidden_state", "flow_low")):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise ValueError(
                    f"initial_state {name} must have shape {tuple(want.shape)} for these images, got "
                    f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
                )
        return state[0].detach().to(like), state[1].detach().to(like)


def _check_updates(num_flow_updates: int | None) -> int | None:
    if num_flow_updates is None:
        return None
    if isinstance(num_flow_updates, bool) or not isinstance(num_flow_updates, int) or num_flow_updates < 1:
        raise ValueError(f"num_flow_updates must be an integer >= 1 or None, got {num_flow_updates!r}")
    return num_flow_updates


def _unpadded(a: torch.Tensor, pad: tuple[int, int, int, int]) -> tuple[int, int]:
    return a.shape[-2] - pad[2] - pad[3], a.shape[-1] - pad[0] - pad[1]


class DEQFlowForOpticalFlow(DEQFlowModel):
    """DEQ-Flow for optical flow, with helpers for pairs and frame sequences (the flow-estimation head is the
    convex upsampler, so this is the model itself plus conveniences).

    Example:
        >>> import torch
        >>> import deqzoo
        >>> model = deqzoo.create_model("deq-flow-cpu-synth").eval()
        >>> frames = torch.rand(3, 3, 64, 64)
        >>> flows, stats = model.estimate_sequence(frames, reuse=True)
        >>> len(flows), tuple(flows[0].shape)
        (2, (2, 64, 64))
    """

    @torch.no_grad()
    def estimate_sequence(self, frames: torch.Tensor | Sequence[torch.Tensor], reuse: bool | str = True,
                          num_flow_updates: int | None = None
    ) -> tuple[list[torch.Tensor], list[SolverStats | None]]:
        """Flow between consecutive frames (T, C, H, W) -> T-1 flows (2, H, W) and their solver stats.

        `reuse` (frame-to-frame reuse; each pair after the first starts its solve from the previous pair's
        fixed point, see `REUSE_MODES`): False = every solve from zero; "fixed_point" = the previous (h, flow)
        as is; "forward_interpolate" = the previous h and the previous flow splatted forward along itself
        (`forward_interpolate`: the original DEQ-Flow's fixed-point reuse, so that a moving pattern's flow
        starts where the pattern now is); "warm_start" = h from zero and the forward-interpolated flow
        (RAFT's warm start); "warp" = the previous h and flow both moved with the content, bilinearly, along
        the forward-interpolated flow (sub-cell motions at 1/8 resolution move the state too); True = the
        checkpoint's own choice, ``config.sequence_reuse`` ("warp" unless its card found that reuse hurts it,
        then "none": every pair from zero, as False).

        `num_flow_updates`: the solver budget of every pair after the first (streaming at a fixed cost per
        frame: with reuse, each pair continues the previous pair's solve); the first pair, which has nothing
        to start from, gets the model's full budget. None: the full budget for every pair.
        """
        if len(frames) < 2:
            raise ValueError(f"estimate_sequence needs at least 2 frames, got {len(frames)}")
        mode = self.config.sequence_reuse if reuse is True else reuse
        if mode == "none":
            mode = False
        if mode is not False and mode not in REUSE_MODES:
            raise ValueError(f"reuse must be True, False, 'none' or one of {sorted(REUSE_MODES)}, got "
                             f"{reuse!r}")
        _check_updates(num_flow_updates)
        flows, stats, state = [], [], None
        for t in range(len(frames) - 1):
            budget = num_flow_updates if t else None
            out = self(frames[t], frames[t + 1], initial_state=state, return_dict=True,
                       num_flow_updates=budget)
            flows.append(out.flow[0])
            stats.append(out.deq_stats)
            state = None if mode is False else _next_start(out.fixed_point, mode)
        return flows, stats


def _next_start(fixed_point: tuple[torch.Tensor, torch.Tensor], mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, flow_low = fixed_point
    if mode == "fixed_point":
        return hidden, flow_low
    moved = forward_interpolate(flow_low)  # the motion at the next pair's cells (constant velocity)
    if mode == "warp":  # each cell takes the state from where its content was: x - motion(x)
        return warp(hidden, -moved), warp(flow_low, -moved)
    return (torch.zeros_like(hidden) if mode == "warm_start" else hidden), moved
