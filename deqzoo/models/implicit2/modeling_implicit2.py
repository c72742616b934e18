"""Implicit² models: implicit (and explicit) SIREN / Fourier / Gabor filter networks over coordinates.

The input injection (every filter's response to the coordinates) is computed once per forward; f_θ is a
closure over it handed to the engine (`deqzoo.core.DEQ`), which owns the solve and the backward mode (NPG with
T = 1 by default, as the original). Fixed-point reuse across training steps goes through a
`deqzoo.core.FixedPointCache` that the caller owns and passes to `forward`; the spectral-norm bound on W
is kept
by `deqzoo.core.SpectralProjector` in the training loop (``model.spectral_weights()`` lists what it bounds).

Coordinates are (N, d) or (B, N, d) float tensors; the state is (B, N, D), one equilibrium per signal (B), so
the solver's stopping test is the original's whole-signal relative residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithNoAttention

from ...core import DEQ, FixedPointCache, SolverStats
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from ..initialization import default_init_
from .configuration_implicit2 import Implicit2Config

__all__ = [
    "Implicit2Filter", "Implicit2ForSignalRepresentation", "Implicit2Layer", "Implicit2Model",
    "Implicit2ModelOutput", "Implicit2Output", "Implicit2PreTrainedModel", "coordinate_grid",
]

# a coordinate may sit this far outside coordinate_range (float rounding of a grid's end points)
_RANGE_SLACK = 1e-6


def coordinate_grid(sizes: tuple[int, ...] | list[int], low: float = -1.0, high: float = 1.0,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A regular grid of coordinates over [low, high] per axis, end points included, as (prod(sizes), d).

    Axes are given outermost first (e.g. (height, width) or (frames, height, width)); coordinate 0
    varies along
    the last (fastest) axis, as the original's ``np.meshgrid(x, x)`` image grids do (x = column, y = row).

    Example:
        >>> coordinate_grid((2, 3)).tolist()[:4]
        [[-1.0, -1.0], [0.0, -1.0], [1.0, -1.0], [-1.0, 1.0]]
    """
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"coordinate_grid: sizes must be positive integers, got {sizes}")
    axes = [
        torch.linspace(low, high, s, dtype=torch.float64) if s > 1 else torch.zeros(1, dtype=torch.float64)
        for s in sizes
    ]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in reversed(mesh)], dim=-1).to(dtype)


