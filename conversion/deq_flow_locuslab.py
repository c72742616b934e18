"""Convert locuslab/deq-flow (Bai, Geng, Savani & Kolter, CVPR 2022) release checkpoints to deqzoo DEQ-Flow.

Input: the released ``.pth`` state dicts of ``DEQFlow`` (code.v.2.0 ``core/deq_flow.py``) or of the v1.0
``DEQFlowIndexing``/``DEQFlowSliced`` (code.v.1.0 ``core/deq.py``), as written by
``torch.save(model.state_dict())`` under ``nn.DataParallel`` (a ``module.`` prefix, removed), read with
``torch.load(weights_only=True)``. Sizes B, H (``--huge``), large/gigantic and tiny (v2 ``--tiny``), with or
without GMA (``--gma``), with or without weight normalisation (``--wnorm``), are recognised from the tensor
shapes; v1's ``--small`` (a different encoder and update block) is refused with a clear error.

Mapping (original -> deqzoo; torchvision's RAFT module names):
- ``fnet.*`` / ``cnet.*`` -> ``feature_encoder.*`` / ``context_encoder.*``: ``conv1``/``norm1`` ->
  ``convnormrelu.0``/ ``.1``; ``layerK.J.conv1``/``norm1`` -> ``layerK.J.convnormrelu1.0``/``.1``,
  ``conv2``/``norm2`` -> ``convnormrelu2``; ``layerK.J.downsample.0/.1`` unchanged; ``conv2`` -> ``conv``.
- ``update_block.encoder.convc1/convc2/convf1/convf2/conv`` -> ``update_block.motion_encoder.convcorr1.0/
  convcorr2.0/convflow1.0/convflow2.0/conv.0``; ``update_block.gru.conv{z,r,q}{1,2}`` ->
  ``update_block.recurrent_block.convgru{1,2}.conv{z,r,q}``; ``update_block.flow_head.*`` unchanged.
- ``mask.0/.2`` (v2) or ``update_block.mask.0/.2`` (v1) -> ``mask_predictor.convrelu.0`` /
  ``mask_predictor.conv``.
- GMA: ``attn.to_qk`` -> ``attention.to_qk``; ``update_block.gma.{to_v,gamma,project}`` ->
  ``update_block.aggregate.*``.
Weight-normalised layers keep ``weight_g``/``weight_v`` (deqzoo's engine weight norm uses the same names and
recomputes the weight once per forward, as the original); ``--option fold_weight_norm=true`` folds them into
plain weights (w = g · v / ||v||, outputs unchanged) and builds the model without weight norm.

Solver settings are the original's evaluation settings for the release the checkpoint comes from
(`eval_settings`; the release is told by where the mask head lives: ``update_block.mask`` in v1.0, ``mask``
in v2.0):

* v2.0 (``code.v.2.0/val.sh``: ``--f_solver naive_solver --f_thres 40 --eval_factor 1.5``, with
  ``arg_utils``' defaults ``--f_stop_mode abs --f_eps 1e-3``): plain fixed-point iteration, 60 steps, stop
  when the absolute residual is below 1e-3;
* v1.0 (``code.v.1.0/val.sh``; ``main.py``'s defaults ``--stop_mode abs --eval_factor 1.5``, and ``deq.py``'s
  ``eps=1e-3`` in abs mode): DEQ-Flow-B with Anderson (``--f_thres 40``: 60 steps; m = 6, β = 1 as its
  ``anderson``), DEQ-Flow-H (hidden width 256, ``--huge``) with Broyden (``--f_thres 36``: 54 steps, full
  memory); absolute tolerance 1e-3.

The stop test is applied to (h, coords1), the original's state: deqzoo's state is (h, flow) with flow =
coords1 - coords0 and coords0 fixed, so f(z) - z and hence the absolute residual are the same numbers. The
engine tests each sample's residual (as v2.0's solvers do); v1.0's Anderson tests the batch mean and its
Broyden the norm over the batch, which is the same at batch 1 (the original's validation runs one pair at a
time).

    deqzoo convert deq-flow-locuslab deq-flow-H-things-test-3x.pth out_dir
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ._common import fill_model, load_state_dict, original_returned_point, with_options

__all__ = ["FORMATS", "convert", "convert_state_dict", "eval_settings", "fold_weight_norm", "release_version",
           "v1_solver_options"]

# v2.0's val.sh: naive_solver, f_thres 40 x eval_factor 1.5, abs stop at f_eps 1e-3 (arg_utils' defaults)
EVAL_DEQ = {"f_solver": "fixed_point", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}
# v1.0's val.sh (main.py: stop_mode abs, eval_factor 1.5; deq.py: eps 1e-3 in abs mode)
EVAL_DEQ_V1_B = {"f_solver": "anderson", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}
EVAL_DEQ_V1_H = {"f_solver": "broyden", "f_max_iter": 54, "f_tol": 1e-3, "f_stop_mode": "abs"}


def v1_solver_options(solver: str, stop_mode: str, hidden_dim: int) -> dict[str, Any]:
    """The engine options that make deqzoo's solver the v1.0 release's (code.v.1.0/core/lib/solvers.py; issue
    58): its anderson (m 6, β 1) regularises the Gram matrix with an absolute lam 1e-4; its broyden also stops
    when the last 30 residuals are within a ratio 1.3 below 3 tol, and on a protective break above
    (1e6 abs, 1e3 rel) x positions x its first residual, i.e. per element of the (h, flow) state of
    hidden_dim + 2 channels a position.

    Example:
        >>> v1_solver_options("broyden", "abs", 126)
        {'stall_window': 30, 'protect_per_element': 7812.5}
    """
    if solver == "anderson":
        return {"m": 6, "tau": 1.0, "lam": 1e-4, "lam_mode": "abs"}
    if solver == "broyden":
        per_position = 1e6 if stop_mode == "abs" else 1e3
        return {"stall_window": 30, "protect_per_element": per_position / (hidden_dim + 2)}
    return {}

_ENCODER = [
    (r"conv1\.(weight|bias)$", r"convnormrelu.0.\1"),
    (r"norm1\.(.+)$", r"convnormrelu.1.\1"),
    (r"(layer\d\.\d)\.conv1\.(.+)$", r"\1.convnormrelu1.0.\2"),
    (r"(layer\d\.\d)\.norm1\.(.+)$", r"\1.convnormrelu1.1.\2"),
    (r"(layer\d\.\d)\.conv2\.(.+)$", r"\1.convnormrelu2.0.\2"),
    (r"(layer\d\.\d)\.norm2\.(.+)$", r"\1.convnormrelu2.1.\2"),
    (r"(layer\d\.\d)\.norm3\.(.+)$", r"\1.downsample.1.\2"),  # the same module as downsample.1
    (r"(layer\d\.\d)\.downsample\.(\d)\.(.+)$", r"\1.downsample.\2.\3"),
    (r"conv2\.(weight|bias)$", r"conv.\1"),
]
_MOTION = {
    "convc1": "convcorr1.0",
    "convc2": "convcorr2.0",
    "convf1": "convflow1.0",
    "convf2": "convflow2.0",
    "conv": "conv.0",
}


def _rename(key: str) -> str | None:
    """The deqzoo name of an original key (None: a key with no deqzoo counterpart)."""
    for src, dst in (("fnet.", "feature_encoder."), ("cnet.", "context_encoder.")):
        if key.startswith(src):
            rest = key[len(src) :]
            for pat, rep in _ENCODER:
                if re.match(pat, rest):
                    return dst + re.sub(pat, rep, rest)
            return None
    if m := re.match(r"update_block\.encoder\.(\w+)\.(.+)$", key):
        return (
            f"update_block.motion_encoder.{_MOTION[m.group(1)]}.{m.group(2)}"
            if m.group(1) in _MOTION
            else None
        )
    if m := re.match(r"update_block\.gru\.conv([zrq])([12])\.(.+)$", key):
        return f"update_block.recurrent_block.convgru{m.group(2)}.conv{m.group(1)}.{m.group(3)}"
    if key.startswith("update_block.flow_head."):
        return key
    if m := re.match(r"(?:update_block\.)?mask\.([02])\.(.+)$", key):
        return f"mask_predictor.{'convrelu.0' if m.group(1) == '0' else 'conv'}.{m.group(2)}"
    if m := re.match(r"attn\.to_qk\.(.+)$", key):
        return f"attention.to_qk.{m.group(1)}"
    if m := re.match(r"update_block\.gma\.(.+)$", key):
        return f"update_block.aggregate.{m.group(1)}"
    return None


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every ``X.weight_g``/``X.weight_v`` pair by ``X.weight = g · v / ||v||`` (norm over all but the
    output dimension, as the original's weight norm with dim 0)."""
    out = dict(state)
    for key in [k for k in state if k.endswith(".weight_g")]:
        base = key[: -len("_g")]
        g, v = out.pop(key).float(), out.pop(base + "_v").float()  # in float32 even for half-precision files
        norm = v.reshape(v.shape[0], -1).norm(dim=1).reshape(-1, *([1] * (v.dim() - 1)))
        out[base] = v * (g.reshape(-1, *([1] * (v.dim() - 1))) / norm)
    return out


