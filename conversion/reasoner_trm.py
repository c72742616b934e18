"""Convert TRM checkpoints (SamsungSAILMontreal/TinyRecursiveModels, ``models/recursive_reasoning/trm.py``)
to deqzoo's reasoner family.

TRM's ``pretrain.py`` writes the same layout as HRM's (``all_config.yaml`` beside ``step_<N>`` state dicts of
the ACT loss head, ``_orig_mod.``-prefixed when compiled; EMA runs save the EMA copy under the same keys), so
the reading, checks and mapping are :mod:`conversion.reasoner_hrm`'s. What differs:

- one network (``L_level``) for both updates (``H_layers`` is ignored, as the original ignores it);
- ``puzzle_emb_len`` (default 16) sets the prefix length when non-zero, else ceil(puzzle_emb_ndim /
  hidden_size); the puzzle embedding row is zero-padded to it, as the original does;
- ``mlp_t: true`` (the MLP across positions instead of attention) maps to ``mixer="mlp"`` with
  ``token_mlp_norm="positions"``: TRM normalises that sub-block across the positions;
- ``pos_encodings`` other than rope / learned means none, as in the original;
- gradient: the last cycle of each segment (``grad_mode="last_cycle"``). ``no_ACT_continue: true`` (the
  default) is deqzoo's "act" halting rule (halt logit > 0, selectable with ``--option halting=act``); the
  converted config halts by budget, the original's evaluation.

    deqzoo convert trm-samsung checkpoints/Sudoku-extreme-mlp out_dir
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .reasoner_hrm import convert_release

TRM_ARCH_NAMES = ("recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",)


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert a TRM checkpoint (``all_config.yaml`` + state dict) into a deqzoo reasoner checkpoint folder;
    returns `out`. Options as :func:`conversion.reasoner_hrm.convert`.

    Example:
        >>> convert("checkpoints/trm-sudoku/step_65100", "trm-sudoku")  # doctest: +SKIP
    """
    return convert_release(src, out, architecture="trm", arch_names=TRM_ARCH_NAMES, fmt="trm-samsung",
                           source="SamsungSAILMontreal/TinyRecursiveModels", options=options)


FORMATS = {"trm-samsung": convert}
