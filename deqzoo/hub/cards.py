"""Model cards: a Hub README.md with YAML metadata (front matter) and a body saying how to use and reproduce.

Read with :func:`read_model_card` (size-limited, no YAML aliases); cards are written by the repository's
`utils.cards` (and the clone's converters).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .validation import confined, load_yaml

CARD_NAME = "README.md"
MAX_CARD_BYTES = 16 * 1024 * 1024
_FRONT = "---"

def read_model_card(directory: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """Parse `directory/README.md` (or a README path) into (metadata dict, body markdown).

    A card without front matter gives ``({}, text)``.
    """
    path = Path(directory)
    if path.is_dir():
        path = confined(path, CARD_NAME, path)
    size = path.stat().st_size
    if size > MAX_CARD_BYTES:
        raise ValueError(f"{path}: {size:,} bytes, above the limit of {MAX_CARD_BYTES:,} for a model card")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: a model card must be UTF-8 text ({err})") from err
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != _FRONT:
        return {}, text
    for end in range(1, len(lines)):
        if lines[end].strip() == _FRONT:
            meta = load_yaml("".join(lines[1:end]), path) or {}
            if not isinstance(meta, dict):
                raise ValueError(f"{path}: YAML front matter must be a mapping, got {type(meta).__name__}")
            return meta, "".join(lines[end + 1:]).lstrip("\n")
    raise ValueError(f"{path}: front matter opened with '---' but never closed")


def _items(value: Any, key: str) -> list[dict]:
    """The dicts in list `value[key]`: card metadata comes from anyone, so malformed parts are skipped."""
    found = value.get(key) if isinstance(value, dict) else None
    return [x for x in found if isinstance(x, dict)] if isinstance(found, list) else []


def card_metrics(metadata: dict[str, Any]) -> dict[str, float]:
    """Flatten model-index results into {metric type: value}. Where several metrics share a type (two EPEs
    on two data sets) the first, in the card's order, stands for it: the headline, as in `card_headline`,
    not whichever came last."""
    metrics: dict[str, float] = {}
    for entry in _items(metadata, "model-index"):
        for result in _items(entry, "results"):
            for metric in _items(result, "metrics"):
                metrics.setdefault(str(metric.get("type") or metric.get("name")), metric.get("value"))
    return metrics
