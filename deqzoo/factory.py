"""The zoo's front door: list_models, create_model and from_pretrained over every registered family."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .hub.cards import card_metrics, read_model_card
from .hub.catalog import load_catalog
from .hub.loading import CheckpointError, resolve
from .integrations.transformers import family_for, register_all, registered_families


@dataclass
class ModelInfo:
    """One row of :func:`list_models`: an architecture preset or a pretrained checkpoint."""

    name: str
    kind: str  # "architecture" | "checkpoint"
    model_type: str | None
    task: str | None
    parameters: int | None
    description: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def _architectures(family) -> dict[str, dict[str, Any]]:
    return family.load(family.architectures)


def _model_class(family, auto_name: str | None = None, architectures: list[str] | None = None):
    classes = {auto: family.load(path) for auto, path in family.models.items()}
    by_name = {cls.__name__: cls for cls in classes.values()}
    by_name.update({name: family.load(path) for name, path in family.heads.items()})
    for arch in architectures or []:
        if arch in by_name:
            return by_name[arch]
    if auto_name:
        if auto_name not in classes:
            raise ValueError(f"family {family.model_type!r} has no model for {auto_name}; "
                             f"available: {sorted(classes)}")
        return classes[auto_name]
    return classes["AutoModel"]


def _find_preset(name: str):
    for family in registered_families().values():
        presets = _architectures(family)
        if name in presets:
            return family, presets[name]
    return None, None


def create_model(name: str, *, deq: dict[str, Any] | None = None, **overrides: Any):
    """Build an untrained model from an architecture preset; `overrides` change config fields.

    Example:
        >>> import deqzoo
        >>> model = deqzoo.create_model("mdeq-tiny", num_labels=10)  # doctest: +SKIP
    """
    register_all()
    family, preset = _find_preset(name)
    if preset is None:
        known = sorted(p for f in registered_families().values() for p in _architectures(f))
        raise ValueError(f"Unknown architecture {name!r}; known architectures: {known}")
    config_cls = family.load(family.config)
    kwargs = {**preset.get("config", {}), **overrides}
    if deq:
        kwargs["deq"] = {**kwargs.get("deq", {}), **deq}
    config = config_cls(**kwargs)
    return _model_class(family, preset.get("auto"), getattr(config, "architectures", None))(config)


def from_pretrained(name_or_path: str | os.PathLike, *, deq: dict[str, Any] | None = None, **kwargs: Any):
    """Load any deqzoo checkpoint: a directory, an embedded id (offline), or a Hub repo id.

    The model class comes from config.json (`model_type` -> family, `architectures` -> head).

    Example:
        >>> import deqzoo
        >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", deq={"f_max_iter": 12})  # doctest: +SKIP
    """
    hub = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token", "local_files_only", "force_download")
           if k in kwargs}
    directory = resolve(name_or_path, **hub)
    config_path = directory / "config.json"
    if not config_path.is_file() and (directory / "model_index.json").is_file():
        from .integrations.diffusers import DEQDDIMPipeline  # a diffusers repository: the DEQ-DDIM pipeline

        return DEQDDIMPipeline.from_pretrained(str(directory), **kwargs)
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: malformed JSON ({err})") from err
    model_type = raw.get("model_type")
    try:
        family = family_for(model_type)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from err
    cls = _model_class(family, architectures=raw.get("architectures"))
    model = cls.from_pretrained(directory, deq=deq, **kwargs)
    model.name_or_path = str(name_or_path)
    return model


def _meta_parameter_count(family, config_kwargs: dict[str, Any], auto_name: str | None = None) -> int:
    """Trainable parameters (buffers excluded) of a model built on the meta device: nothing is allocated."""
    import torch

    with torch.device("meta"):
        config = family.load(family.config)(**config_kwargs)
        model = _model_class(family, auto_name, getattr(config, "architectures", None))(config)
    return sum(p.numel() for p in model.parameters())


def parameter_count(config: dict[str, Any]) -> int:
    """Trainable parameters of the model a config.json (as a dict) describes.

    Example:
        >>> import json, deqzoo
        >>> from deqzoo.hub import resolve
        >>> cfg = json.loads((resolve("deqzoo/mdeq-tiny-mnist") / "config.json").read_text())
        >>> deqzoo.factory.parameter_count(cfg) > 0
        True
    """
    register_all()
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    return _meta_parameter_count(family_for(config.get("model_type")), kwargs)


def _count_parameters(family, preset) -> int | None:
    try:
        return _meta_parameter_count(family, preset.get("config", {}), preset.get("auto"))
    except Exception:  # noqa: BLE001 - a listing must not fail because one preset cannot be built
        return None


def list_models(kind: str | None = None) -> list[ModelInfo]:
    """Every registered architecture preset and every embedded checkpoint, with task and parameter count.

    Example:
        >>> import deqzoo
        >>> all(m.kind in ("architecture", "checkpoint") for m in deqzoo.list_models())
        True
    """
    register_all()
    rows: list[ModelInfo] = []
    if kind in (None, "architecture"):
        for family in registered_families().values():
            for name, preset in _architectures(family).items():
                rows.append(ModelInfo(name=name, kind="architecture", model_type=family.model_type,
                                      task=preset.get("task"), parameters=_count_parameters(family, preset),
                                      description=preset.get("description", "")))
    if kind in (None, "checkpoint"):
        for cid, entry in sorted(load_catalog().items()):
            rows.append(ModelInfo(name=cid, kind="checkpoint", model_type=entry.get("model_type"),
                                  task=entry.get("task"), parameters=entry.get("parameters"),
                                  metrics=dict(entry.get("metrics") or {})))
    return rows


def checkpoint_card(name_or_path: str | os.PathLike) -> tuple[Path, dict[str, Any], dict[str, float]]:
    """(directory, card metadata, card metrics) of a checkpoint."""
    directory = resolve(name_or_path)
    meta: dict[str, Any] = {}
    if (directory / "README.md").is_file():
        meta, _ = read_model_card(directory)
    return directory, meta, card_metrics(meta)
