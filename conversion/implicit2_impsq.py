"""Convert locuslab/ImpSq (Huang, Bai & Kolter 2021, the original release) checkpoints to deqzoo Implicit².

Input: a state dict of the original ``DEQImplicitNN`` (``modules/models.py``; the implicit networks and, with
``one_pass=True``, the explicit baselines of its summary dicts) saved with ``torch.save(model.state_dict(),
path)`` (plain, or under ``state_dict``/``model``), read with ``torch.load(weights_only=True)``. The training
scripts' ``*_summary.pth`` files keep such state dicts in ``summary[model_id]["state_dicts"]``: save one of
them on its own first (the summary also pickles numpy images, which a weights-only load refuses).

Mapping (``P = implicit_layer.f.``):
- ``P init_filter.x_map.*`` -> ``implicit2.init_filter.x_map.*``; Gabor ``mu``, ``gamma`` likewise;
- ``P layers.K.filter.*`` -> ``implicit2.layers.K.filter.*``;
- ``P layers.K.z_map.{weight_orig, weight_u, weight_v}`` (the original's spectral norm, target 0.97) folded
  into ``implicit2.layers.K.z_map.weight`` = W / max(1, σ / 0.97), σ = uᵀ W v from the stored vectors, exactly
  what the original computes in evaluation; a plain ``weight`` (norm "none") or ``weight_g``/``weight_v``
  (weight norm) are handled too;
- ``output_map.*`` -> ``head.*``.
Dropped: the Fourier filter's ``x_map_2`` (the original's forward never reads it) and the constant
``init_filter_in`` buffer (ones for MFNs, zeros for SIREN, which deqzoo's filters build in).

The filter type is recognised from the keys (``mu``/``gamma``: Gabor; ``x_map_2``: Fourier; neither: SIREN).
Whether the network is implicit is not stored in a state dict: ``--option implicit=false`` for the explicit
baselines (default true). Solver settings are the original's (`EVAL_DEQ`): ``modules/modeling_utils.py``'s
``construct_model_args(tol=1e-3, forward_solver="forward_iter")`` into ``DEQImplicitNN(max_iter=100)``,
whose ``forward_iteration`` stops at a relative residual ||f(z) - z|| / ||f(z)|| of 1e-3 over the whole
signal (deqzoo's Implicit² state is the whole signal as one sample, so the engine's per-sample test is the
same), at most 100 steps; backward: NPG with T = 1 (its ``OnestepBackward``).

    deqzoo convert implicit2-impsq camera_gabor.pt out_dir --option implicit=true
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ._common import fill_model, load_state_dict, original_returned_point, with_options

__all__ = ["EVAL_DEQ", "FORMATS", "convert", "fold_spectral_norm"]

# locuslab/ImpSq's evaluation: construct_model_args(tol=1e-3) -> DEQImplicitNN(tol, max_iter=100),
# forward_iter with stop_mode "rel" (the whole signal's residual)
EVAL_DEQ: dict[str, Any] = {"f_solver": "fixed_point", "f_max_iter": 100, "f_tol": 1e-3, "f_stop_mode": "rel"}

_P = "implicit_layer.f."


def fold_spectral_norm(
    w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, target: float = 0.97
) -> torch.Tensor:
    """The original's evaluation-time weight: W / max(1, σ / target) with σ = uᵀ W v (stored power
    vectors)."""
    sigma = torch.dot(u, w @ v)
    return w / torch.clamp(sigma / target, min=1.0)


def _take(sd: dict[str, torch.Tensor], key: str, src: Path) -> torch.Tensor:
    if key not in sd:
        raise KeyError(
            f"{src}: missing key {key!r} for the original DEQImplicitNN layout (have {sorted(sd)[:20]})"
        )
    return sd.pop(key)


def _filter(sd, prefix: str, dst: str, kind: str, state: dict, src: Path) -> None:
    state[f"{dst}.x_map.weight"] = _take(sd, f"{prefix}.x_map.weight", src)
    state[f"{dst}.x_map.bias"] = _take(sd, f"{prefix}.x_map.bias", src)
    if kind == "gabor":
        state[f"{dst}.mu"] = _take(sd, f"{prefix}.mu", src)
        state[f"{dst}.gamma"] = _take(sd, f"{prefix}.gamma", src)
    sd.pop(f"{prefix}.x_map_2.weight", None)
    sd.pop(f"{prefix}.x_map_2.bias", None)


def _z_map(sd, prefix: str, src: Path, target: float) -> torch.Tensor:
    if f"{prefix}.weight_orig" in sd:
        w = _take(sd, f"{prefix}.weight_orig", src)
        u, v = _take(sd, f"{prefix}.weight_u", src), _take(sd, f"{prefix}.weight_v", src)
        return fold_spectral_norm(w, u, v, target)
    if f"{prefix}.weight_g" in sd:
        g, v = _take(sd, f"{prefix}.weight_g", src), _take(sd, f"{prefix}.weight_v", src)
        return v * (g.reshape(-1, 1) / v.norm(dim=1, keepdim=True))
    return _take(sd, f"{prefix}.weight", src)


def convert(
    src: str | Path,
    out: str | Path,
    *,
    implicit: bool = True,
    input_scale: float = 256.0,
    spectral_target: float = 0.97,
    deq: dict[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Convert an original ImpSq ``DEQImplicitNN`` state dict into a deqzoo checkpoint directory `out`.

    Example:
        >>> src = "conversion/fixtures/implicit2/impsq_gabor_1l_implicit_state_dict.pt"
        >>> convert(src, "/tmp/implicit2-conv")  # doctest: +SKIP
    """
    from deqzoo.core.config import merge_settings
    from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
    from deqzoo.models.implicit2.configuration_implicit2 import DEFAULT_DEQ

    src = Path(src)
    sd = load_state_dict(src)
    if not isinstance(implicit, bool):
        raise ValueError(f"option implicit must be true or false, got {implicit!r}")
    layer_ids = sorted(
        {int(m.group(1)) for k in sd if (m := re.match(re.escape(_P) + r"layers\.(\d+)\.", k))}
    )
    if not layer_ids or layer_ids != list(range(len(layer_ids))):
        raise ValueError(
            f"{src}: expected layers {_P}layers.0..N-1, found {layer_ids}; keys: {sorted(sd)[:12]}"
        )
    if any(k.startswith(_P + "shared_layer.") for k in sd):
        raise ValueError(f"{src}: weight-shared MFNs (shared_layer) are not supported")
    if f"{_P}init_filter.mu" in sd:
        kind = "gabor"
    elif f"{_P}init_filter.x_map_2.weight" in sd:
        kind = "fourier"
    else:
        kind = "siren"
    sd.pop(f"{_P}init_filter_in", None)
    state: dict[str, torch.Tensor] = {}
    _filter(sd, f"{_P}init_filter", "implicit2.init_filter", kind, state, src)
    for k in layer_ids:
        state[f"implicit2.layers.{k}.z_map.weight"] = _z_map(
            sd, f"{_P}layers.{k}.z_map", src, spectral_target
        )
        state[f"implicit2.layers.{k}.z_map.bias"] = _take(sd, f"{_P}layers.{k}.z_map.bias", src)
        _filter(sd, f"{_P}layers.{k}.filter", f"implicit2.layers.{k}.filter", kind, state, src)
    state["head.weight"] = _take(sd, "output_map.weight", src)
    state["head.bias"] = _take(sd, "output_map.bias", src)
    if sd:
        raise ValueError(f"{src}: unexpected key(s) {sorted(sd)} for the original DEQImplicitNN layout")
    hidden, in_features = state["implicit2.init_filter.x_map.weight"].shape
    fixed = dict(in_features=in_features, out_features=state["head.weight"].shape[0], hidden_size=hidden,
                 num_layers=len(layer_ids), filter_type=kind, implicit=implicit, input_scale=input_scale,
                 architectures=[Implicit2ForSignalRepresentation.__name__],
                 deq=original_returned_point("impsq", merge_settings({**DEFAULT_DEQ, **EVAL_DEQ}, deq or {}),
                                             deq))
    config = Implicit2Config(**with_options(src, fixed, options))
    model = Implicit2ForSignalRepresentation(config)
    fill_model(model, state, src)
    out = Path(out)
    model.save_pretrained(out)
    _write_card(out, kind, implicit, config.deq)
    return out


def _write_card(path: Path, kind: str, implicit: bool, deq: dict[str, Any]) -> None:
    from utils.cards import render_model_card

    meta = {
        "license": "mit",
        "library_name": "deqzoo",
        "tags": ["deqzoo", "deep-equilibrium", "implicit2", "implicit-neural-representation", "converted"],
    }
    body = (
        f"# Implicit² ({'implicit' if implicit else 'explicit'} {kind}) converted from locuslab/ImpSq\n\n"
        f"Converted with `deqzoo convert implicit2-impsq` from an original-format state dict; the original's "
        f"spectral norm is folded into the weights. No evaluation was run by the converter.\n\n"
        f"Solver settings (the original's, locuslab/ImpSq): `{deq['f_solver']}` iteration, at most "
        f"{deq['f_max_iter']} steps, stop when the "
        f"{'relative' if deq['f_stop_mode'] == 'rel' else 'absolute'} residual of the whole signal is below "
        f"{deq['f_tol']:g}; backward `{deq['b_mode']}` "
        f"{deq.get('b_mode_kwargs', {})}.\n"
    )
    (path / "README.md").write_text(render_model_card(meta, body), encoding="utf-8")


FORMATS = {"implicit2-impsq": convert}
