"""Convert TorchDEQ deq-zoo/ignn node-classification checkpoints (chains/Cora-style ``IGNN``) to deqzoo.

Input: ``torch.save(model.state_dict(), path)`` of TorchDEQ's ``models_chains.IGNN`` (one implicit layer
``ig1`` and a linear head ``V``), loaded with ``torch.load(weights_only=True)``. TorchDEQ's layer injects
``Â X Ω₁ᵀ + X Ω₂ᵀ`` (deqzoo ``injection="adjacency+linear"``) and normalizes W, Ω₁, Ω₂ with
``torchdeq.norm``: spectral norm keeps ``{name}_orig, {name}_g, {name}_u, {name}_v``, weight norm
``{name}_v, {name}_g``; deqzoo's :mod:`deqzoo.core.norm` uses the same names and formulas, so they map 1:1
(``ig1.W_orig`` -> ``ignn.layers.0.W.weight_orig`` ...). The norm type is read from the keys; the clip flag
is not stored in a state dict, so ``norm_clip`` / ``norm_clip_value`` default to ``run_ignn.sh``'s
``--norm_clip`` (value 1.0). TorchDEQ also applies the original's projection (``kappa``, default 0.9) to
the normalized W. Dropped: ``ig1.bias`` (never read) and ``X_0`` (zero initial state).

TorchDEQ's multi-width PPI model (``models_PPI.py``: five implicit layers of different widths with linear
skip projections and ELU) is a different architecture and is refused with a clear error.

    deqzoo convert ignn-torchdeq ignn_chains.pth out_dir --option norm_clip=true
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ._common import check_output, load_state_dict, original_returned_point
from .ignn_swiftieh import save_converted, take

__all__ = ["FORMATS", "convert"]

_SPECTRAL = ("_orig", "_g", "_u", "_v")


def _map_param(
    sd: dict[str, torch.Tensor], old: str, new: str, src: Path
) -> tuple[dict[str, torch.Tensor], str]:
    """Map one (possibly normalized) TorchDEQ parameter; returns the new keys and the norm type found."""
    if old + "_orig" in sd:
        return {new + ".weight" + s: take(sd, old + s, src) for s in _SPECTRAL}, "spectral_norm"
    if old + "_v" in sd and old + "_g" in sd:
        return {
            new + ".weight_v": take(sd, old + "_v", src),
            new + ".weight_g": take(sd, old + "_g", src),
        }, "weight_norm"
    return {new + ".weight": take(sd, old, src)}, "none"


def convert(
    src: str | Path,
    out: str | Path,
    *,
    kappa: float | None = 0.9,
    norm_clip: bool = True,
    norm_clip_value: float = 1.0,
    dropout: float = 0.5,
    deq: dict[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Convert a TorchDEQ deq-zoo/ignn chains-style state dict into a deqzoo checkpoint directory `out`."""
    from deqzoo.core.config import merge_settings
    from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification

    check_output(src, out)
    src = Path(src)
    sd = load_state_dict(src)
    if any(k.startswith(("ignn.", "proj.")) for k in sd):
        raise ValueError(
            f"{src}: this is TorchDEQ's multi-width PPI model (keys 'ignn.N.*', 'proj.N.*'), which "
            "deqzoo's IGNN family does not implement; only the chains/Cora-style 'ig1' + 'V' model "
            "converts"
        )
    x0 = sd.pop("X_0", None)
    if x0 is not None and x0.abs().max() > 0:
        raise ValueError(f"{src}: X_0 is not all zeros; deqzoo starts the solve from zeros")
    if not any(k.startswith("ig1.") for k in sd) or any(k.startswith("ig2.") for k in sd):
        raise ValueError(f"{src}: expected exactly one implicit layer 'ig1.*'; keys: {sorted(sd)}")
    state: dict[str, torch.Tensor] = {}
    kinds = set()
    for name in ("W", "Omega_1", "Omega_2"):
        mapped, kind = _map_param(sd, f"ig1.{name}", f"ignn.layers.0.{name}", src)
        state.update(mapped)
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(f"{src}: W, Omega_1, Omega_2 carry different normalizations {sorted(kinds)}")
    norm_type = kinds.pop()
    sd.pop("ig1.bias", None)
    v = take(sd, "V.weight", src)
    state["classifier.weight"] = v
    if sd:
        raise ValueError(f"{src}: unexpected key(s) {sorted(sd)} for TorchDEQ's chains IGNN layout")
    omega = state.get(
        "ignn.layers.0.Omega_1.weight_orig",
        state.get("ignn.layers.0.Omega_1.weight_v", state.get("ignn.layers.0.Omega_1.weight")),
    )
    hidden, in_features = omega.shape
    config = IGNNConfig(
        in_features=in_features,
        hidden_size=hidden,
        num_labels=v.shape[0],
        kappa=kappa,
        injection="adjacency+linear",
        norm_type=norm_type,
        norm_clip=norm_clip,
        norm_clip_value=norm_clip_value,
        dropout=dropout,
        architectures=[IGNNForNodeClassification.__name__],
        # TorchDEQ's solvers return f of the accepted iterate (conversion._common.RETURNED_POINT)
        deq=original_returned_point("torchdeq", merge_settings(IGNNConfig.default_deq, deq or {}), deq),
        **options,
    )
    return save_converted(IGNNForNodeClassification, config, state, out, source=str(src), fmt="ignn-torchdeq")


FORMATS = {"ignn-torchdeq": convert}
