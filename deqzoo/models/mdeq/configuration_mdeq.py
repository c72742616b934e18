"""MDEQConfig: the multiscale deep equilibrium model of Bai, Koltun & Kolter (NeurIPS 2020), and its Lipschitz
variant (Sato & Iiduka), with presets for every original release.

Field names follow the original yaml files (locuslab/mdeq, locuslab/deq ``MDEQ-Vision``) in snake case:

================================  =======================================================================
yaml key                          MDEQConfig field
================================  =======================================================================
MODEL.EXTRA.FULL_STAGE.NUM_CHANNELS   ``branch_channels`` (one per resolution; NUM_BRANCHES = its length)
MODEL.EXTRA.FULL_STAGE.NUM_BLOCKS     ``num_blocks``
MODEL.EXTRA.FULL_STAGE.BIG_KERNELS    ``big_kernels`` (0: 3x3 convs, 1: conv1 5x5, 2: both 5x5)
MODEL.EXTRA.FULL_STAGE.HEAD_CHANNELS  ``head_channels``
MODEL.EXTRA.FULL_STAGE.FINAL_CHANSIZE ``final_chansize``
MODEL.EXTRA.FINAL_CONV_KERNEL         ``final_conv_kernel`` (segmentation head)
MODEL.EXPANSION_FACTOR / NUM_GROUPS   ``expansion_factor`` / ``num_groups``
MODEL.DROPOUT / WNORM                 ``dropout`` / ``wnorm``
MODEL.DOWNSAMPLE_TIMES                ``downsample_times``
MODEL.{BLOCK,FUSE,POST}_GN_AFFINE     ``block_gn_affine`` / ``fuse_gn_affine`` / ``post_gn_affine``
MODEL.NUM_LAYERS                      ``num_layers`` (depth of the unrolled pretraining stack)
MODEL.NUM_CLASSES / DATASET.NUM_CLASSES  ``num_labels``
DEQ.F_SOLVER / F_THRES / STOP_MODE    ``deq = {"f_solver", "f_max_iter", "f_stop_mode"}``
DEQ.B_SOLVER / B_THRES                ``deq = {"b_solver", "b_max_iter"}``
================================  =======================================================================

Lipschitz MDEQ (``lipschitz=True``) swaps f_θ for the variant with a provable Lipschitz bound; see
:func:`deqzoo.models.mdeq.lipschitz.lipschitz_bound` for the pieces and the derivation.

Example:
    >>> from deqzoo.models.mdeq import MDEQConfig
    >>> cfg = MDEQConfig(**ARCHITECTURES["mdeq-cifar-tiny"]["config"])
    >>> cfg.num_branches, cfg.branch_channels
    (2, [24, 24])
"""

from typing import Any, Literal

from ...configuration_utils import ConfigError, DEQPretrainedConfig, preset, ranged, strict_config

__all__ = ["ARCHITECTURES", "MDEQConfig"]

_Numbers = float | int | list[float | int] | tuple[float | int, ...] | None
_Ints = list[int] | tuple[int, ...]


def _per_channel(value: _Numbers, channels: int) -> list[float]:
    if value is None:
        return [0.5] * channels
    return [float(value)] * channels if isinstance(value, (int, float)) else list(value)


