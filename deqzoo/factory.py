"""The zoo's front door: list_models, create_model and from_pretrained over every registered family."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core.config import merge_settings
from .hub.cards import card_metrics, read_model_card
from .hub.catalog import load_catalog
from .hub.loading import RESOLVE_KEYWORDS, CheckpointError, resolve
from .hub.validation import check_budget, confined, read_json
from .models.registry import (
    PIPELINES,
    available_families,
    declared_families,
    family_for,
    model_names_table,
    require,
    timm_names,
)


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


# A preset's transformers Auto class follows its task (AutoModel for other tasks, or the preset's "auto")
_AUTO_CLASSES = {"image-classification": "AutoModelForImageClassification",
                 "image-segmentation": "AutoModelForSemanticSegmentation",
                 "text-generation": "AutoModelForCausalLM"}


def _architectures(family) -> dict[str, dict[str, Any]]:
    return {name: {"auto": _AUTO_CLASSES.get(preset.get("task"), "AutoModel"), **preset}
            for name, preset in family.load(family.architectures).items()}


def _model_class(family, auto_name: str | None = None, architectures: list[str] | None = None):
    classes = {auto: family.load(path) for auto, path in family.models.items()}
    by_name = {cls.__name__: cls for cls in classes.values()}
    for arch in architectures or []:
        if arch in family.heads:  # imported only when named (timm's class imports timm)
            return family.load(family.heads[arch])
        if arch in by_name:
            return by_name[arch]
    if auto_name:
        if auto_name not in classes:
            raise ValueError(f"family {family.model_type!r} has no model for {auto_name}; "
                             f"available: {sorted(classes)}")
        return classes[auto_name]
    return classes["AutoModel"]


def canonical_name(name: str) -> str:
    """A published model's one name (its hub id's short name) from its hub id or timm spelling; other names
    pass through unchanged.

    Example:
        >>> canonical_name("deqzoo/mdeq-tiny-mnist"), canonical_name("lipschitz_mdeq_tiny_mnist")
        ('mdeq-tiny-mnist', 'lipschitz-mdeq-tiny-mnist')
    """
    short = (name[len("deqzoo/"):] if name.startswith("deqzoo/") else name).replace("_", "-")
    return short if short in model_names_table() else name


def _published_id(name: str) -> str | None:
    """ "deqzoo/<name>" when `name` (bare, hub id or timm spelling) is an embedded checkpoint (no import)."""
    short = (name[len("deqzoo/"):] if name.startswith("deqzoo/") else name).replace("_", "-")
    return f"deqzoo/{short}" if "/" not in short and f"deqzoo/{short}" in load_catalog() else None


def model_names() -> list[dict[str, Any]]:
    """The name table: each published model's name, hub id, architecture preset and timm name (MDEQ).

    Example:
        >>> row = next(r for r in model_names() if r["name"] == "mdeq-tiny-mnist")
        >>> row["hub_id"], row["preset"], row["timm"]
        ('deqzoo/mdeq-tiny-mnist', 'mdeq-tiny-mnist', 'mdeq_tiny_mnist')
    """
    in_timm = {name for family in declared_families().values() for name in timm_names(family)}
    return [{"name": name, "hub_id": f"deqzoo/{name}", "preset": preset,
             "timm": name.replace("-", "_") if name.replace("-", "_") in in_timm else None}
            for name, preset in model_names_table().items()]


def _known_names() -> list[str]:
    names = [p for f in available_families().values() for p in _architectures(f)]
    names += list(model_names_table())
    names += [cid.split("/", 1)[1] for cid in load_catalog() if "/" in cid]
    return sorted(set(names))


def did_you_mean(name: str, candidates: list[str] | None = None) -> str:
    """' Did you mean ...?' for the closest known model names (empty when nothing is close).

    Example:
        >>> did_you_mean("mdeq-tiny-mnst")
        " Did you mean 'mdeq-tiny-mnist'?"
    """
    base = name.split("/", 1)[1] if name.startswith("deqzoo/") else name
    close = difflib.get_close_matches(base, candidates or _known_names(), n=3, cutoff=0.75)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def _find_preset(name: str):
    """(family, preset) of a preset or model name (the declaring family first: only it is imported)."""
    canonical = canonical_name(name)
    for family in declared_families().values():
        if canonical in family.names:  # a published model: its preset has its name
            family = family_for(family.model_type)
            return family, _architectures(family).get(canonical)
    for family in available_families().values():
        presets = _architectures(family)
        if name in presets:
            return family, presets[name]
    return None, None


def create_model(name: str, *, deq: dict[str, Any] | None = None, max_parameters: int | None = None,
                 **overrides: Any):
    """An untrained model of an architecture preset or a model's name (`model_names()`); `overrides` change
    config fields (an unknown key is a ConfigError). The size is checked against the parameter budget
    (`max_parameters`, $DEQZOO_MAX_PARAMETERS, 1e9) on the meta device before anything is allocated.

    Example:
        >>> import deqzoo
        >>> model = deqzoo.create_model("mdeq-tiny-mnist", num_labels=10)   # = preset "mdeq-tiny-mnist"
        >>> deqzoo.create_model("mdeq-tiny-mnst")
        Traceback (most recent call last):
        ...
        ValueError: Unknown architecture 'mdeq-tiny-mnst'. Did you mean 'mdeq-tiny-mnist'? ...
        >>> deqzoo.create_model("mdeq-tiny-mnist", num_lables=10)
        Traceback (most recent call last):
        ...
        deqzoo.configuration_utils.ConfigError: MDEQConfig: unknown key 'num_lables'. Did you mean ...
    """
    family, preset = _find_preset(name)
    if preset is None:
        known = sorted(p for f in available_families().values() for p in _architectures(f))
        raise ValueError(f"Unknown architecture {name!r}.{did_you_mean(name)} Known architectures: {known}; "
                         f"model names: {sorted(model_names_table())}")
    config_cls = family.load(family.config)
    _check_override_keys(config_cls, overrides)
    kwargs = {**preset.get("config", {}), **overrides}
    if deq:
        kwargs["deq"] = merge_settings(kwargs.get("deq", {}), deq)  # a new b_mode: not the preset's options
    config = config_cls(**kwargs)  # values checked (types, ranges) before __init__ runs
    model_cls, meta = _on_meta(family, config, preset.get("auto"))  # size first
    check_budget([*meta.parameters(), *meta.buffers()], f"create_model({name!r})", max_parameters)
    return model_cls(config)


def _check_override_keys(config_cls: type, overrides: dict[str, Any]) -> None:
    """An override must name a field, an ``__init__`` argument or a settable property (``num_labels``):
    PretrainedConfig would keep a typo (``hiden_dim=96``) as an attribute no model reads."""
    from .configuration_utils import ConfigError  # the config class was just imported: transformers is loaded

    known = {f.name for f in dataclasses.fields(config_cls)}  # transformers v5 configs are dataclasses
    known |= {name for name, param in inspect.signature(config_cls.__init__).parameters.items()
              if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)}
    known |= {name for name in dir(config_cls)
              if isinstance(prop := getattr(config_cls, name, None), property) and prop.fset is not None}
    unknown = [k for k in overrides if k not in known]
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{config_cls.__name__}: unknown key {key!r}.{did_you_mean(key, sorted(known))} "
                          f"Keys: {sorted(known)}")


def from_pretrained(name_or_path: str | os.PathLike, *, deq: dict[str, Any] | None = None,
                    hypersolver: str | os.PathLike | None = None, **kwargs: Any):
    """Load any deqzoo checkpoint (a directory, an embedded id, offline, or a Hub repo id) into the class its
    config.json names (`model_type` -> family, `architectures` -> head); every transformers keyword is passed
    on. `hypersolver` (an id or a directory) attaches a HyperDEQ solver trained for it (`set_hypersolver`).

    Example:
        >>> import deqzoo
        >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", deq={"f_max_iter": 12})  # doctest: +SKIP
    """
    # `resolve`'s keywords (transformers reads them too: kept in kwargs)
    hub = {k: kwargs[k] for k in (*RESOLVE_KEYWORDS, "endpoint") if k in kwargs}
    name = str(name_or_path)
    if not Path(name).exists() and (published := _published_id(name)):
        name_or_path = published  # the bare name (or timm spelling) of an embedded checkpoint
    try:
        directory = resolve(name_or_path, **hub)
    except Exception as err:
        untrained = not Path(name).exists() and _find_preset(name)[1] is not None  # a preset, no weights
        hint = (f" {name!r} is an architecture preset without published weights: "
                f"deqzoo.create_model({name!r}) builds it untrained" if untrained
                else "" if Path(name).exists() else did_you_mean(name))
        if not hint:
            raise
        raise type(err)(f"{err}{hint}") from err
    subfolder = kwargs.get("subfolder") or ""
    folder = confined(directory, subfolder, f"subfolder={subfolder!r}") if subfolder else directory
    if not (folder / "config.json").exists() and (folder / "model_index.json").is_file():
        return _load_pipeline(folder, **kwargs)  # a diffusers repository: the DEQ-DDIM pipeline
    config_path = confined(folder, "config.json", folder)
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    raw = read_json(config_path)  # the one read: passed on as config= (the class's loader takes its dict)
    try:
        family = family_for(raw.get("model_type"))
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from err
    architectures = raw.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise CheckpointError(f"{config_path}: key 'architectures' must be a list of class names, "
                              f"got {architectures!r}")
    cls = _model_class(family, architectures=architectures)
    result = cls.from_pretrained(directory, config=raw, deq=deq, **kwargs)
    model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True: (model, info)
    model.name_or_path = model.config.name_or_path = str(name_or_path)
    if hypersolver is not None:
        model.set_hypersolver(hypersolver)
    return result


def _load_pipeline(directory: Path, **kwargs: Any):
    pipeline = PIPELINES[0]  # the one pipeline kind deqzoo loads today (DEQ-DDIM)
    require(pipeline.extra, pipeline.requires, f"{directory} (a {pipeline.name} diffusers repository)")
    module, _, attr = pipeline.loader.partition(":")
    return getattr(importlib.import_module(module), attr)(directory, **kwargs)


def _on_meta(family, config, auto_name: str | None = None):
    """(model class, the model built on the meta device): nothing is allocated."""
    import torch

    model_cls = _model_class(family, auto_name, getattr(config, "architectures", None))
    with torch.device("meta"):
        return model_cls, model_cls(config)


def parameter_count(config: dict[str, Any], auto_name: str | None = None) -> int:
    """Trainable parameters (buffers excluded) of the model a config.json's dict describes (meta device).

    Example:
        >>> import json, deqzoo
        >>> from deqzoo.hub import resolve
        >>> cfg = json.loads((resolve("deqzoo/mdeq-tiny-mnist") / "config.json").read_text())
        >>> deqzoo.factory.parameter_count(cfg) > 0
        True
    """
    family = family_for(config.get("model_type"))
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    _, model = _on_meta(family, family.load(family.config)(**kwargs), auto_name)
    return sum(p.numel() for p in model.parameters())


def _count_parameters(family, preset) -> int | None:
    try:
        config = {**preset.get("config", {}), "model_type": family.model_type}
        return parameter_count(config, preset.get("auto"))
    except Exception:  # noqa: BLE001 - a listing must not fail because one preset cannot be built
        return None


def list_models(kind: str | None = None) -> list[ModelInfo]:
    """Every registered architecture preset and every embedded checkpoint, with task and parameter count.

    Example:
        >>> import deqzoo
        >>> all(m.kind in ("architecture", "checkpoint") for m in deqzoo.list_models())
        True
    """
    rows: list[ModelInfo] = []
    if kind in (None, "architecture"):
        for family in available_families().values():
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
