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

from typing import Any, Literal

from ...configuration_utils import ConfigError, DEQPretrainedConfig, preset, ranged, strict_config

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

@strict_config
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
    default_deq = DEFAULT_DEQ

    in_features: int = ranged(1, 16, default=2)
    out_features: int = ranged(1, 4096, default=1)
    hidden_size: int = ranged(1, 16384, default=256)  # the width cap; chunking large inputs is the caller's
    num_layers: int = ranged(1, 64, default=1)
    filter_type: Literal["siren", "fourier", "gabor"] = "siren"
    implicit: bool = True
    input_scale: float | int = ranged(0.0, None, open_low=True, default=256.0, as_float=True)
    gabor_alpha: float | int = ranged(0.0, None, open_low=True, default=3.0, as_float=True)
    spectral_max_norm: float | int | None = ranged(0.0, None, open_low=True, default=0.97, as_float=True)
    coordinate_range: list[float | int] | tuple[float | int, ...] = ranged(default=(-1.0, 1.0), as_float=True)
    out_of_range: Literal["raise", "allow"] = "raise"

    def validate_coordinate_range(self) -> None:
        """The coordinate range is two numbers, low < high."""
        low_high = self.coordinate_range
        if len(low_high) != 2 or not low_high[0] < low_high[1]:
            raise ConfigError(f"key 'coordinate_range' must be two finite numbers low < high, got "
                              f"{low_high!r}")


def _preset(filter_type: str, layers: int, width: int, implicit: bool, what: str) -> dict[str, Any]:
    return preset("implicit-representation", what, filter_type=filter_type, num_layers=layers,
                  hidden_size=width, implicit=implicit, architectures=["Implicit2ForSignalRepresentation"])


_NAMES = {"siren": "SIREN", "fourier": "Fourier-MFN", "gabor": "Gabor-MFN"}

# Named presets for deqzoo.create_model: the paper's 1L-256D / 1L-512D implicit networks and the explicit
# 1L / 4L-256D baselines, per filter. A 1L-256D preset that is an embedded checkpoint takes its name
# (implicit2-isiren-camera, implicit2-igabor-mfn-camera): one name per model.
_CHECKPOINTS = {"siren": "implicit2-isiren-camera", "gabor": "implicit2-igabor-mfn-camera"}
ARCHITECTURES: dict[str, dict[str, Any]] = {}
for _f, _n in _NAMES.items():
    _i = "isiren" if _f == "siren" else f"i{_f}-mfn"
    _e = "siren" if _f == "siren" else f"{_f}-mfn"
    ARCHITECTURES[_CHECKPOINTS.get(_f, f"implicit2-{_i}-1l256d")] = _preset(
        _f, 1, 256, True, f"implicit {_n}, 1 layer, D=256")
    ARCHITECTURES[f"implicit2-{_i}-1l512d"] = _preset(_f, 1, 512, True, f"implicit {_n}, 1 layer, D=512")
    ARCHITECTURES[f"implicit2-{_e}-1l256d"] = _preset(_f, 1, 256, False, f"explicit {_n}, 1 layer, D=256")
    ARCHITECTURES[f"implicit2-{_e}-4l256d"] = _preset(_f, 4, 256, False, f"explicit {_n}, 4 layers, D=256")