@strict_config
class MDEQConfig(DEQPretrainedConfig):
    """Configuration of an MDEQ backbone and its heads.

    Args:
        in_channels: image channels (3 for RGB, 1 for grayscale).
        branch_channels: channels of each resolution stream, highest resolution first.
        num_blocks: residual blocks per stream (the originals use 1).
        big_kernels: per stream, 0 = 3x3 convs, 1 = 5x5 conv1, 2 = 5x5 conv1 and conv2.
        expansion_factor: width multiplier of the block's inner conv.
        num_groups: GroupNorm groups (post-fusion GroupNorms use num_groups // 2).
        dropout: variational (per-forward) channel dropout inside the residual blocks.
        wnorm: weight normalization of the blocks' and post-fusion convs (as the originals).
        downsample_times: stride-2 convs in the stem (0 for CIFAR, 2 for ImageNet/Cityscapes).
        block_gn_affine, fuse_gn_affine, post_gn_affine: affine GroupNorms in blocks / fusion / post-fusion.
        head_channels, final_chansize: classification head (bottleneck widths per stream, final width).
        final_conv_kernel: kernel of the segmentation head's last conv (1 or 3).
        bn_momentum: BatchNorm momentum of stem and heads (0.1 classification, 0.01 segmentation).
        num_layers: depth of the unrolled f_θ stack for warm-up pretraining (``unrolled_forward``).
        image_size: nominal input size (H, W), used by the image processor and timm's pretrained_cfg.
        image_mean, image_std: input normalization used by the image processor.
        lipschitz: use the Lipschitz MDEQ f_θ (Sato & Iiduka) with the five constants below.
        residual_alpha: α₁, block output = α₁·z + (1-α₁)·branch(z).
        fusion_alpha: α₂, fused_i = (1-α₂)·b_i + α₂·Σ_j softmax(w_i)_j·T_ij(b_j).
        conv_norm: c, bound on every f_θ conv's operator norm, kept by :func:`project_lipschitz`.
        gamma_bound: γ̄, bound on |γ| of the mean-only GroupNorms.
        relu_slope: a, f_θ's activation is a·ReLU.
        spectral_fft_size: FFT grid for the conv operator norm (exact bound for inputs up to size-2 pixels).
        init_std: std of the normal init of stem and head convs (the originals use 0.01).
        jac_loss_weight: weight of the engine's Jacobian regularizer (``deq={"jac_reg_samples": k}``) added to
            the training loss (the originals' JAC_LOSS_WEIGHT, Bai et al. 2021).
        deq: solver settings (a serialised :class:`~deqzoo.core.DEQConfig`).
    """

    model_type = "mdeq"
    # the names ecosystem tools read: input image channels, the width of the pooled features the head reads
    attribute_map = {"num_channels": "in_channels", "hidden_size": "final_chansize"}

    in_channels: int = ranged(1, 1024, default=3)
    branch_channels: _Ints = ranged(1, 65536, default=(24, 24))
    num_blocks: _Ints | None = ranged(1, 64, default=None)
    big_kernels: _Ints | None = ranged(0, 2, default=None)
    expansion_factor: float | int = ranged(1e-3, 64, default=5)
    num_groups: int = ranged(1, 4096, default=8)
    dropout: float | int = ranged(0.0, 1.0, open_high=True, default=0.0, as_float=True)
    wnorm: bool = True
    downsample_times: int = ranged(0, 8, default=0)
    block_gn_affine: bool = True
    fuse_gn_affine: bool = True
    post_gn_affine: bool = True
    head_channels: _Ints | None = ranged(1, 65536, default=None)
    final_chansize: int = ranged(1, 65536, default=200)
    final_conv_kernel: Literal[1, 3] = 1
    bn_momentum: float | int = ranged(0.0, 1.0, default=0.1, as_float=True)
    num_layers: int = ranged(0, 1024, default=10)
    image_size: _Ints = ranged(1, 65536, default=(32, 32))
    image_mean: _Numbers = ranged(default=None)
    image_std: _Numbers = ranged(default=None)
    lipschitz: bool = False
    residual_alpha: float | int = ranged(0.0, 1.0, default=0.5, as_float=True)
    fusion_alpha: float | int = ranged(0.0, 1.0, default=0.3, as_float=True)
    conv_norm: float | int = ranged(0.0, None, open_low=True, default=2.0, as_float=True)
    gamma_bound: float | int = ranged(0.0, None, open_low=True, default=1.0, as_float=True)
    relu_slope: float | int = ranged(0.0, None, open_low=True, default=0.35, as_float=True)
    spectral_fft_size: int = ranged(1, 8192, default=64)
    init_std: float | int = ranged(0.0, None, default=0.01, as_float=True)
    jac_loss_weight: float | int = ranged(0.0, None, default=0.0, as_float=True)

    def __post_init__(self, **kwargs: Any) -> None:
        self.in_channels = kwargs.pop("num_channels", self.in_channels)  # the alias, before it is read below
        channels = self.branch_channels = list(self.branch_channels)
        self.num_blocks = list(self.num_blocks) if self.num_blocks is not None else [1] * len(channels)
        self.big_kernels = list(self.big_kernels) if self.big_kernels is not None else [0] * len(channels)
        self.head_channels = (list(self.head_channels) if self.head_channels is not None
                              else [max(1, c // 4) for c in channels])
        self.image_size = list(self.image_size)
        # one number applies to every channel, as in transformers' image processors
        self.image_mean = _per_channel(self.image_mean, self.in_channels)
        self.image_std = _per_channel(self.image_std, self.in_channels)
        super().__post_init__(**kwargs)

    @property
    def num_branches(self) -> int:
        return len(self.branch_channels)

    def validate_streams(self) -> None:
        """Per-stream lists match branch_channels; GroupNorm groups divide every width; kernels exist."""
        n = self.num_branches
        if n < 1:
            raise ConfigError("key 'branch_channels' must name at least one resolution")
        for key in ("num_blocks", "big_kernels", "head_channels"):
            if len(getattr(self, key)) != n:
                raise ConfigError(f"key {key!r}={getattr(self, key)} has {len(getattr(self, key))} entries "
                                  f"but branch_channels={self.branch_channels} has {n}")
        groups = {"num_groups": self.num_groups,
                  "num_groups // 2 (post-fusion)": max(1, self.num_groups // 2)}
        for c in self.branch_channels:
            for label, g in groups.items():
                if c % g:
                    raise ConfigError(f"key 'branch_channels': entry {c} is not divisible by {label}={g}")
            if int(self.expansion_factor * c) % self.num_groups:
                raise ConfigError(f"key 'expansion_factor': expansion_factor*channels="
                                  f"{int(self.expansion_factor * c)} is not divisible by "
                                  f"num_groups={self.num_groups}")
        for key in ("image_mean", "image_std"):
            if len(_per_channel(getattr(self, key), self.in_channels)) != self.in_channels:
                raise ConfigError(f"key {key!r} needs {self.in_channels} entries (in_channels), got "
                                  f"{getattr(self, key)}")

    def validate_lipschitz(self) -> None:
        """Conv norms kept by projection, and an FFT grid large enough for the bound to hold."""
        if not self.lipschitz:
            return
        if self.wnorm:
            raise ConfigError("key 'wnorm': lipschitz=True keeps conv norms by projection; set wnorm=False")
        if self.spectral_fft_size < max(self.image_size) + 4:
            raise ConfigError(f"key 'spectral_fft_size'={self.spectral_fft_size} must be >= "
                              f"max(image_size)+4={max(self.image_size) + 4} for the conv-norm bound to hold")


# ---- presets: the original releases and ours --------------------------------------------------------------


def _deq(f_solver: str, f_thres: int, b_thres: int, stop_mode: str) -> dict[str, Any]:
    return {"f_solver": f_solver, "f_max_iter": f_thres, "f_stop_mode": stop_mode, "f_tol": 1e-3,
            "b_mode": "ift", "b_solver": f_solver, "b_max_iter": b_thres, "b_stop_mode": stop_mode,
            "b_tol": 1e-3}


_IMAGENET_STATS = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
_IMAGENET = {"image_size": [224, 224], **_IMAGENET_STATS, "num_labels": 1000, "dropout": 0.0,
             "downsample_times": 2, "deq": _deq("broyden", 26, 27, "abs")}
_CITYSCAPES = {"image_size": [1024, 2048], **_IMAGENET_STATS, "bn_momentum": 0.01, "final_conv_kernel": 1,
               "num_labels": 19, "downsample_times": 2, "num_layers": 3,
               "deq": _deq("broyden", 27, 30, "abs")}
_CIFAR = {"image_size": [32, 32], "image_mean": [0.4914, 0.4822, 0.4465],
          "image_std": [0.2023, 0.1994, 0.2010], "num_labels": 10, "expansion_factor": 5, "num_groups": 8,
          "downsample_times": 0, "post_gn_affine": False, "num_layers": 10,
          "deq": _deq("broyden", 18, 20, "rel")}
_WIDE = {"branch_channels": [80, 160, 320, 640], "expansion_factor": 5, "num_groups": 8}
_XL = {"branch_channels": [88, 176, 352, 704], "expansion_factor": 6, "num_groups": 8}

# Hyperparameters from locuslab/deq MDEQ-Vision/experiments/*/*.yaml (the maintained release; the CIFAR and
# Cityscapes files equal locuslab/mdeq's except POST_GN_AFFINE=false for CIFAR in MDEQ-Vision).
_MNIST_TINY: dict = {
    "in_channels": 1, "image_size": [28, 28], "image_mean": [0.1307], "image_std": [0.3081],
    "num_labels": 10,
    "branch_channels": [16, 16], "head_channels": [8, 16], "final_chansize": 64, "expansion_factor": 2,
    "num_groups": 4, "dropout": 0.0, "downsample_times": 1, "num_layers": 4,
    "deq": {"f_solver": "anderson", "f_max_iter": 20, "f_tol": 1e-3, "b_mode": "ift", "b_solver": "anderson",
            "b_max_iter": 12, "b_tol": 1e-3},
}
_LIPSCHITZ_SWITCHES: dict = {"wnorm": False, "lipschitz": True, "residual_alpha": 0.5, "fusion_alpha": 0.3,
                             "conv_norm": 2.0, "gamma_bound": 1.0, "relu_slope": 0.35,
                             "spectral_fft_size": 32}
_SMALL = {"branch_channels": [32, 64, 128, 256], "expansion_factor": 5, "num_groups": 8}
_CLS, _SEG = "image-classification", "image-segmentation"

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mdeq-cifar-tiny": preset(_CLS, "MDEQ-Tiny for CIFAR-10 (cls_mdeq_TINY.yaml): 2 streams of 24 "
                              "channels",
                              **_CIFAR, branch_channels=[24, 24], head_channels=[8, 16], final_chansize=200,
                              dropout=0.25),
    "mdeq-cifar-large": preset(_CLS, "MDEQ-Large for CIFAR-10 (cls_mdeq_LARGE.yaml): 4 streams 32-256 "
                               "channels",
                               **_CIFAR, branch_channels=[32, 64, 128, 256], head_channels=[14, 28, 56, 112],
                               final_chansize=1680, dropout=0.3),
    "mdeq-imagenet-small": preset(_CLS, "MDEQ-Small for ImageNet (cls_mdeq_SMALL.yaml)", **_IMAGENET,
                                  **_SMALL, head_channels=[24, 48, 96, 192], final_chansize=2048,
                                  num_layers=5),
    "mdeq-imagenet-large": preset(_CLS, "MDEQ-Large for ImageNet (cls_mdeq_LARGE.yaml of MDEQ-Vision)",
                                  **_IMAGENET, **_WIDE, head_channels=[32, 64, 128, 256],
                                  final_chansize=2048, num_layers=4),
    "mdeq-imagenet-xl": preset(_CLS, "MDEQ-XL for ImageNet (cls_mdeq_XL.yaml)", **_IMAGENET, **_XL,
                               head_channels=[32, 64, 128, 256], final_chansize=2048, num_layers=4),
    "mdeq-cityscapes-small": preset(_SEG, "MDEQ-Small for Cityscapes (seg_mdeq_SMALL.yaml)", **_CITYSCAPES,
                                    **_SMALL, dropout=0.05),
    "mdeq-cityscapes-large": preset(_SEG, "MDEQ-Large for Cityscapes (seg_mdeq_LARGE.yaml)", **_CITYSCAPES,
                                    **_WIDE, dropout=0.03),
    "mdeq-cityscapes-xl": preset(_SEG, "MDEQ-XL for Cityscapes (seg_mdeq_XL.yaml)", **_CITYSCAPES, **_XL,
                                 dropout=0.04),
    # ours: the embedded MNIST checkpoints (28x28 grayscale, 2 streams)
    "mdeq-tiny-mnist": preset(_CLS, "Tiny MDEQ for 28x28 grayscale digits (stride-2 stem, 2 streams of 16 "
                              "channels at 14x14 and 7x7); deqzoo/mdeq-tiny-mnist", **_MNIST_TINY),
    "mdeq-tiny-mnist-reversible": preset(
        _CLS, "mdeq-tiny-mnist's architecture trained with b_mode='reversible' (4 coupled steps, beta 0.8); "
        "deqzoo/mdeq-tiny-mnist-reversible",
        **{**_MNIST_TINY, "deq": {**_MNIST_TINY["deq"], "b_mode": "reversible", "f_max_iter": 4,
                                  "b_mode_kwargs": {"beta": 0.8}}}),
    "lipschitz-mdeq-tiny-mnist": preset(_CLS, "Lipschitz MDEQ (Sato & Iiduka) twin of mdeq-tiny-mnist; "
                                        "deqzoo/lipschitz-mdeq-tiny-mnist", **_MNIST_TINY,
                                        **_LIPSCHITZ_SWITCHES),
}
