"""Model cards: a Hub README.md with YAML metadata (front matter) and a body saying how to use and reproduce.

:func:`render_model_card` writes one (`deqzoo convert` cards its converted checkpoints; the zoo's published
cards add usage and reproduction sections, `utils.cards.write_model_card`); the catalog and `deqzoo list`
read the metadata back with :func:`read_model_card` (size-limited, no YAML aliases).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .validation import confined, load_yaml

CARD_NAME = "README.md"
MAX_CARD_BYTES = 16 * 1024 * 1024
_FRONT = "---"

_TASK_NAMES = {"graph-ml": "Graph Machine Learning", "image-segmentation": "Image Segmentation",
               "text-generation": "Text Generation", "image-classification": "Image Classification"}


def _pretty(name: str) -> str:
    return _TASK_NAMES.get(name) or name.replace("-", " ").replace("_", " ").title()


def build_metadata(
    *,
    model_id: str,
    pipeline_tag: str,
    task_module: str,
    datasets: list[str],
    dataset_name: str,
    metrics: list[dict[str, Any]],
    tags: list[str],
    base_model: str | None = None,
    license: str = "apache-2.0",
) -> dict[str, Any]:
    """The card's YAML metadata as a dict (Hub keys plus `deqzoo_task`)."""
    for i, metric in enumerate(metrics):
        missing = {"type", "name", "value"} - set(metric)
        if missing:
            raise ValueError(f"metrics[{i}]={metric!r} lacks key(s) {sorted(missing)}; "
                             "each needs type, name, value")
    if not task_module or not all(part.isidentifier() for part in task_module.split(".")):
        raise ValueError(f"task_module must be a dotted module name (examples.<family>.<name>), "
                         f"got {task_module!r}")
    all_tags = ["deqzoo", "deep-equilibrium"] + [t for t in tags if t not in ("deqzoo", "deep-equilibrium")]
    # written by hand, not with huggingface_hub's ModelCardData: its to_dict() reorders the keys and drops
    # the task's display name, so the embedded cards would no longer regenerate byte for byte from their
    # writers (tests/examples pin that); the fields are the Hub's model-index schema either way
    meta: dict[str, Any] = {
        "license": license,
        "library_name": "deqzoo",
        "tags": all_tags,
        "datasets": list(datasets),
        "metrics": sorted({m["type"] for m in metrics}),
    }
    if base_model:
        meta["base_model"] = base_model
    meta["pipeline_tag"] = pipeline_tag
    meta["deqzoo_task"] = task_module
    meta["model-index"] = [{
        "name": model_id,
        "results": [{
            "task": {"type": pipeline_tag, "name": _pretty(pipeline_tag)},
            "dataset": {"type": datasets[0] if datasets else dataset_name, "name": dataset_name},
            "metrics": [{"type": m["type"], "name": m["name"], "value": m["value"]} for m in metrics],
        }],
    }]
    return meta


def render_model_card(metadata: dict[str, Any], body: str) -> str:
    """Front matter + body, as the Hub expects in README.md."""
    front = yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True)
    return f"{_FRONT}\n{front}{_FRONT}\n\n{body.strip()}\n"



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


def card_headline(metadata: dict[str, Any]) -> str | None:
    """The card's headline result: the first metric of its first model-index result, with its name and the
    data set it was measured on (several metrics may share a type, e.g. two EPEs on two data sets, so a
    {type: value} view alone can hide the one that matters).

    Example:
        >>> card_headline({"model-index": [{"results": [{"dataset": {"name": "MNIST test"},
        ...     "metrics": [{"type": "accuracy", "name": "Test accuracy", "value": 0.978}]}]}]})
        'Test accuracy 0.978 (MNIST test)'
    """
    for result in (r for entry in _items(metadata, "model-index") for r in _items(entry, "results")):
        metrics = _items(result, "metrics")
        if metrics and metrics[0] is result["metrics"][0]:
            first = metrics[0]
            dataset = result.get("dataset") if isinstance(result.get("dataset"), dict) else {}
            where = dataset.get("name") or dataset.get("type")
            text = f"{first.get('name') or first.get('type')} {first.get('value')}"
            return f"{text} ({where})" if where else text
    return None
