"""Implicit² configuration: implicit (and explicit) SIREN / multiplicative filter networks over coordinates.

Huang, Bai & Kolter, "(Implicit)²: Implicit Layers for Implicit Representations", NeurIPS 2021
(locuslab/ImpSq). With an input-dependent filter g(x) and the injection u(x) = g₀(x):

- iSIREN (filter "siren"):  f(z; x) = sin(W (z + sin(V x)) + U x + b)
- iMFN (filter "fourier"/"gabor"):  f(z; x) = (W (z + g₀(x)) + b) ∘ g₁(x), g(x) = sin(U x + c) for Fourier,
  times exp(-γ/2 ||x - μ||²) for Gabor
- head: Φ(x) = W′ z* + b′.

``implicit=True`` solves z* = f(z*; x) (``num_layers`` layers applied in sequence form one f);
``implicit=False``
is the explicit baseline with the same layers applied once from z = 0 (a ``num_layers``-layer SIREN with input
injection, or a Fourier/Gabor MFN), so both share one code path, as in the original.
"""

from __future__ import annotations

import math
from typing import Any

from ...modeling_utils import DEQPretrainedConfig

FILTERS = ("siren", "fourier", "gabor")
OUT_OF_RANGE = ("raise", "allow")

# The original (locuslab/ImpSq, modules/modeling_utils.py: construct_model_args tol=1e-3; 1e-2 in its first
# commit only): forward iteration to a whole-signal relative residual of 1e-3 (at most 100 steps) and the
# one-term Neumann phantom gradient (its `OnestepBackward`: (I + Jᵀ) g), i.e. NPG with T = 1.
DEFAULT_DEQ: dict[str, Any] = {
    "f_solver": "fixed_point",
    "f_max_iter": 100,
    "f_tol": 1e-3,
    "f_stop_mode": "rel",
    "b_mode": "phantom",
    "b_mode_kwargs": {"k": 2, "tau": 1.0, "variant": "npg"},
}

# largest state a single forward may allocate without chunking is the caller's business; this caps the width
_MAX_HIDDEN = 16384


