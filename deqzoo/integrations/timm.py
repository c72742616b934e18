"""timm registry entries for MDEQ: ``timm.create_model("mdeq_*")`` after ``deqzoo.register()``.

Logits like any timm model (one solve per call); ``features_only=True``: one equilibrium map per resolution;
``pretrained=True`` loads through :func:`deqzoo.from_pretrained` (offline for embedded checkpoints). A
1-channel model converts an RGB batch to luminance (ITU-R 601, PIL's "L": timm's transforms give 3 channels;
the weights sum to 1, so converting after normalization equals normalizing the luminance).
``set_grad_checkpointing()`` recomputes the explicit head only (the solve keeps no activations), its batch
norms updating their statistics once per step.

Example:
    >>> import timm, torch, deqzoo
    >>> _ = deqzoo.register()
    >>> net = timm.create_model("mdeq_tiny_mnist", pretrained=True, features_only=True)
    >>> [f.shape[1:] for f in net(torch.randn(1, 1, 28, 28))]  # doctest: +SKIP
    [torch.Size([16, 14, 14]), torch.Size([16, 7, 7])]
    >>> net.feature_info.reduction()
    [2, 4]
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model, resolve_pretrained_cfg
from timm.models import checkpoint as timm_checkpoint
from torch import nn

from ..hub.loading import load_weights_file
from ..models.mdeq.configuration_mdeq import ARCHITECTURES, MDEQConfig
from ..models.mdeq.modeling_mdeq import MDEQForImageClassification
from ..models.registry import declared_family, timm_names

__all__ = ["MDEQTimm", "TIMM_MODELS"]

# ITU-R 601 luma weights, PIL's "L" conversion (deqzoo's image processor converts with PIL)
_LUMA = (0.299, 0.587, 0.114)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# timm name -> (deqzoo preset, deqzoo checkpoint id or None), derived from the MDEQ family's declaration
TIMM_MODELS: dict[str, tuple[str, str | None]] = timm_names(declared_family("mdeq"))


class MDEQTimm(MDEQForImageClassification):
    """MDEQ as a timm model: :class:`MDEQForImageClassification` itself (same modules, state-dict keys and
    config; a saved one loads back as this class) with timm's conventions: ``forward`` returns the logits
    tensor, ``forward_features`` / ``forward_head(pre_logits=)``, ``num_classes``, ``num_features``,
    ``reset_classifier``, ``feature_info`` and ``forward_intermediates`` for ``features_only``;
    ``timm.create_model`` adds ``pretrained_cfg`` / ``default_cfg``."""

    def __init__(self, config: MDEQConfig):
        super().__init__(config)
        self.num_classes = config.num_labels
        self.num_features = self.head_hidden_size = config.final_chansize
        self.in_chans = config.in_channels
        self.grad_checkpointing = False
        stride = 2**config.downsample_times
        self.feature_info = [dict(num_chs=c, reduction=stride * 2**i, module=f"mdeq.fullstage.branches.{i}")
                             for i, c in enumerate(config.branch_channels)]

    @classmethod
    def create(cls, preset: str, checkpoint: str | None = None, load_weights: bool = False,
               num_classes: int | None = None, in_chans: int | None = None, weights_file: str | None = None,
               **overrides: Any) -> MDEQTimm:
        """From a deqzoo preset (random init) or `checkpoint` (``load_weights``); ``deq={...}`` changes solver
        settings, other keywords override MDEQConfig fields of a randomly initialized model."""
        deq = overrides.pop("deq", None) or {}
        if load_weights and weights_file is None:
            if checkpoint is None:
                raise RuntimeError(f"no deqzoo checkpoint is published for preset {preset!r}; convert an "
                                   "original release with `deqzoo convert`, then deqzoo.from_pretrained")
            if overrides:
                raise ValueError(f"pretrained {checkpoint} cannot change architecture fields "
                                 f"{sorted(overrides)}")
            model = cls.from_pretrained(checkpoint, deq=deq or None)  # deqzoo's loader: offline when embedded
            if in_chans is not None and in_chans != model.config.in_channels:
                raise ValueError(f"{checkpoint} expects in_chans={model.config.in_channels}, got {in_chans}")
        else:
            kwargs = dict(ARCHITECTURES[preset]["config"])
            if not load_weights:  # a file's weights (pretrained_cfg_overlay) keep the preset's architecture
                if num_classes is not None:
                    kwargs["num_labels"] = max(num_classes, 1)
                if in_chans is not None and in_chans != kwargs.get("in_channels", 3):
                    kwargs["in_channels"] = in_chans
                    kwargs["image_mean"] = [0.5] * in_chans
                    kwargs["image_std"] = [0.5] * in_chans
            kwargs.update(overrides)
            kwargs["deq"] = {**kwargs.get("deq", {}), **deq}
            model = cls(MDEQConfig(**kwargs))
            if load_weights:  # pretrained_cfg_overlay=dict(file=...): that file's weights (checked)
                model = load_weights_file(model, weights_file).eval()
        if num_classes is not None and num_classes != model.num_classes:
            model.reset_classifier(num_classes)  # a new head (0: none, timm's features-only convention)
        return model

    # --- timm classification API ---
    def get_classifier(self) -> nn.Module:
        return self.classifier

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, randomly initialized head of `num_classes` outputs (0: none, ``forward`` gives the pooled
        features); the config follows, so a saved model reloads with its head."""
        self.num_classes = num_classes
        self.classifier = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            self.config.num_labels = num_classes

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch: recompute the explicit head in the backward pass (module docstring)."""
        self.grad_checkpointing = bool(enable)

    def _pixels(self, x: torch.Tensor) -> torch.Tensor:
        """RGB batches for a grayscale model -> luminance (module docstring); anything else unchanged."""
        if self.in_chans == 1 and x.dim() == 4 and x.shape[1] == 3:
            luma = x.new_tensor(_LUMA).view(1, 3, 1, 1)
            return (x * luma).sum(dim=1, keepdim=True)
        return x

    def _fuse(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not (self.grad_checkpointing and torch.is_grad_enabled() and self.training):
            return self.fuse(states)
        calls = 0

        def head(*s: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.fuse(s)
            with _running_stats_frozen(self):  # the recomputation: same batch statistics, no update
                return self.fuse(s)

        return timm_checkpoint(head, *states)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        # one solve, then the fusion (checkpointed when asked)
        return self._fuse(self.mdeq(self._pixels(x), output_hidden_states=True).hidden_states)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    # --- timm feature API (features_only uses FeatureGetterNet -> forward_intermediates) ---
    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        if output_fmt != "NCHW":
            raise ValueError(f"MDEQ features are NCHW; output_fmt={output_fmt!r} is not supported")
        take = take_indices(len(self.feature_info), indices)
        states = self.mdeq(self._pixels(x), output_hidden_states=True).hidden_states  # the one solve
        intermediates = [states[i] for i in take]
        if intermediates_only:
            return intermediates
        return self._fuse(states), intermediates

    def prune_intermediate_layers(self, indices: int | list[int] | None = None, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        take = take_indices(len(self.feature_info), indices)
        if prune_head:  # the classification head is not needed for feature maps
            self.incre_modules, self.downsamp_modules = nn.ModuleList(), nn.ModuleList()
            self.final_layer = nn.Identity()
            self.reset_classifier(0)
        return take


def take_indices(n: int, indices: int | Sequence[int] | None) -> list[int]:
    """timm's rule for which of `n` feature maps `forward_intermediates` returns: None = all, an int k = the
    last k, a sequence = those positions (negative ones count from the end). Ours because timm keeps its
    helper in a private module.

        >>> take_indices(4, None), take_indices(4, 2), take_indices(4, (0, -1))
        ([0, 1, 2, 3], [2, 3], [0, 3])
    """
    if indices is None or isinstance(indices, int):
        k = n if indices is None else indices
        if not 0 < k <= n:
            raise ValueError(f"indices={indices}: the last-n count must be 1 to {n}")
        return list(range(n - k, n))
    take = [i + n if i < 0 else i for i in indices]
    bad = [i for i, t in zip(indices, take) if not 0 <= t < n]
    if bad:
        raise ValueError(f"indices {bad} out of range for {n} feature maps (0 to {n - 1}, or -{n} to -1)")
    return take


@contextmanager
def _running_stats_frozen(module: nn.Module):
    """Momentum 0 and step counters restored: the checkpointed head's recomputation normalizes with the
    batch's statistics, as the first forward did, without a second update of the running ones."""
    norms = [m for m in module.modules() if isinstance(m, _BATCH_NORMS) and m.training and
             m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, steps) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(steps)


