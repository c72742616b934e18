"""Repository tooling: write a published checkpoint's model card (`model_cards/<name>/README.md`).

The family card writers in `examples/<family>/` call :func:`write_model_card` when they publish a checkpoint:
the card's metadata and front matter (:func:`build_metadata`, :func:`render_model_card`) plus the usage,
training and evaluation sections of a zoo card.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from deqzoo.hub.cards import CARD_NAME, _items
from deqzoo.hub.saving import atomic_save, write_whole

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
    demo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The card's YAML metadata as a dict (Hub keys plus `deqzoo_task`, and `deqzoo_demo`: what `deqzoo demo`
    shows for it, which tests/test_cards_agree.py holds the demo to)."""
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
    if demo:
        meta["deqzoo_demo"] = dict(demo)
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
    return f"---\n{front}---\n\n{body.strip()}\n"





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


# tasks with a transformers pipeline that the zoo's heads serve (card snippets use it); others use AutoModel
TRANSFORMERS_PIPELINES = frozenset({"image-classification", "image-segmentation", "text-generation"})


def write_model_card(
    directory: str | os.PathLike,
    *,
    model_id: str,
    title: str,
    pipeline_tag: str,
    task_module: str,
    datasets: list[str],
    dataset_name: str,
    metrics: list[dict[str, Any]],
    tags: list[str],
    train_command: str,
    eval_command: str,
    body_markdown: str,
    base_model: str | None = None,
    license: str = "apache-2.0",
    demo: dict[str, Any] | None = None,
) -> Path:
    """Write `directory/README.md`: YAML metadata plus a body with usage, training and evaluation commands.

    `metrics` values must be exactly what ``deqzoo eval <model_id>`` prints (rounded to 4 decimals).
    `body_markdown` describes data, recipe and seed; the usage and reproduce sections are added here.

    Example:
        >>> import tempfile
        >>> from deqzoo.hub.cards import read_model_card
        >>> from utils.cards import write_model_card
        >>> d = tempfile.mkdtemp()
        >>> _ = write_model_card(d, model_id="deqzoo/mdeq-tiny-mnist", title="MDEQ tiny (MNIST)",
        ...     pipeline_tag="image-classification", task_module="mnist", datasets=["mnist"],
        ...     dataset_name="MNIST", metrics=[{"type": "accuracy", "name": "Test accuracy", "value": 0.98}],
        ...     tags=["mdeq"], train_command="python examples/mdeq/train_mnist.py",
        ...     eval_command="deqzoo eval deqzoo/mdeq-tiny-mnist", body_markdown="Trained on MNIST.")
        >>> meta, body = read_model_card(d)
        >>> meta["library_name"], meta["model-index"][0]["results"][0]["metrics"][0]["value"]
        ('deqzoo', 0.98)
    """
    meta = build_metadata(model_id=model_id, pipeline_tag=pipeline_tag, task_module=task_module,
                          datasets=datasets, dataset_name=dataset_name, metrics=metrics, tags=tags,
                          base_model=base_model, license=license, demo=demo)
    metric_rows = "\n".join(f"| {m['name']} | `{m['type']}` | {m['value']} |" for m in metrics)
    if pipeline_tag in TRANSFORMERS_PIPELINES:
        stock_line = f'pipe = transformers.pipeline("{pipeline_tag}", model=str(resolve("{model_id}")))'
    else:  # transformers has no pipeline for this task: the family's base model through AutoModel
        stock_line = f'model = transformers.AutoModel.from_pretrained(str(resolve("{model_id}")))'
    body = f"""# {title}

{body_markdown.strip()}

## Results

Evaluated on {dataset_name} with `{eval_command}`:

| Metric | Type | Value |
|---|---|---|
{metric_rows}

## How to use

```python
import deqzoo

model = deqzoo.from_pretrained("{model_id}")   # embedded checkpoint: works offline
model.set_deq(f_max_iter=12)                    # solver settings are a test-time knob
```

With stock transformers after `deqzoo.register()` (which registers the families with the Auto classes):

```python
import deqzoo, transformers

deqzoo.register()
from deqzoo.hub import resolve

{stock_line}
```

From the command line:

```bash
deqzoo info {model_id}
deqzoo demo
```

## Training

```bash
{train_command}
```

## Evaluation

```bash
{eval_command}
```

Task module used by `deqzoo eval|demo|predict`: `{task_module}`.
"""
    path = Path(directory) / CARD_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, render_model_card(meta, body))  # README.md alone: the other files stay
    return path


def save(model, directory, processor=None) -> Path:
    """Publish step: a model (and its processor or tokenizer) saved atomically together into `directory`
    (moved here from `deqzoo.hub`: writing `model_cards/<name>/` is the repository's job)."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp / "m")  # itself atomic; moved up so model + processor land in one rename
        for item in (tmp / "m").iterdir():
            item.rename(tmp / item.name)
        (tmp / "m").rmdir()
        if processor is not None:
            processor.save_pretrained(str(tmp))

    return atomic_save(directory, write)
