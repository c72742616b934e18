"""Multiscale deep equilibrium models (Bai, Koltun & Kolter, NeurIPS 2020) and Lipschitz MDEQ (Sato & Iiduka).

Structure (as locuslab/mdeq ``lib/models/mdeq_core.py`` and locuslab/deq ``MDEQ-Vision``):

* stem ``downsample``: two 3x3 conv-BN-ReLU (stride 2 each when ``downsample_times`` >= 1, 2), then ``stage0``
  (1x1 conv-BN-ReLU) gives the input injection, added to the highest resolution only;
* f_θ = ``fullstage``: per resolution a residual block (conv-GN-ReLU-conv-dropout + injection, GN, residual,
  ReLU, GN), a multiscale fusion (stride-2 convs down, 1x1 conv + nearest upsampling up), post-fusion layers
  (ReLU, 1x1 conv, GN); weight normalization on the blocks' and post-fusion convs;
* the equilibrium of all resolutions is found jointly by the engine (``deqzoo.core.DEQ``);
* heads: classification fuses all resolutions (bottlenecks, stride-2 convs to the lowest resolution, 1x1 conv,
  pooling, linear); segmentation upsamples every resolution to the highest, concatenates, and applies two
  convs.

State-dict keys equal the originals' with the backbone under ``mdeq.`` (the converter's ``KEY_MAP``,
conversion/mdeq_locuslab.py).

Example:
    >>> import torch, deqzoo
    >>> model = deqzoo.create_model("mdeq-tiny-mnist").eval()
    >>> out = model(torch.randn(2, 1, 28, 28), output_hidden_states=True)
    >>> out.logits.shape, [tuple(h.shape) for h in out.hidden_states]
    (torch.Size([2, 10]), [(2, 16, 14, 14), (2, 16, 7, 7)])
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithNoAttention, ImageClassifierOutputWithNoAttention

from ...core import DEQ, SolverStats
from ...core.halting import rowwise
from ...core.norm import apply_norm, reset_norm
from ...core.regularize import VariationalDropout, reset_dropout
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from ..initialization import default_init_
from .configuration_mdeq import MDEQConfig
from .lipschitz import IsometricUpsample, MeanOnlyGroupNorm, ScaledReLU, lipschitz_bound, project_lipschitz

__all__ = [
    "MDEQForImageClassification", "MDEQForSemanticSegmentation", "MDEQModel", "MDEQModelOutput",
    "MDEQPreTrainedModel", "MDEQImageClassifierOutput", "MDEQSemanticSegmenterOutput",
]

# Documented input limit, checked before any work: pixels per image (4096 x 4096; Cityscapes is 1024 x 2048).
MAX_IMAGE_PIXELS = 4096 * 4096


def check_image_size(pixel_values: torch.Tensor) -> None:
    """Refuse an empty batch or image, or one above MAX_IMAGE_PIXELS, before the stem runs."""
    b, _, h, w = pixel_values.shape
    if b == 0 or h == 0 or w == 0:
        raise ValueError(f"pixel_values is empty (shape {tuple(pixel_values.shape)}); pass at least one "
                         "image of at least 1x1 pixels")
    if h * w > MAX_IMAGE_PIXELS:
        raise ValueError(f"pixel_values images are {h}x{w} = {h * w:,} pixels, above the limit of "
                         f"{MAX_IMAGE_PIXELS:,} (deqzoo.models.mdeq.modeling_mdeq.MAX_IMAGE_PIXELS); "
                         "resize first")



def _conv(in_c: int, out_c: int, kernel: int = 3, stride: int = 1, bias: bool = False) -> nn.Conv2d:
    return nn.Conv2d(in_c, out_c, kernel_size=kernel, stride=stride, padding=kernel // 2, bias=bias)


def _mark(conv: nn.Conv2d) -> nn.Conv2d:
    """Mark a conv of f_θ whose operator norm the Lipschitz projection keeps <= c."""
    conv._deqzoo_lipschitz_conv = True
    return conv


class _Parts:
    """GroupNorm / activation / conv of f_θ: original (GN, ReLU) or Lipschitz (mean-only GN, a·ReLU)."""

    def __init__(self, config: MDEQConfig):
        self.cfg = config
        self.lip = config.lipschitz

    def gn(self, groups: int, channels: int, affine: bool) -> nn.Module:
        if self.lip:
            return MeanOnlyGroupNorm(groups, channels, self.cfg.gamma_bound)  # always affine
        return nn.GroupNorm(groups, channels, affine=affine)

    def act(self) -> nn.Module:
        return ScaledReLU(self.cfg.relu_slope) if self.lip else nn.ReLU()

    def conv(self, *args, **kwargs) -> nn.Conv2d:
        c = _conv(*args, **kwargs)
        return _mark(c) if self.lip else c


class MDEQBasicBlock(nn.Module):
    """Residual block of one resolution stream (Figure 2 of the paper); Lipschitz: the convex form."""

    def __init__(self, config: MDEQConfig, channels: int, big_kernels: int):
        super().__init__()
        p = _Parts(config)
        inner = int(config.expansion_factor * channels)
        k1 = 5 if big_kernels >= 1 else 3
        k2 = 5 if big_kernels >= 2 else 3
        self.lipschitz = config.lipschitz
        self.alpha = config.residual_alpha
        self.conv1 = p.conv(channels, inner, k1)
        self.gn1 = p.gn(config.num_groups, inner, config.block_gn_affine)
        self.relu = p.act()
        self.conv2 = p.conv(inner, channels, k2)
        self.gn2 = p.gn(config.num_groups, channels, config.block_gn_affine)
        if self.lipschitz:
            self.relu3 = p.act()
        else:
            self.gn3 = p.gn(config.num_groups, channels, config.block_gn_affine)
            self.relu3 = nn.ReLU()
        self.drop = VariationalDropout(config.dropout, shared_dims=(2, 3))

    def forward(self, x: torch.Tensor, injection: torch.Tensor | None = None) -> torch.Tensor:
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.drop(self.conv2(out))
        if injection is not None:
            out = out + injection
        out = self.gn2(out)
        if self.lipschitz:
            return self.alpha * x + (1 - self.alpha) * self.relu3(out)
        return self.gn3(self.relu3(out + x))


class MDEQBranch(nn.Module):
    """The residual blocks of one resolution stream (injection enters the first block)."""

    def __init__(self, config: MDEQConfig, index: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            MDEQBasicBlock(config, config.branch_channels[index], config.big_kernels[index])
            for _ in range(config.num_blocks[index])
        )

    def forward(self, x: torch.Tensor, injection: torch.Tensor | None = None) -> torch.Tensor:
        y = self.blocks[0](x, injection)
        for block in self.blocks[1:]:
            y = block(y)
        return y


class MDEQDownsample(nn.Module):
    """Stream j -> i > j: (i - j) stride-2 3x3 convs with GroupNorm (ReLU between; Lipschitz: after each)."""

    def __init__(self, config: MDEQConfig, in_res: int, out_res: int):
        super().__init__()
        p = _Parts(config)
        in_c, out_c = config.branch_channels[in_res], config.branch_channels[out_res]
        levels = out_res - in_res
        stages = []
        for k in range(levels):
            last = k == levels - 1
            mid = out_c if last else in_c
            parts = [
                ("conv", p.conv(in_c, mid, 3, stride=2)),
                ("gnorm", p.gn(config.num_groups, mid, config.fuse_gn_affine)),
            ]
            if not last or config.lipschitz:
                parts.append(("relu", p.act()))
            stages.append(nn.Sequential(OrderedDict(parts)))
        self.net = nn.Sequential(*stages)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        return self.net(x)


class MDEQUpsample(nn.Module):
    """Stream j -> i < j: 1x1 conv, GroupNorm, nearest upsampling (Lipschitz: a·ReLU, isometric upsample)."""

    def __init__(self, config: MDEQConfig, in_res: int, out_res: int):
        super().__init__()
        p = _Parts(config)
        in_c, out_c = config.branch_channels[in_res], config.branch_channels[out_res]
        self.scale = 2 ** (in_res - out_res)
        self.lipschitz = config.lipschitz
        parts = [
            ("conv", p.conv(in_c, out_c, 1)),
            ("gnorm", p.gn(config.num_groups, out_c, config.fuse_gn_affine)),
        ]
        if config.lipschitz:
            parts.append(("relu", p.act()))
        self.net = nn.Sequential(OrderedDict(parts))
        self.up = IsometricUpsample(self.scale) if config.lipschitz else None

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        y = self.net(x)
        if self.up is not None:
            return self.up(y, size)
        size = size or (y.shape[-2] * self.scale, y.shape[-1] * self.scale)
        return F.interpolate(y, size=size, mode="nearest")


class MDEQModule(nn.Module):
    """f_θ: per-resolution residual blocks, then multiscale fusion (and post-fusion layers when original).

    Lipschitz form: ``z'_i = (1-α₂) b_i + α₂ Σ_{j≠i} softmax(fuse_logits[i])_j T_ij(b_j)`` and no post-fusion.
    """

    def __init__(self, config: MDEQConfig):
        super().__init__()
        n = config.num_branches
        self.num_branches = n
        self.lipschitz = config.lipschitz
        self.alpha2 = config.fusion_alpha
        self.branches = nn.ModuleList(MDEQBranch(config, i) for i in range(n))
        self.fuse_layers = None
        if n > 1:
            self.fuse_layers = nn.ModuleList(
                nn.ModuleList(
                    None if i == j else (MDEQUpsample if j > i else MDEQDownsample)(config, j, i)
                    for j in range(n)
                )
                for i in range(n)
            )
        if config.lipschitz:
            self.post_fuse_layers = None
            self.fuse_logits = nn.Parameter(torch.zeros(n, n)) if n > 1 else None
        else:
            self.post_fuse_layers = nn.ModuleList(
                nn.Sequential(
                    OrderedDict(
                        [
                            ("relu", nn.ReLU()),
                            ("conv", _conv(c, c, 1)),
                            (
                                "gnorm",
                                nn.GroupNorm(max(1, config.num_groups // 2), c, affine=config.post_gn_affine),
                            ),
                        ]
                    )
                )
                for c in config.branch_channels
            )
        if config.wnorm:
            for branch in self.branches:
                for block in branch.blocks:
                    apply_norm(block.conv1, "weight_norm")
                    apply_norm(block.conv2, "weight_norm")
            if self.post_fuse_layers is not None:
                for layer in self.post_fuse_layers:
                    apply_norm(layer.conv, "weight_norm")

    def _fusion_weights(self) -> torch.Tensor:
        n = self.num_branches
        eye = torch.eye(n, dtype=torch.bool, device=self.fuse_logits.device)
        return torch.softmax(self.fuse_logits.masked_fill(eye, float("-inf")), dim=1)

    def forward(self, zs: tuple[torch.Tensor, ...] | list[torch.Tensor],
                injection: tuple[torch.Tensor | None, ...] | list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, ...]:
        n = self.num_branches
        blocks = [self.branches[i](zs[i], injection[i]) for i in range(n)]
        if n == 1:
            return (blocks[0],) if self.post_fuse_layers is None else (self.post_fuse_layers[0](blocks[0]),)
        sizes = [b.shape[-2:] for b in blocks]
        if self.lipschitz:
            pi = self._fusion_weights()
            out = []
            for i in range(n):
                cross = sum(
                    pi[i, j] * self.fuse_layers[i][j](blocks[j], sizes[i]) for j in range(n) if j != i
                )
                out.append((1 - self.alpha2) * blocks[i] + self.alpha2 * cross)
            return tuple(out)
        out = []
        for i in range(n):
            y = blocks[i]
            for j in range(n):
                if j != i:
                    y = y + self.fuse_layers[i][j](blocks[j], sizes[i])
            out.append(self.post_fuse_layers[i](y))
        return tuple(out)


@dataclass
class MDEQModelOutput(BaseModelOutputWithNoAttention, DEQModelOutput):
    """`last_hidden_state`: the highest resolution's equilibrium; `hidden_states` (with
    ``output_hidden_states=True``): the equilibrium state of every resolution, highest first."""

    deq_stats: SolverStats | None = None


@dataclass
class MDEQImageClassifierOutput(ImageClassifierOutputWithNoAttention, DEQModelOutput):
    deq_stats: SolverStats | None = None


@dataclass
class MDEQSemanticSegmenterOutput(DEQModelOutput):
    """`logits` at the highest equilibrium resolution (input / 2**downsample_times), as the original."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    deq_stats: SolverStats | None = None


