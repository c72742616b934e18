"""Repository tooling: write a published checkpoint's model card (`model_cards/<name>/README.md`).

The family card writers in `examples/<family>/` call :func:`write_model_card` when they publish a checkpoint:
the library's metadata and front matter (`deqzoo.hub.cards`) plus the usage, training and evaluation sections
of a zoo card.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deqzoo.hub.cards import CARD_NAME, build_metadata, render_model_card
from deqzoo.hub.saving import write_whole

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
                          base_model=base_model, license=license)
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
