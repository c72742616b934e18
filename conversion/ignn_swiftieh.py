"""Convert SwiftieH/IGNN (Gu et al. 2020, the original release) checkpoints to deqzoo IGNN.

Input: a state dict of the original ``IGNN`` module saved with ``torch.save(model.state_dict(), path)``
(plain, or under ``state_dict``/``model``), loaded with ``torch.load(weights_only=True)``.

Two original models are recognised from their keys:
- node classification (``nodeclassification/models_chains.py``, also Cora-style): ``ig1.{W, Omega_1,
  Omega_2, bias}``, ``X_0``, ``V.weight`` -> :class:`IGNNForNodeClassification`;
- graph classification (``graphclassification/models.py``): ``ig1..ig3``, ``V_0``, ``V_1`` ->
  :class:`IGNNForGraphClassification` with add pooling and λ_pf fixed to 1, as the original's forward does.

Mapping: ``igK.W`` -> ``layers.{K-1}.W.weight``, ``igK.Omega_1`` -> ``layers.{K-1}.Omega_1.weight`` (same
orientation). Dropped, because the original's forward never reads them: ``igK.Omega_2`` (its term is commented
out), ``igK.bias``, and ``X_0`` (the all-zero initial state; deqzoo also starts from zeros, a non-zero X_0 is
refused since it would only change the starting point). Solver settings follow the original: fixed-point
iteration, 300 steps, absolute tolerance 3e-6; ``kappa`` (not stored in a state dict) defaults to 0.9.

    deqzoo convert ignn-swiftieh ignn_chains.pt out_dir --option kappa=0.9
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ._common import check_output, fill_model, load_state_dict

__all__ = ["FORMATS", "convert", "load_state_dict", "save_converted"]


def layer_ids(sd: dict[str, torch.Tensor], src: Path) -> list[int]:
    ids = sorted({int(m.group(1)) for k in sd if (m := re.match(r"ig(\d+)\.", k))})
    if not ids:
        raise ValueError(f"{src}: no implicit layer keys 'ig1.*' found; keys: {sorted(sd)[:12]}")
    if ids != list(range(1, len(ids) + 1)):
        raise ValueError(f"{src}: implicit layers must be ig1..igN without gaps, found {ids}")
    return ids


def take(sd: dict[str, torch.Tensor], key: str, src: Path) -> torch.Tensor:
    if key not in sd:
        raise KeyError(f"{src}: missing key {key!r} (have {sorted(sd)})")
    return sd.pop(key)


def save_converted(
    model_cls, config, state: dict[str, torch.Tensor], out: str | Path, *, source: str, fmt: str
) -> Path:
    """Load `state` strictly into a fresh model (errors list missing/unexpected/mis-shaped keys), save it with
    a short model card."""
    from utils.cards import render_model_card

    model = model_cls(config)
    fill_model(model, state, source)
    out = Path(out)
    model.save_pretrained(out)
    meta = {
        "license": "mit",
        "library_name": "deqzoo",
        "tags": ["deqzoo", "deep-equilibrium", "ignn", "converted"],
        "pipeline_tag": "graph-ml",
    }
    body = f"""# {model_cls.__name__} converted from {fmt}

Converted with `deqzoo convert {fmt} {Path(source).name} {out.name}` from an original-format state dict.
Solver settings: `{config.deq}`; well-posedness: kappa={config.kappa}, norm_type={config.norm_type}.
No evaluation was run by the converter.
"""
    (out / "README.md").write_text(render_model_card(meta, body), encoding="utf-8")
    return out


def convert(
    src: str | Path,
    out: str | Path,
    *,
    kappa: float | None = 0.9,
    dropout: float = 0.5,
    deq: dict[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Convert an original SwiftieH/IGNN state dict into a deqzoo checkpoint directory `out`.

    Example:
        >>> src = "conversion/fixtures/ignn/swiftieh_node_state_dict.pt"
        >>> convert(src, "/tmp/ignn-conv")  # doctest: +SKIP
    """
    from deqzoo.models.ignn import IGNNConfig, IGNNForGraphClassification, IGNNForNodeClassification

    check_output(src, out)
    src = Path(src)
    sd = load_state_dict(src)
    ids = layer_ids(sd, src)
    state: dict[str, torch.Tensor] = {}
    x0 = sd.pop("X_0", None)
    if x0 is not None and x0.abs().max() > 0:
        raise ValueError(
            f"{src}: X_0 is not all zeros (max |X_0| = {x0.abs().max().item():.3g}); deqzoo starts the "
            "solve from zeros, as the original's released scripts do"
        )
    for k in ids:
        w, om = take(sd, f"ig{k}.W", src), take(sd, f"ig{k}.Omega_1", src)
        state[f"ignn.layers.{k - 1}.W.weight"] = w
        state[f"ignn.layers.{k - 1}.Omega_1.weight"] = om
        sd.pop(f"ig{k}.Omega_2", None)
        sd.pop(f"ig{k}.bias", None)
    hidden, in_features = state["ignn.layers.0.Omega_1.weight"].shape
    common = {
        "in_features": in_features,
        "hidden_size": hidden,
        "num_layers": len(ids),
        "kappa": kappa,
        "dropout": dropout,
        "injection": "adjacency",
        **({"deq": deq} if deq else {}),
    }
    if "V.weight" in sd:
        v = take(sd, "V.weight", src)
        state["classifier.weight"] = v
        cls = IGNNForNodeClassification
        config = IGNNConfig(num_labels=v.shape[0], architectures=[cls.__name__], **common, **options)
    elif "V_0.weight" in sd:
        v0w, v0b = take(sd, "V_0.weight", src), take(sd, "V_0.bias", src)
        v1w, v1b = take(sd, "V_1.weight", src), take(sd, "V_1.bias", src)
        state.update(
            {
                "pre_classifier.weight": v0w,
                "pre_classifier.bias": v0b,
                "classifier.weight": v1w,
                "classifier.bias": v1b,
            }
        )
        cls = IGNNForGraphClassification
        options = {"spectral_radius": 1.0, "graph_pooling": "add", **options}
        config = IGNNConfig(
            num_labels=v1w.shape[0],
            graph_head_hidden=v0w.shape[0],
            architectures=[cls.__name__],
            **common,
            **options,
        )
    else:
        raise ValueError(
            f"{src}: no classifier found (expected 'V.weight' for node classification or "
            f"'V_0.*'/'V_1.*' for graph classification); keys: {sorted(sd)}"
        )
    if sd:
        raise ValueError(f"{src}: unexpected key(s) {sorted(sd)} for the original IGNN layout")
    return save_converted(cls, config, state, out, source=str(src), fmt="ignn-swiftieh")


FORMATS = {"ignn-swiftieh": convert}