class MDEQPreTrainedModel(DEQPreTrainedModel):
    config_class = MDEQConfig
    base_model_prefix = "mdeq"
    main_input_name = "pixel_values"
    _no_split_modules = ["MDEQModule"]

    def post_init(self):
        super().post_init()
        if self.config.lipschitz:
            project_lipschitz(self)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Conv2d):
            if getattr(module, "_deqzoo_lipschitz_conv", False) or "weight_v" in module._parameters:
                default_init_(module)  # f_θ convs keep PyTorch's default init, as the originals do
            elif isinstance(module._parameters.get("weight"), nn.Parameter):
                init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            init.kaiming_uniform_(module.weight, a=5**0.5)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
            super()._init_weights(module)  # transformers': weight 1, bias 0, fresh running statistics
        elif isinstance(module, MeanOnlyGroupNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, MDEQModule) and module.lipschitz and module.fuse_logits is not None:
            init.zeros_(module.fuse_logits)

    def _head_output(self, output_cls: type, out: MDEQModelOutput, logits: torch.Tensor,
                     loss: torch.Tensor | None, output_hidden_states: bool | None, return_dict: bool | None):
        """A head's output: its logits and loss (plus the Jacobian regularizer), the backbone's stats and,
        when asked for, its equilibrium states."""
        hidden = out.hidden_states if self._flag(output_hidden_states, "output_hidden_states") else None
        loss = self._add_jac_loss(loss, out.deq_stats)
        output = output_cls(deq_stats=out.deq_stats, loss=loss, logits=logits, hidden_states=hidden)
        return self._output(output, return_dict)

    def lipschitz_bound(self) -> float:
        """The :func:`~deqzoo.models.mdeq.lipschitz_bound` of this model's f_θ (Lipschitz configs only).

        Example:
            >>> import deqzoo
            >>> round(deqzoo.create_model("lipschitz-mdeq-tiny-mnist").lipschitz_bound(), 4)
            0.6779
        """
        cfg = self.config
        if not cfg.lipschitz:
            raise ValueError(
                "lipschitz_bound() needs a Lipschitz MDEQ (config.lipschitz=True); the original MDEQ "
                "f_θ (GroupNorm with variance division, unconstrained convs) has no such bound"
            )
        return lipschitz_bound(cfg.residual_alpha, cfg.fusion_alpha, cfg.conv_norm, cfg.gamma_bound,
                               cfg.relu_slope, cfg.num_branches, cfg.dropout)


