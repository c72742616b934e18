"""Convert TorchDEQ deq-zoo DEQ-Flow checkpoints (locuslab/torchdeq ``deq-zoo/deq-flow``) to deqzoo DEQ-Flow.

deq-zoo's ``DEQFlow`` (``core/deq_flow.py``) has the module layout of locuslab/deq-flow v2.0 (``fnet``,
``cnet``, ``update_block``, ``mask``, ``attn``); its update block is normalised by
``torchdeq.norm.apply_norm`` (weight norm by default: ``weight_g``/``weight_v``, the names deqzoo's engine
uses too). The key mapping, shape-derived config and the ``fold_weight_norm`` option are those of
`deq_flow_locuslab`; checkpoints nested under ``model``/``state_dict`` and ``module.`` prefixes are handled.
Spectral-normalised checkpoints (``--norm_type spectral_norm``: ``weight_orig``/``weight_u``) are refused with
a clear error.

Solver settings follow deq-zoo's ``val.sh`` (``--f_solver fixed_point_iter --f_max_iter 40 --eval_factor
1.5``, with TorchDEQ's defaults ``f_stop_mode="abs"``, ``f_tol=1e-3``): plain fixed-point iteration, 60
steps, stop when the absolute residual is below 1e-3 (`EVAL_DEQ`). The original tests the residual of
(h, coords1) per sample; deqzoo's state is (h, flow), whose residual is the same numbers (coords0 is fixed).

    deqzoo convert deq-flow-torchdeq deq-flow-B-things.pth out_dir
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._common import load_state_dict
from .deq_flow_locuslab import convert as _convert

__all__ = ["EVAL_DEQ", "FORMATS", "convert"]

# deq-zoo/deq-flow/val.sh: fixed_point_iter, f_max_iter 40 x eval_factor 1.5; TorchDEQ: abs stop at 1e-3
EVAL_DEQ = {"f_solver": "fixed_point", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}


def convert(
    src: str | Path,
    out: str | Path,
    *,
    fold_weight_norm: bool = False,
    all_grad: bool = False,
    deq: dict[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Convert a deq-zoo DEQ-Flow state dict into a deqzoo checkpoint directory `out`.

    Example:
        >>> convert("deq-flow-B-chairs.pth", "/tmp/deq-flow-b")  # doctest: +SKIP
    """
    sd = load_state_dict(src)
    spectral = sorted(k for k in sd if k.endswith(("weight_orig", "weight_u")))
    if spectral:
        raise ValueError(
            f"{src}: spectral-normalised update block ({spectral[:3]}...) is not supported; "
            "convert a weight-norm (default) or unnormalised deq-zoo checkpoint"
        )
    return _convert(
        src,
        out,
        fold_weight_norm=fold_weight_norm,
        all_grad=all_grad,
        deq=deq,
        base_deq=EVAL_DEQ,
        source_name="locuslab/torchdeq deq-zoo",
        **options,
    )


FORMATS = {"deq-flow-torchdeq": convert}