def _cfg(preset: str, checkpoint: str | None) -> dict[str, Any]:
    c = ARCHITECTURES[preset]["config"]
    channels = c.get("in_channels", 3)
    h, w = c["image_size"]
    cfg = {"input_size": (channels, h, w), "mean": tuple(c["image_mean"]), "std": tuple(c["image_std"]),
           "num_classes": c.get("num_labels", 1000), "interpolation": "bilinear", "crop_pct": 1.0,
           "first_conv": "mdeq.downsample.0", "classifier": "classifier", "license": "apache-2.0",
           "pool_size": None}
    if checkpoint:
        cfg["hf_hub_id"] = checkpoint
    return cfg


default_cfgs = generate_default_cfgs(
    {(f"{name}.deqzoo" if ckpt else name): _cfg(preset, ckpt) for name, (preset, ckpt) in TIMM_MODELS.items()}
)


def _create(name: str, pretrained: bool = False, **kwargs: Any) -> MDEQTimm:
    preset, checkpoint = TIMM_MODELS[name]
    n = len(ARCHITECTURES[preset]["config"]["branch_channels"])
    # timm's pretrained_cfg (with pretrained_cfg_overlay applied) may point the weights elsewhere
    cfg = resolve_pretrained_cfg(name, kwargs.get("pretrained_cfg"), kwargs.get("pretrained_cfg_overlay"))
    if cfg.url or cfg.hf_hub_filename or cfg.state_dict is not None:
        raise ValueError(f"{name}: pretrained_cfg url / hf_hub_filename / state_dict are not supported by "
                         "deqzoo (safetensors only): use file=<path.safetensors> or hf_hub_id=<id>")
    checkpoint = cfg.hf_hub_id or checkpoint
    builder = partial(MDEQTimm.create, preset, checkpoint, pretrained, weights_file=cfg.file)
    # weights are loaded by the builder through deqzoo (offline for embedded checkpoints), so timm's own
    # loader is told pretrained=False
    return build_model_with_cfg(builder, name, pretrained=False,
                                feature_cfg={"feature_cls": "getter", "out_indices": tuple(range(n))},
                                **kwargs)


def _register(name: str) -> None:
    def entry(pretrained: bool = False, **kwargs: Any) -> MDEQTimm:
        return _create(name, pretrained=pretrained, **kwargs)

    entry.__name__ = name
    entry.__qualname__ = name
    entry.__module__ = __name__
    preset, ckpt = TIMM_MODELS[name]
    entry.__doc__ = f"MDEQ preset {preset!r} (deqzoo)" + (f"; pretrained: {ckpt}" if ckpt else "")
    globals()[name] = register_model(entry)


for _name in TIMM_MODELS:
    _register(_name)