class MDEQModel(MDEQPreTrainedModel):
    """The MDEQ backbone: stem, input injection, and the multiscale equilibrium (one state per resolution).

    ``get_input_embeddings()`` is the stem (``downsample``), the module that embeds pixels.
    """

    _input_embed_layer = "downsample"

    def __init__(self, config: MDEQConfig):
        super().__init__(config)
        c0 = config.branch_channels[0]
        mom = config.bn_momentum
        ds = config.downsample_times
        stem = [
            _conv(config.in_channels, c0, 3, stride=2 if ds >= 1 else 1),
            nn.BatchNorm2d(c0, momentum=mom),
            nn.ReLU(),
            _conv(c0, c0, 3, stride=2 if ds >= 2 else 1),
            nn.BatchNorm2d(c0, momentum=mom),
            nn.ReLU(),
        ]
        self.downsample = nn.Sequential(*stem)
        for i in range(3, ds + 1):
            self.downsample.add_module(f"DS{i}", _conv(c0, c0, 3, stride=2))
            self.downsample.add_module(f"DS{i}-BN", nn.BatchNorm2d(c0, momentum=mom))
            self.downsample.add_module(f"DS{i}-RELU", nn.ReLU())
        if ds == 0 and config.num_branches <= 2:
            self.stage0 = None  # the stem output is the injection (as the original for CIFAR)
        else:
            self.stage0 = nn.Sequential(_conv(c0, c0, 1), nn.BatchNorm2d(c0, momentum=mom), nn.ReLU())
        self.fullstage = MDEQModule(config)
        self.deq = DEQ(config.deq_config)
        self.post_init()

    def injection_module(self) -> nn.Module:
        """The module whose output is the DEQ's input injection (what a hypersolver's initializer reads)."""
        return self.stage0 if self.stage0 is not None else self.downsample

    def state_shapes(self, height: int, width: int) -> list[tuple[int, int, int]]:
        """(channels, height, width) of each resolution's state for a stem output of height x width."""
        shapes = []
        for c in self.config.branch_channels:
            shapes.append((c, height, width))
            height, width = (height + 1) // 2, (width + 1) // 2
        return shapes

    def forward(self, pixel_values: torch.Tensor, z0: tuple[torch.Tensor, ...] | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs
    ) -> MDEQModelOutput | tuple:
        """Solve for the equilibrium of all resolutions; `z0` overrides the zero initial states."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.config.in_channels:
            raise ValueError(
                f"pixel_values must have shape (batch, {self.config.in_channels}, H, W), "
                f"got {tuple(pixel_values.shape)}"
            )
        check_image_size(pixel_values)
        reset_norm(self.fullstage)
        reset_dropout(self.fullstage)
        x = self.downsample(pixel_values)
        injection = [self.stage0(x) if self.stage0 is not None else x] + [None] * (
            self.config.num_branches - 1
        )
        if z0 is None:
            z0 = tuple(x.new_zeros(x.shape[0], *s) for s in self.state_shapes(x.shape[-2], x.shape[-1]))

        gathered: list = [None, None]  # (rows, injection rows): the rows change only when samples stop

        def f(zs, rows=None):  # rows: the samples still iterating (deqzoo.core.halting.rowwise)
            if rows is None:
                return self.fullstage(zs, injection)
            if gathered[0] is not rows:
                gathered[:] = rows, [None if t is None else t[rows] for t in injection]
            return self.fullstage(zs, gathered[1])

        # row-independent (GroupNorm per sample) unless a dropout mask is drawn for the batch in training:
        # stopped samples leave f's batch (registry: row_independent="unless_dropout")
        zs, stats = self.deq(f if self.training and self.config.dropout else rowwise(f), tuple(z0))
        zs = tuple(zs)
        hidden = zs if self._flag(output_hidden_states, "output_hidden_states") else None
        return self._output(MDEQModelOutput(deq_stats=stats, last_hidden_state=zs[0], hidden_states=hidden),
                            return_dict)


class _Bottleneck(nn.Module):
    """The classification head's bottleneck (BatchNorms without affine, as the original's head)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, momentum: float):
        super().__init__()
        self.conv1 = _conv(inplanes, planes, 1)
        self.bn1 = nn.BatchNorm2d(planes, momentum=momentum, affine=False)
        self.conv2 = _conv(planes, planes, 3)
        self.bn2 = nn.BatchNorm2d(planes, momentum=momentum, affine=False)
        self.conv3 = _conv(planes, planes * 4, 1)
        self.bn3 = nn.BatchNorm2d(planes * 4, momentum=momentum, affine=False)
        self.relu = nn.ReLU()
        self.downsample = None
        if inplanes != planes * 4:
            self.downsample = nn.Sequential(_conv(inplanes, planes * 4, 1),
                                            nn.BatchNorm2d(planes * 4, momentum=momentum))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        residual = self.downsample(x) if self.downsample is not None else x
        return self.relu(out + residual)


