"""HyperSolver: the learned initializer h_φ and HyperAnderson network s_ξ for one kind of DEQ state (the
update itself is `deqzoo.core.hyper`).

* ``multires`` (MDEQ, a map per resolution): h_φ = depthwise 3x3 conv + ReLU over the injection, pooled to
  each resolution, 1x1 conv; residuals compressed by adaptive average pooling to pool x pool.
* ``sequence`` (DEQ-Transformer, (L, d)): h_φ = causal Conv1d(k=3) + ReLU, linear to d; residuals: last token.
* ``vector``: no initializer; residuals compressed by 1-D adaptive pooling.

Compressors are adaptive, so any image size or length works. s_ξ: the window's compressed residuals (oldest
first, padded to m + 1 with a presence flag) over the newest one's norm, plus relative log-norms, through two
temporal Conv1d(k=3) layers giving α̂ per entry and β = 2·sigmoid(·) (1 at initialisation).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from ..core.hyper import HyperNet
from ..hub.catalog import sha256_file
from .configuration import HyperSolverConfig
from .io import read_hypersolver, save_hypersolver

__all__ = ["HyperSolver"]

_EPS = 1e-20


class HyperSolver(nn.Module, PyTorchModelHubMixin, library_name="deqzoo", tags=["deqzoo", "hyperdeq"]):
    """A hypersolver: ``initial_state(injection, shapes)`` (h_φ) and ``bind(shapes)`` (s_ξ for flat states).

    Saved, loaded and pushed with huggingface_hub's mixin (``save_pretrained``, ``from_pretrained``,
    ``push_to_hub``), with deqzoo's checks and atomic saves (`deqzoo.hypersolver.io`).

    Example:
        >>> import torch
        >>> from deqzoo.hypersolver import HyperSolver, HyperSolverConfig
        >>> hs = HyperSolver(HyperSolverConfig(state_kind="multires", state_channels=[4, 4],
        ...                                    injection_channels=4))
        >>> shapes = [(2, 4, 8, 8), (2, 4, 4, 4)]
        >>> [tuple(z.shape) for z in hs.initial_state(torch.randn(2, 4, 8, 8), shapes)]
        [(2, 4, 8, 8), (2, 4, 4, 4)]
        >>> net = hs.bind(shapes)
        >>> net.compress(torch.randn(2, 4 * 64 + 4 * 16)).shape
        torch.Size([2, 8])
    """

    def __init__(self, config: HyperSolverConfig):
        super().__init__()
        self.config = config
        c = config
        inj, h = c.injection_channels, c.init_hidden
        if c.state_kind == "multires" and inj:
            self.init_conv = nn.Conv2d(inj, inj, 3, padding=1, groups=inj)
            self.init_proj = nn.ModuleList(nn.Conv2d(inj, ch, 1) for ch in c.state_channels)
        elif c.state_kind == "sequence" and inj:
            self.init_conv = nn.Conv1d(inj, h, 3)
            self.init_proj = nn.Linear(h, c.state_channels[0])
        else:
            self.init_conv = None
            self.init_proj = None
        width = self.feature_width() + 2  # + relative log-norm + presence flag
        self.mix1 = nn.Conv1d(width, c.mix_hidden, 3, padding=1)
        self.mix2 = nn.Conv1d(c.mix_hidden, 2, 3, padding=1)
        with torch.no_grad():  # start as equal weights and β = 1
            self.mix2.weight.zero_()
            self.mix2.bias.zero_()
        if self.init_proj is not None:  # start near the zero initial state the model uses
            with torch.no_grad():
                for p in self.init_proj if isinstance(self.init_proj, nn.ModuleList) else [self.init_proj]:
                    p.weight.mul_(0.1)
                    p.bias.zero_()

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> Path:
        """The mixin's save, atomic and keeping other files (`deqzoo.hypersolver.save_hypersolver`)."""
        return save_hypersolver(self, save_directory, **kwargs)

    def _save_pretrained(self, save_directory: Path) -> None:
        """The mixin's model.safetensors, then its sha256 into the config the mixin writes next."""
        super()._save_pretrained(save_directory)
        self.config.training["weights_sha256"] = sha256_file(Path(save_directory) / "model.safetensors")

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs) -> HyperSolver:
        """Load and verify (`deqzoo.hypersolver.load_hypersolver`): safetensors only, never the mixin's pickle
        fallback; hub keywords (revision, cache_dir, token, local_files_only, ...) as in huggingface_hub."""
        return read_hypersolver(cls, name_or_path, **hub_kwargs)

    def feature_width(self) -> int:
        c = self.config
        if c.state_kind == "multires":
            return sum(c.state_channels) * c.pool * c.pool
        if c.state_kind == "sequence":
            return c.state_channels[0]
        return c.pool

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def has_initializer(self) -> bool:
        return self.init_conv is not None

    def check_shapes(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Raise a clear error when a model's state does not have the structure this hypersolver serves."""
        c = self.config
        shapes = [tuple(s) for s in shapes]
        if c.state_kind == "multires":
            ok = len(shapes) == len(c.state_channels) and all(len(s) == 4 and s[1] == ch
                                                              for s, ch in zip(shapes, c.state_channels))
            want = f"{len(c.state_channels)} maps (B, C, H, W) with C = {c.state_channels}"
        elif c.state_kind == "sequence":
            ok = len(shapes) == 1 and len(shapes[0]) == 3 and shapes[0][2] == c.state_channels[0]
            want = f"one (B, L, {c.state_channels[0]}) tensor"
        else:
            ok = True
            want = "any state"
        if not ok:
            raise ValueError(f"hypersolver for state kind {c.state_kind!r} (model {c.model_id or '?'}) needs "
                             f"{want}; this model's state has shapes {shapes}")

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        p = self.mix1.weight
        return t.to(p.device, p.dtype)

    def initial_state(self, injection: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """h_φ(injection): one tensor per state shape (in the injection's dtype and device)."""
        c = self.config
        if self.init_conv is None:
            raise ValueError("this hypersolver has no initializer (injection_channels = 0)")
        self.check_shapes(shapes)
        x = self._own(injection)
        if x.shape[-1 if c.state_kind == "sequence" else 1] != c.injection_channels:
            raise ValueError(f"hypersolver initializer expects an injection with {c.injection_channels} "
                             f"channels, got shape {tuple(injection.shape)}")
        if c.state_kind == "multires":
            out = self._multires_init(x, shapes)
        else:  # sequence: causal conv over positions (left padding), so no position sees a later token
            h = F.relu(self.init_conv(F.pad(x.transpose(1, 2), (2, 0))))
            out = [self.init_proj(h.transpose(1, 2))]
        return [o.to(injection.device, injection.dtype) for o in out]

    def _multires_init(self, x: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """h_φ for image maps, in channels-last layout: torch's CPU depthwise and 1x1 convolutions are 10-50x
        slower on (B, C, H, W) than the channels-last convolution and a matrix product, and h_φ must cost a
        small part of one f evaluation to pay. Pooling is skipped where a resolution has the injection's size
        (adaptive pooling to the same size is an identity that torch still computes)."""
        h = F.relu(self.init_conv(x.contiguous(memory_format=torch.channels_last)))
        out = []
        for proj, s in zip(self.init_proj, shapes):
            pooled = h if tuple(h.shape[-2:]) == tuple(s[-2:]) else F.adaptive_avg_pool2d(h, s[-2:])
            # a 1x1 convolution is a linear map over channels: (B, H, W, C) @ Wᵀ, back to (B, C', H, W)
            mapped = F.linear(pooled.permute(0, 2, 3, 1), proj.weight.flatten(1), proj.bias)
            out.append(mapped.permute(0, 3, 1, 2))
        return out

    def compress(self, g: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """Flat residuals (B, D) -> (B, feature_width()) features."""
        c = self.config
        g = self._own(g)
        if c.state_kind == "multires":
            parts = zip(g.split([math.prod(s[1:]) for s in shapes], 1), shapes)  # one flat part per map
            return torch.cat([F.adaptive_avg_pool2d(x.reshape(-1, *s[1:]), c.pool).flatten(1)
                              for x, s in parts], 1)
        if c.state_kind == "sequence":
            d = shapes[0][2]
            return g[:, -d:]  # the last token's residual
        return F.adaptive_avg_pool1d(g[:, None], c.pool)[:, 0]

    def mix(self, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed residuals (B, n, c), oldest first, n <= m + 1 -> (α̂ (B, n), β (B,))."""
        b, n, _ = C.shape
        window = self.config.m + 1
        norms = torch.linalg.vector_norm(C, dim=2)  # (B, n)
        newest = norms[:, -1:].clamp_min(_EPS)
        feats = torch.cat((C / newest[:, :, None], torch.log((norms + _EPS) / newest)[:, :, None],
                           torch.ones_like(norms)[:, :, None]), 2)
        if n < window:  # pad the older end: absent entries are zeros with presence 0
            feats = torch.cat((feats.new_zeros(b, window - n, feats.shape[2]), feats), 1)
        out = self.mix2(F.relu(self.mix1(feats.transpose(1, 2))))  # (B, 2, window)
        alpha_hat = out[:, 0, window - n :]
        beta = 2.0 * torch.sigmoid(out[:, 1, -1])
        return alpha_hat, beta

    def bind(self, shapes: Sequence[tuple[int, ...]]) -> HyperNet:
        """The engine's view (`deqzoo.core.hyper.HyperNet`: ``compress(g)``, ``mix(C)``) for states of these
        shapes (batch first): what `solve(..., solver="hyperanderson", net=...)` takes."""
        self.check_shapes(shapes)
        return SimpleNamespace(compress=functools.partial(self.compress, shapes=[tuple(s) for s in shapes]),
                               mix=self.mix)


def load_hypersolver(name_or_path: str | os.PathLike, **hub_kwargs) -> HyperSolver:
    """Load and verify a hypersolver (``HyperSolver.from_pretrained``; checks in `deqzoo.hypersolver.io`).

    Example:
        >>> hs = load_hypersolver("deqzoo/hyperdeq-mdeq-tiny-mnist")  # doctest: +SKIP
    """
    return HyperSolver.from_pretrained(name_or_path, **hub_kwargs)