def _dim(state: dict[str, torch.Tensor], key: str, axis: int, src: Path) -> int:
    for suffix in ("weight", "weight_v"):
        if f"{key}.{suffix}" in state:
            return int(state[f"{key}.{suffix}"].shape[axis])
    raise ValueError(f"{src}: missing {key}.weight (or weight_v); is this a DEQ-Flow checkpoint?")


def convert_state_dict(
    sd: dict[str, torch.Tensor], src: str | Path, *, fold: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Original keys -> deqzoo keys, and the DEQFlowConfig fields the shapes imply."""
    src = Path(src)
    if not any(k.startswith("update_block.encoder.convc1") for k in sd):
        raise ValueError(
            f"{src}: no update_block.encoder.convc1 weights: not a DEQ-Flow state dict; keys: "
            f"{sorted(sd)[:10]}"
        )
    if "update_block.encoder.convc2.weight" not in sd and "update_block.encoder.convc2.weight_v" not in sd:
        raise ValueError(
            f"{src}: a v1.0 '--small' DEQ-Flow (SmallEncoder / SmallUpdateBlock) is not supported"
        )
    state: dict[str, torch.Tensor] = {}
    dropped = []
    for key, value in sd.items():
        new = _rename(key)
        if new is None:
            dropped.append(key)
        else:
            state[new] = value
    if dropped:
        raise ValueError(f"{src}: key(s) with no deqzoo counterpart: {sorted(dropped)[:20]}")
    weight_norm = any(k.endswith(".weight_g") for k in state)
    if weight_norm and fold:
        state, weight_norm = fold_weight_norm(state), False
    planes = _dim(sd, "update_block.encoder.convc1", 1, src)
    radius = next((r for r in range(0, 17) if 4 * (2 * r + 1) ** 2 == planes), None)
    if radius is None:
        raise ValueError(f"{src}: {planes} correlation planes is not 4 levels x (2r+1)^2")
    cdim = _dim(sd, "cnet.conv2", 0, src)
    motion_dim = _dim(sd, "update_block.encoder.conv", 0, src) + 2
    config = {
        "encoder_layers": [
            _dim(sd, "fnet.conv1", 0, src),
            _dim(sd, "fnet.layer1.1.conv2", 0, src),
            _dim(sd, "fnet.layer2.1.conv2", 0, src),
            _dim(sd, "fnet.layer3.1.conv2", 0, src),
        ],
        "feature_dim": _dim(sd, "fnet.conv2", 0, src),
        "context_dim": cdim,
        "hidden_dim": _dim(sd, "update_block.flow_head.conv1", 1, src),
        "feature_norm": "batch" if "fnet.norm1.running_mean" in sd else "instance",
        "context_norm": "batch" if "cnet.norm1.running_mean" in sd else "instance",
        "corr_levels": 4,
        "corr_radius": radius,
        "motion_corr_layers": [
            _dim(sd, "update_block.encoder.convc1", 0, src),
            _dim(sd, "update_block.encoder.convc2", 0, src),
        ],
        "motion_flow_layers": [
            _dim(sd, "update_block.encoder.convf1", 0, src),
            _dim(sd, "update_block.encoder.convf2", 0, src),
        ],
        "motion_dim": motion_dim,
        "flow_head_dim": _dim(sd, "update_block.flow_head.conv1", 0, src),
        "mask_dim": _dim(
            sd, "mask.0" if any(k.startswith("mask.") for k in sd) else "update_block.mask.0", 0, src
        ),
        "gma": any(k.startswith("attn.") for k in sd),
        "weight_norm": weight_norm,
    }
    return state, config


def release_version(sd: dict[str, torch.Tensor]) -> str:
    """"v1.0" (mask head inside the update block, ``update_block.mask.*``) or "v2.0" (``mask.*``)."""
    keys = [k[len("module."):] if k.startswith("module.") else k for k in sd]
    return "v1.0" if any(k.startswith("update_block.mask.") for k in keys) else "v2.0"


def eval_settings(version: str, hidden_dim: int) -> dict[str, Any]:
    """The original's evaluation solver settings (a DEQConfig dict) for a release and model width.

    Example:
        >>> eval_settings("v1.0", 256)["f_solver"], eval_settings("v1.0", 128)["f_solver"]
        ('broyden', 'anderson')
    """
    if version == "v2.0":
        return dict(EVAL_DEQ)
    if version != "v1.0":
        raise ValueError(f"unknown DEQ-Flow release {version!r} (v1.0 or v2.0)")
    settings = dict(EVAL_DEQ_V1_H if hidden_dim >= 256 else EVAL_DEQ_V1_B)
    return {**settings, "f_solver_kwargs": v1_solver_options(settings["f_solver"], "abs", hidden_dim)}


def convert(
    src: str | Path,
    out: str | Path,
    *,
    fold_weight_norm: bool = False,
    all_grad: bool = False,
    deq: dict[str, Any] | None = None,
    card: bool = True,
    base_deq: dict[str, Any] | None = None,
    source_name: str = "locuslab/deq-flow",
    **options: Any,
) -> Path:
    """Convert an original DEQ-Flow state dict into a deqzoo checkpoint directory `out`.

    ``all_grad=True`` marks checkpoints trained with the original's ``--all_grad`` (no detach of the flow
    input to f); it changes training only, never inference. The solver settings written are the release's
    evaluation settings (`eval_settings`, see the module docstring); `deq` overrides entries of them.

    Example:
        >>> convert("deq-flow-B-things.pth", "/tmp/deq-flow-b")  # doctest: +SKIP
    """
    from deqzoo.core.config import merge_settings
    from deqzoo.models.deq_flow import DEQFlowConfig, DEQFlowForOpticalFlow

    src = Path(src)
    for name, value in (("fold_weight_norm", fold_weight_norm), ("all_grad", all_grad)):
        if not isinstance(value, bool):
            raise ValueError(f"option {name} must be true or false, got {value!r}")
    sd = load_state_dict(src)
    state, fields = convert_state_dict(sd, src, fold=fold_weight_norm)
    version = release_version(sd)
    base = base_deq if base_deq is not None else eval_settings(version, fields["hidden_dim"])
    settings = merge_settings(base, deq or {})  # a user's other solver drops the release's solver options
    if base_deq is None and version == "v1.0" and "f_solver_kwargs" not in (deq or {}):
        settings["f_solver_kwargs"] = v1_solver_options(settings["f_solver"], settings["f_stop_mode"],
                                                        fields["hidden_dim"])
    origin = "torchdeq" if base_deq is not None else ("deq-flow-v2.0" if version == "v2.0" else "locuslab")
    settings = original_returned_point(origin, settings, deq)
    config = DEQFlowConfig(**with_options(src, {**fields, "detach_flow_input": not all_grad, "deq": settings,
                                                "architectures": [DEQFlowForOpticalFlow.__name__]}, options))
    model = DEQFlowForOpticalFlow(config)
    fill_model(model, state, src)
    out = Path(out)
    model.save_pretrained(out)
    if card:
        release = source_name if base_deq is not None else f"{source_name} {version}"
        _write_card(out, src.name, fields, release, config.deq)
    return out


def _settings_text(deq: dict[str, Any]) -> str:
    extra = "".join(f", {k} {v}" for k, v in sorted(deq.get("f_solver_kwargs", {}).items()))
    step = deq.get("f_final_step", False)
    if isinstance(step, bool):
        returned = "f of the accepted iterate where better" if step else "the accepted iterate itself"
    else:
        returned = "f of the accepted iterate" if step == 1 else f"f^{step} of the accepted iterate"
    return (f"solver `{deq['f_solver']}`{extra}, at most {deq['f_max_iter']} steps, stop when the "
            f"{'absolute' if deq['f_stop_mode'] == 'abs' else 'relative'} residual of (h, flow) is below "
            f"{deq['f_tol']:g}; returns {returned}")  # issue 58: what the original returns


def _write_card(path: Path, source: str, fields: dict[str, Any], release: str, deq: dict[str, Any]) -> None:
    from utils.cards import render_model_card

    meta = {
        "license": "mit",
        "library_name": "deqzoo",
        "tags": ["deqzoo", "deep-equilibrium", "optical-flow", "deq-flow", "converted"],
    }
    size = {32: "tiny", 128: "B", 192: "large", 256: "H", 384: "gigantic"}.get(fields["hidden_dim"], "custom")
    body = (
        f"# DEQ-Flow ({size}{', GMA' if fields['gma'] else ''}) converted from {release}\n\n"
        f"Converted with `deqzoo convert` from `{source}` (an original-format state dict). No evaluation was "
        "run by the converter.\n\n"
        f"Solver settings (the original's evaluation settings for {release}): {_settings_text(deq)}. The "
        "absolute residual of (h, flow) equals the original's on (h, coords1), coords0 being fixed.\n"
    )
    (path / "README.md").write_text(render_model_card(meta, body), encoding="utf-8")


FORMATS = {"deq-flow-locuslab": convert}