class MDEQForImageClassification(MDEQPreTrainedModel):
    """MDEQ with the original classification head, which fuses every resolution's equilibrium.

    Example:
        >>> import torch, deqzoo
        >>> model = deqzoo.create_model("mdeq-cifar-tiny").eval()
        >>> model(torch.randn(1, 3, 32, 32)).logits.shape
        torch.Size([1, 10])
    """

    def __init__(self, config: MDEQConfig):
        super().__init__(config)
        self.mdeq = MDEQModel(config)
        mom = config.bn_momentum
        hc = config.head_channels
        self.incre_modules = nn.ModuleList(
            nn.Sequential(_Bottleneck(c, hc[i], mom)) for i, c in enumerate(config.branch_channels)
        )
        self.downsamp_modules = nn.ModuleList(
            nn.Sequential(_conv(hc[i] * 4, hc[i + 1] * 4, 3, stride=2, bias=True),
                          nn.BatchNorm2d(hc[i + 1] * 4, momentum=mom), nn.ReLU())
            for i in range(config.num_branches - 1)
        )
        self.final_layer = nn.Sequential(nn.Conv2d(hc[-1] * 4, config.final_chansize, kernel_size=1),
                                         nn.BatchNorm2d(config.final_chansize, momentum=mom), nn.ReLU())
        self.classifier = nn.Linear(config.final_chansize, config.num_labels)
        self.post_init()

    def fuse(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The head's fused map before pooling (every resolution merged at the lowest)."""
        y = self.incre_modules[0](states[0])
        for i, down in enumerate(self.downsamp_modules):
            y = self.incre_modules[i + 1](states[i + 1]) + down(y)
        return self.final_layer(y)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """timm's split: the fused map before pooling (one solve)."""
        return self.fuse(self.mdeq(pixel_values, output_hidden_states=True, return_dict=True).hidden_states)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """timm's split: global average pooling, then the classifier (skipped with `pre_logits`)."""
        pooled = features.flatten(2).mean(dim=2)
        return pooled if pre_logits else self.classifier(pooled)

    def classify(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The head alone: logits from the equilibrium states."""
        return self.forward_head(self.fuse(states))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs
    ) -> MDEQImageClassifierOutput | tuple:
        out = self.mdeq(pixel_values, output_hidden_states=True, return_dict=True)
        logits = self.classify(out.hidden_states)
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.float())
            else:
                loss = F.cross_entropy(logits, labels)
        return self._head_output(MDEQImageClassifierOutput, out, logits, loss, output_hidden_states,
                                 return_dict)


class MDEQForSemanticSegmentation(MDEQPreTrainedModel):
    """MDEQ with the original segmentation head on the highest resolution (all streams upsampled and joined).

    Example:
        >>> import torch, deqzoo
        >>> model = deqzoo.create_model("mdeq-cityscapes-small").eval()
        >>> model.set_deq(f_max_iter=2) and None
        >>> model(torch.randn(1, 3, 64, 64)).logits.shape
        torch.Size([1, 19, 16, 16])
    """

    def __init__(self, config: MDEQConfig):
        super().__init__(config)
        self.mdeq = MDEQModel(config)
        total = sum(config.branch_channels)
        k = config.final_conv_kernel
        self.last_layer = nn.Sequential(nn.Conv2d(total, total, kernel_size=1),
                                        nn.BatchNorm2d(total, momentum=config.bn_momentum), nn.ReLU(),
                                        nn.Conv2d(total, config.num_labels, k, padding=1 if k == 3 else 0))
        self.post_init()

    def segment(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        h, w = states[0].shape[-2:]
        ups = [states[0]] + [
            F.interpolate(s, size=(h, w), mode="bilinear", align_corners=True) for s in states[1:]
        ]
        return self.last_layer(torch.cat(ups, dim=1))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs
    ) -> MDEQSemanticSegmenterOutput | tuple:
        out = self.mdeq(pixel_values, output_hidden_states=True, return_dict=True)
        logits = self.segment(out.hidden_states)
        loss = None
        if labels is not None:
            up = F.interpolate(logits, size=labels.shape[-2:], mode="bilinear", align_corners=False)
            ignore = getattr(self.config, "semantic_loss_ignore_index", 255)
            loss = F.cross_entropy(up, labels.long(), ignore_index=ignore)
        return self._head_output(MDEQSemanticSegmenterOutput, out, logits, loss, output_hidden_states,
                                 return_dict)
