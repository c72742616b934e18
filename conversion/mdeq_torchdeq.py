"""Convert TorchDEQ deq-zoo MDEQ checkpoints (``deq-zoo/mdeq``) to deqzoo checkpoint directories.

deq-zoo's MDEQ (``mdeq_cifar/mdeq/models/mdeq.py``, ``mdeq_imagenet/models/mdeq_core.py``) names f_θ
``full_stage`` and applies TorchDEQ's ``apply_norm`` to every weight of f_θ, the fusion convs included, where
deqzoo (like locuslab's MDEQ) normalizes only the blocks' and the post-fusion convs: those fusion convs arrive
as ``weight_g`` / ``weight_v`` and are folded into a plain ``weight = g v / ||v||`` (exact). Files accepted:
``final_state.pth.tar`` / ``model_best.pth.tar`` (a state dict), ``checkpoint.pth.tar`` (``{"state_dict": ...,
"optimizer": ...}``), and DDP checkpoints of the ImageNet script (``module.`` prefixes). Spectral-norm
checkpoints (``--norm_type spectral_norm``) are refused with a clear error.

The explicit key map is :data:`KEY_MAP` (original prefix -> deqzoo prefix); per-key rows come from
:func:`mdeq_locuslab.key_map` after renaming ``full_stage.`` to the locuslab ``fullstage.``.

Command line::

    deqzoo convert mdeq-torchdeq final_state.pth.tar out/mdeq-cifar-tiny --option arch=mdeq-cifar-tiny

Example:
    >>> out = convert("conversion/fixtures/mdeq/torchdeq_mdeq_tiny.pth.tar", "/tmp/x")   # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import mdeq_locuslab
from ._common import check_output, original_returned_point

FORMAT = "mdeq-torchdeq"


_L = mdeq_locuslab
ConversionError = _L.ConversionError

# TorchDEQ deq-zoo prefix -> deqzoo prefix (f_θ is `full_stage` there; everything else as locuslab's).
KEY_MAP: list[tuple[str, str]] = [
    (orig.replace("fullstage.", "full_stage."), ours) for orig, ours in _L.KEY_MAP
]


def canonical_torchdeq(sd: dict[str, torch.Tensor], path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Rename deq-zoo keys to locuslab's names; refuse norms other than weight norm."""
    out = {}
    for key, value in sd.items():
        if key.startswith("full_stage.") and key.endswith(("_orig", "_u")):
            raise ConversionError(
                f"{path}: {key!r} is a spectral-norm parameter (--norm_type spectral_norm); only "
                "weight-norm (--norm_type weight_norm, deq-zoo's default) checkpoints convert"
            )
        if key.startswith("fullstage.") or key.startswith(_L.DROPPED):
            raise ConversionError(
                f"{path}: {key!r} is a locuslab key; use format mdeq-locuslab for this file"
            )
        name = "fullstage." + key[len("full_stage.") :] if key.startswith("full_stage.") else key
        out[name] = value
    return out


def convert_state_dict(
    sd: dict[str, torch.Tensor],
    options: dict[str, Any] | None = None,
    path: str | os.PathLike = "<state dict>",
    device: str | None = None,
):
    """(deqzoo model, info) from a deq-zoo MDEQ state dict, in memory (for the tests and the benchmark)."""
    model, info = _L.convert_state_dict(canonical_torchdeq(sd, path), options, path, device=device)
    info["key_map_rows"] = KEY_MAP
    # TorchDEQ's fixed_point_iter and anderson return f of the accepted iterate (_common.RETURNED_POINT)
    given = (options or {}).get("deq")
    model.set_deq(f_final_step=original_returned_point("torchdeq", model.config.deq, given)["f_final_step"])
    return model, info


def convert(src: str | os.PathLike, out: str | os.PathLike, **options: Any) -> Path:
    """Convert a TorchDEQ deq-zoo MDEQ checkpoint into a deqzoo checkpoint directory.

    Options as for ``mdeq-locuslab``: ``arch`` (an ``mdeq-*`` preset), ``yaml`` (deq-zoo's ``configs/*.yaml``;
    its solver settings are command-line flags there, so pass ``deq={...}`` to set them), or config fields.

    Example:
        >>> convert("final_state.pth.tar", "out/tiny", arch="mdeq-cifar-tiny")   # doctest: +SKIP
        PosixPath('out/tiny')
    """
    check_output(src, out)
    src, out = Path(src), Path(out)
    model, info = convert_state_dict(_L.load_checkpoint(src), options, src)
    return _L.write_converted(model, info, src, out, FORMAT, "TorchDEQ deq-zoo MDEQ")


FORMATS = {FORMAT: convert}