class Implicit2Config(DEQPretrainedConfig):
    """Configuration of an Implicit² representation network (implicit or explicit).

    Args:
        in_features: coordinate dimension (1 audio, 2 images, 3 video/volumes).
        out_features: signal channels (1 grayscale/audio, 3 RGB).
        hidden_size: state width D.
        num_layers: layers in f (implicit) or in the network (explicit); the paper's presets are 1L and 4L.
        filter_type: "siren", "fourier" or "gabor".
        implicit: solve z* = f(z*; x) (True) or apply the layers once from z = 0 (False, the baseline).
        input_scale: frequency scale of the filters' input maps, divided by sqrt(num_layers + 1) as in the
            original (256 for images).
        gabor_alpha: Gabor envelope precision prior γ ~ Gamma(gabor_alpha / (num_layers + 1), 1)
        (original: 3).
        spectral_max_norm: bound on the spectral norm of every W (kept by `deqzoo.core.SpectralProjector`
            after each optimizer step during training; the original reparametrizes to 0.97).
        coordinate_range: (low, high) of every coordinate seen in training (the original's grids span
        [-1, 1]).
        out_of_range: "raise" (default) rejects coordinates outside coordinate_range by more than 1e-6;
            "allow" extrapolates (sinusoids are defined everywhere; quality is not).
        deq: solver settings (DEQConfig dict); defaults follow the original (see DEFAULT_DEQ).

    Example:
        >>> from deqzoo.models.implicit2 import Implicit2Config
        >>> cfg = Implicit2Config(filter_type="gabor", hidden_size=256)
        >>> cfg.model_type, cfg.deq_config.b_mode, cfg.deq_config.b_mode_kwargs["k"]
        ('implicit2', 'phantom', 2)
    """

    model_type = "implicit2"

    def __init__(
        self,
        in_features: int = 2,
        out_features: int = 1,
        hidden_size: int = 256,
        num_layers: int = 1,
        filter_type: str = "siren",
        implicit: bool = True,
        input_scale: float = 256.0,
        gabor_alpha: float = 3.0,
        spectral_max_norm: float | None = 0.97,
        coordinate_range: tuple[float, float] | list[float] = (-1.0, 1.0),
        out_of_range: str = "raise",
        deq: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        deq = {**DEFAULT_DEQ, **(deq.to_dict() if hasattr(deq, "to_dict") else (deq or {}))}
        if filter_type not in FILTERS:
            raise ValueError(f"Implicit2Config.filter_type={filter_type!r}; choose one of {list(FILTERS)}")
        if out_of_range not in OUT_OF_RANGE:
            raise ValueError(
                f"Implicit2Config.out_of_range={out_of_range!r}; choose one of {list(OUT_OF_RANGE)}"
            )
        for name, value, hi in (
            ("in_features", in_features, 16),
            ("out_features", out_features, 4096),
            ("hidden_size", hidden_size, _MAX_HIDDEN),
            ("num_layers", num_layers, 64),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"Implicit2Config.{name} must be an integer in [1, {hi}], got {value!r}")
        if not isinstance(implicit, bool):
            raise ValueError(f"Implicit2Config.implicit must be a bool, got {implicit!r}")
        for name, value in (("input_scale", input_scale), ("gabor_alpha", gabor_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"Implicit2Config.{name} must be a finite number > 0, got {value!r}")
        if spectral_max_norm is not None and (
            isinstance(spectral_max_norm, bool)
            or not isinstance(spectral_max_norm, (int, float))
            or not 0 < spectral_max_norm < math.inf
        ):
            raise ValueError(
                f"Implicit2Config.spectral_max_norm must be > 0 or None, got {spectral_max_norm!r}"
            )
        rng = list(coordinate_range)
        if (
            len(rng) != 2
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in rng
            )
            or not rng[0] < rng[1]
        ):
            raise ValueError(
                "Implicit2Config.coordinate_range must be two finite numbers low < high, "
                f"got {coordinate_range!r}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.filter_type = filter_type
        self.implicit = implicit
        self.input_scale = float(input_scale)
        self.gabor_alpha = float(gabor_alpha)
        self.spectral_max_norm = None if spectral_max_norm is None else float(spectral_max_norm)
        self.coordinate_range = [float(rng[0]), float(rng[1])]
        self.out_of_range = out_of_range
        super().__init__(deq=deq, **kwargs)


def _preset(filter_type: str, layers: int, width: int, implicit: bool, what: str) -> dict[str, Any]:
    return {
        "task": "implicit-representation",
        "auto": "AutoModel",
        "config": {
            "filter_type": filter_type,
            "num_layers": layers,
            "hidden_size": width,
            "implicit": implicit,
            "architectures": ["Implicit2ForSignalRepresentation"],
        },
        "description": what,
    }


_NAMES = {"siren": "SIREN", "fourier": "Fourier-MFN", "gabor": "Gabor-MFN"}

# Named presets for deqzoo.create_model: the paper's 1L-256D / 1L-512D implicit networks and the explicit
# 1L / 4L-256D baselines, per filter.
ARCHITECTURES: dict[str, dict[str, Any]] = {}
for _f, _n in _NAMES.items():
    _i = "isiren" if _f == "siren" else f"i{_f}-mfn"
    _e = "siren" if _f == "siren" else f"{_f}-mfn"
    ARCHITECTURES[f"implicit2-{_i}-1l256d"] = _preset(_f, 1, 256, True, f"implicit {_n}, 1 layer, D=256")
    ARCHITECTURES[f"implicit2-{_i}-1l512d"] = _preset(_f, 1, 512, True, f"implicit {_n}, 1 layer, D=512")
    ARCHITECTURES[f"implicit2-{_e}-1l256d"] = _preset(_f, 1, 256, False, f"explicit {_n}, 1 layer, D=256")
    ARCHITECTURES[f"implicit2-{_e}-4l256d"] = _preset(_f, 4, 256, False, f"explicit {_n}, 4 layers, D=256")