class Implicit2Filter(nn.Module):
    """A filter's response to coordinates: the input map U x + c, and for MFNs the gate g(x).

    siren: injection U x + c (combined as sin(W z + b + U x + c)); fourier: g(x) = sin(U x + c);
    gabor: g(x) = sin(U x + c) · exp(-½ relu(γ) ||x - μ||²). Initialised as the original: U ~ default Linear
    init times `scale` (times sqrt(γ) for Gabor), c ~ U(-π, π), μ ~ U(-1, 1), γ ~ Gamma(alpha, 1).
    """

    def __init__(self, kind: str, in_features: int, hidden_size: int, scale: float, alpha: float):
        super().__init__()
        self.kind, self.scale, self.alpha = kind, float(scale), float(alpha)
        self.x_map = nn.Linear(in_features, hidden_size)
        self.x_map.frequency_scale = self.scale  # read by Implicit2PreTrainedModel._init_weights
        if kind == "gabor":
            self.mu = nn.Parameter(torch.empty(hidden_size, in_features))
            self.gamma = nn.Parameter(torch.empty(hidden_size))

    def response(self, x: torch.Tensor) -> torch.Tensor:
        """U x + c (siren) or g(x) (MFNs), shape (..., N, D)."""
        pre = self.x_map(x)
        if self.kind == "siren":
            return pre
        gate = torch.sin(pre)
        if self.kind == "gabor":
            gate = gate * torch.exp(self.log_envelope(x))
        return gate

    def log_envelope(self, x: torch.Tensor) -> torch.Tensor:
        """-½ relu(γ) ||x - μ||², (..., N, D), as one product with a (d + 2)-wide inner dimension:
        [x, 1, ||x||²] · [γ μᵀ; -½ γ ||μ||²; -½ γ]. The original expands ||x - μ||² the same way (no
        (N, D, d) intermediate); folding γ into the small factor leaves one full-size output instead of five
        full-size elementwise passes (forward and backward), which dominate a CPU training step."""
        g = F.relu(self.gamma)
        ones = x.new_ones(x.shape[:-1] + (1,))
        feats = torch.cat([x, ones, x.square().sum(-1, keepdim=True)], dim=-1)
        coef = torch.cat([self.mu.t() * g, (-0.5 * g * self.mu.square().sum(-1))[None], (-0.5 * g)[None]],
                         dim=0)
        return feats @ coef

    def combine(self, zlin: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        """The layer's output from W z + b and this filter's response."""
        return torch.sin(zlin + response) if self.kind == "siren" else zlin * response

    def initial(self, response: torch.Tensor) -> torch.Tensor:
        """g₀(x): the first filter applied to the original's constant input (ones for MFNs, zeros for
        SIREN)."""
        return torch.sin(response) if self.kind == "siren" else response


class Implicit2Layer(nn.Module):
    """One layer z -> filter(W z + b, x); W initialised U(±sqrt(1/D)) as the original (PyTorch's default)."""

    def __init__(self, kind: str, in_features: int, hidden_size: int, scale: float, alpha: float):
        super().__init__()
        self.z_map = nn.Linear(hidden_size, hidden_size)
        self.filter = Implicit2Filter(kind, in_features, hidden_size, scale, alpha)


@dataclass
class Implicit2ModelOutput(BaseModelOutputWithNoAttention, DEQModelOutput):
    """last_hidden_state: (B, N, D) equilibrium (or explicit) state; hidden_states: (the input injection
    g₀(x), the state) with ``output_hidden_states=True``; deq_stats: the solve's statistics (None for
    explicit networks)."""

    deq_stats: SolverStats | None = None


@dataclass
class Implicit2Output(DEQModelOutput):
    """loss: mean squared error against `labels` (if given); values: (B, N, C) or (N, C) signal values;
    last_hidden_state: the state; deq_stats: solve statistics (None for explicit networks)."""

    loss: torch.Tensor | None = None
    values: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    deq_stats: SolverStats | None = None


class Implicit2PreTrainedModel(DEQPreTrainedModel):
    """Weights I/O for Implicit² models (config class, the original's initialisation, prefix)."""

    config_class = Implicit2Config
    base_model_prefix = "implicit2"
    main_input_name = "coords"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # the original's scheme: PyTorch's default for every Linear (W, the head); a filter's map U x + c
        # draws U at that init times the filter's scale, c ~ U(-π, π); Gabor filters (met after their map)
        # draw μ ~ U(-1, 1), γ ~ Gamma(alpha, 1) and scale each row of U by sqrt(γ)
        if isinstance(module, nn.Linear):
            default_init_(module)
            scale = getattr(module, "frequency_scale", None)
            if scale is not None:
                bound = scale / math.sqrt(module.in_features)
                init.uniform_(module.weight, -bound, bound)
                init.uniform_(module.bias, -math.pi, math.pi)
        elif isinstance(module, Implicit2Filter) and module.kind == "gabor":
            init.uniform_(module.mu, -1.0, 1.0)
            init.copy_(module.gamma, torch.distributions.Gamma(module.alpha, 1.0).sample(module.gamma.shape))
            init.copy_(module.x_map.weight, module.x_map.weight * module.gamma.sqrt()[:, None])


class Implicit2Model(Implicit2PreTrainedModel):
    """The representation network's state z(x): implicit (z* = f(z*; x)) or explicit (f(0; x)).

    ``forward(coords, fixed_point_cache=None, cache_key="default")``: with a cache (training), the solve
    starts from the fixed point stored under `cache_key` for the same coordinates, and stores the new one.

    Example:
        >>> import torch
        >>> from deqzoo.models.implicit2 import Implicit2Config, Implicit2Model, coordinate_grid
        >>> model = Implicit2Model(Implicit2Config(hidden_size=32)).eval()
        >>> out = model(coordinate_grid((8, 8)))
        >>> out.last_hidden_state.shape, bool(out.deq_stats.converged.all())
        (torch.Size([1, 64, 32]), True)
    """

    _input_embed_layer = "init_filter"  # transformers' get_input_embeddings: the map of coordinates into u

    def __init__(self, config: Implicit2Config):
        super().__init__(config)
        c = config
        # the original divides every filter's frequency scale by sqrt(L + 1) and the Gabor prior by (L + 1)
        scale = c.input_scale / math.sqrt(c.num_layers + 1)
        alpha = c.gabor_alpha / (c.num_layers + 1)
        self.init_filter = Implicit2Filter(c.filter_type, c.in_features, c.hidden_size, scale, alpha)
        self.layers = nn.ModuleList(
            Implicit2Layer(c.filter_type, c.in_features, c.hidden_size, scale, alpha)
            for _ in range(c.num_layers)
        )
        self.deq = DEQ(c.deq_config)
        self.post_init()

    def spectral_weights(self) -> list[nn.Parameter]:
        """The z-to-z weights W whose spectral norm training keeps <= config.spectral_max_norm."""
        return [layer.z_map.weight for layer in self.layers]

    def check_coordinates(self, coords: torch.Tensor) -> torch.Tensor:
        """Validate coordinates ((N, d) or (B, N, d), finite, within coordinate_range); returns (B, N, d)."""
        c = self.config
        if not isinstance(coords, torch.Tensor):
            raise TypeError(f"coords must be a torch.Tensor, got {type(coords).__name__}")
        if not coords.is_floating_point():
            raise TypeError(f"coords must be a floating-point tensor, got dtype {coords.dtype}")
        if coords.dim() not in (2, 3) or coords.shape[-1] != c.in_features:
            raise ValueError(
                f"coords must have shape (N, {c.in_features}) or (B, N, {c.in_features}) for this model "
                f"(config.in_features={c.in_features}), got {tuple(coords.shape)}"
            )
        if coords.shape[-2] == 0:
            raise ValueError(f"coords has no points: shape {tuple(coords.shape)}")
        if torch.jit.is_tracing() or torch.compiler.is_exporting():
            # a traced or exported program cannot branch on values: the value checks below are the eager
            # model's (deqzoo.export documents that exported programs take coordinates as they come)
            return coords if coords.dim() == 3 else coords.unsqueeze(0)
        finite = torch.isfinite(coords)
        if not bool(finite.all()):
            bad = (~finite).any(-1).nonzero()[0].tolist()
            raise ValueError(f"coords contain NaN or infinite values (first at index {bad})")
        if c.out_of_range == "raise":
            low, high = c.coordinate_range
            lo, hi = float(coords.min()), float(coords.max())
            if lo < low - _RANGE_SLACK or hi > high + _RANGE_SLACK:
                raise ValueError(
                    f"coords span [{lo:.6g}, {hi:.6g}], outside the training range config.coordinate_range="
                    f"[{low:g}, {high:g}]; pass coordinates inside it or set config.out_of_range='allow' to "
                    "extrapolate"
                )
        return coords if coords.dim() == 3 else coords.unsqueeze(0)

    def injection(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """g₀(x) and every layer's filter response: computed once, reused by every f call of the solve."""
        return self.init_filter.initial(self.init_filter.response(x)), [
            layer.filter.response(x) for layer in self.layers
        ]

    def first_offset(self, u0: torch.Tensor, responses: list[torch.Tensor]) -> torch.Tensor:
        """The part of the first layer's pre-activation that does not depend on z: W₁ g₀(x) + b₁ (plus
        U₁x + c₁ for SIREN). Computed once per forward, so each f call of the solve costs one fused
        product (W₁ z + offset) and one elementwise op for the first layer."""
        first = self.layers[0]
        offset = first.z_map(u0)
        return offset + responses[0] if first.filter.kind == "siren" else offset

    def layer_stack(self, z: torch.Tensor | None, offset: torch.Tensor, responses: list[torch.Tensor]
    ) -> torch.Tensor:
        """f(z; x): z + g₀(x) through every layer; `offset` = first_offset(g₀(x), responses); z=None is
        the explicit network's zero state (its first pre-activation is the offset itself)."""
        h = None
        for i, (layer, r) in enumerate(zip(self.layers, responses)):
            if i == 0:
                if z is None:
                    pre = offset
                else:  # W z + offset in one fused product
                    flat = torch.addmm(offset.reshape(-1, offset.shape[-1]), z.reshape(-1, z.shape[-1]),
                                       layer.z_map.weight.t())
                    pre = flat.view(offset.shape)
                h = torch.sin(pre) if layer.filter.kind == "siren" else pre * r
            else:
                h = layer.filter.combine(layer.z_map(h), r)
        return h

    def forward(self, coords: torch.Tensor, fixed_point_cache: FixedPointCache | None = None,
                cache_key: str = "default", output_hidden_states: bool | None = None,
                return_dict: bool | None = None) -> Implicit2ModelOutput | tuple:
        x = self.check_coordinates(coords)
        u0, responses = self.injection(x)
        offset = self.first_offset(u0, responses)
        hidden = self._flag(output_hidden_states, "output_hidden_states")
        if not self.config.implicit:
            z = self.layer_stack(None, offset, responses)
            return self._output(Implicit2ModelOutput(
                last_hidden_state=z, hidden_states=(u0, z) if hidden else None), return_dict)

        z0 = u0.new_zeros(u0.shape)

        def f(z: torch.Tensor) -> torch.Tensor:
            return self.layer_stack(z, offset, responses)

        if fixed_point_cache is not None:  # starts from (and keeps) the fixed point of the last call
            z, stats = fixed_point_cache.solve(self.deq, cache_key, f, z0, key_input=x)
        else:
            z, stats = self.deq(f, z0)
        return self._output(Implicit2ModelOutput(
            last_hidden_state=z, hidden_states=(u0, z) if hidden else None, deq_stats=stats), return_dict)


class Implicit2ForSignalRepresentation(Implicit2PreTrainedModel):
    """An implicit representation of a signal: values Φ(x) = W′ z(x) + b′ at coordinates x.

    Signals are represented in [-1, 1] (images: 2·intensity - 1, as the original). `render` evaluates a
    2-D representation on any grid, e.g. at twice the fitted resolution.

    Example:
        >>> import torch
        >>> from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
        >>> cfg = Implicit2Config(hidden_size=32, filter_type="gabor")
        >>> model = Implicit2ForSignalRepresentation(cfg).eval()
        >>> image = model.render(12, 16)          # (H, W, C) in [0, 1]
        >>> image.shape, bool((image >= 0).all() and (image <= 1).all())
        (torch.Size([12, 16, 1]), True)
    """

    def __init__(self, config: Implicit2Config):
        super().__init__(config)
        self.implicit2 = Implicit2Model(config)
        self.head = nn.Linear(config.hidden_size, config.out_features)
        self.post_init()

    def spectral_weights(self) -> list[nn.Parameter]:
        return self.implicit2.spectral_weights()

    def forward(self, coords: torch.Tensor, labels: torch.Tensor | None = None,
                fixed_point_cache: FixedPointCache | None = None, cache_key: str = "default",
                output_hidden_states: bool | None = None, return_dict: bool | None = None
    ) -> Implicit2Output | tuple:
        out = self.implicit2(coords, fixed_point_cache=fixed_point_cache, cache_key=cache_key,
                             output_hidden_states=self._flag(output_hidden_states, "output_hidden_states"),
                             return_dict=True)
        values = self.head(out.last_hidden_state)
        if coords.dim() == 2:
            values = values.squeeze(0)
        loss = None
        if labels is not None:
            if labels.shape != values.shape:
                raise ValueError(f"labels have shape {tuple(labels.shape)}, the values {tuple(values.shape)}")
            loss = F.mse_loss(values, labels)
        return self._output(Implicit2Output(loss=loss, values=values, **out), return_dict)  # out: its fields

    @torch.no_grad()
    def sample(self, sizes: tuple[int, ...] | list[int], chunk: int = 65536) -> tuple[torch.Tensor, list]:
        """Values on a regular grid over coordinate_range, shape (*sizes, C), solved in chunks of `chunk`
        points; returns (values, per-chunk SolverStats)."""
        if len(sizes) != self.config.in_features:
            raise ValueError(
                f"sample needs {self.config.in_features} grid sizes (config.in_features), got {list(sizes)}"
            )
        if any(int(s) < 1 or int(s) > 16384 for s in sizes):
            raise ValueError(f"grid sizes must be integers in [1, 16384], got {list(sizes)}")
        low, high = self.config.coordinate_range
        p = next(self.parameters())
        grid = coordinate_grid(sizes, low, high, dtype=p.dtype).to(p.device)
        values, stats = self.values_at(grid, chunk)
        return values.reshape(*[int(s) for s in sizes], -1), stats

    @torch.no_grad()
    def values_at(self, coords: torch.Tensor, chunk: int = 65536) -> tuple[torch.Tensor, list[SolverStats]]:
        """Values at (N, d) coordinates, solved in chunks of `chunk` points (memory stays bounded);
        returns (values (N, C), per-chunk SolverStats, empty for explicit networks)."""
        values, stats = [], []
        for start in range(0, coords.shape[0], chunk):
            out = self(coords[start : start + chunk], return_dict=True)
            values.append(out.values)
            if out.deq_stats is not None:
                stats.append(out.deq_stats)
        return torch.cat(values), stats

    @torch.no_grad()
    def render(self, height: int, width: int, chunk: int = 65536) -> torch.Tensor:
        """A 2-D representation rendered at height x width as an (H, W, C) image in [0, 1]."""
        if self.config.in_features != 2:
            raise ValueError(
                f"render draws 2-D images; this model has in_features={self.config.in_features} "
                "(use sample(sizes))"
            )
        values, _ = self.sample((height, width), chunk)
        return ((values + 1) / 2).clamp(0, 1)
