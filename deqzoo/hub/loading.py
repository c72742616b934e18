"""Resolution (local -> embedded -> HF cache -> Hub), safe weight loading and atomic saving.

Weights load only from safetensors; nothing here unpickles. Every mismatch between a config and its weights is
reported at once: missing, unexpected and mis-shaped keys (with both shapes) and the file they came from.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .catalog import NAMESPACE, PACKAGED_CARDS_DIR, embedded_folder, load_catalog, sha256_file
from .safetensors_io import CheckpointError, read_safetensors_header, weight_files
from .saving import recover
from .validation import check_budget, confined, is_network_error, read_json

logger = logging.getLogger("deqzoo")
# What we fetch from the Hub: configs, safetensors, cards, tokenizer/processor text files. Never pickles.
SAFE_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.txt", "*.model", "*.png"]
_VERIFIED: dict[tuple[str, int, int], str] = {}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read at call time (tests and users may set them late)."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def embedded_entry(name: str) -> dict[str, Any] | None:
    """The catalog entry for an id (``deqzoo/<short>`` or just ``<short>``), or None."""
    catalog = load_catalog()
    return catalog.get(name) or catalog.get(f"{NAMESPACE}/{name}")


def verify_embedded(entry: dict[str, Any], folder: Path) -> None:
    """Check every file's sha256 against the catalog; raise naming the first file that differs."""
    for rel, expected in entry["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the catalog for {entry['id']} but missing")
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        actual = _VERIFIED.get(key) or sha256_file(path)
        if actual != expected:
            raise CheckpointError(
                f"{path}: sha256 {actual} does not match the catalog ({expected}) for {entry['id']}; "
                "the embedded checkpoint was modified or corrupted "
                "(regenerate with `python -m utils.catalog` if intended)")
        _VERIFIED[key] = actual


def resolve(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    endpoint: str | None = None,
) -> Path:
    """Local directory of a checkpoint: an existing directory, an embedded checkpoint, the HF cache, the Hub.

    Embedded checkpoints are checked against the catalog's sha256 of every file. Hub downloads fetch only
    safetensors, JSON and text files (never pickles).

    Example:
        >>> from deqzoo.hub import resolve
        >>> resolve(".").is_dir()
        True
    """
    path = Path(name_or_path).expanduser()
    recover(path)  # a save of this folder was interrupted: finish or undo it first
    if path.is_dir():
        return path
    name = str(name_or_path)
    entry = embedded_entry(name)
    if entry is not None:
        folder = embedded_folder(entry)
        if folder is not None:
            verify_embedded(entry, folder)
            return folder
        name = entry["id"]  # folder not shipped with this install: fall through to cache / Hub
        missing_embedded = PACKAGED_CARDS_DIR / Path(entry["location"]).name
    else:
        missing_embedded = None
    if path.exists():
        raise CheckpointError(f"{path}: is a file; a checkpoint is a directory "
                              "(config.json + model.safetensors)")
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise CheckpointError(
            f"{name!r} is neither a directory nor an embedded checkpoint nor a Hub repo id (owner/name). "
            f"Embedded checkpoints: {sorted(load_catalog()) or 'none'}")
    try:
        return _from_hub(name, revision=revision, cache_dir=cache_dir, token=token,
                         local_files_only=local_files_only or is_offline(), force_download=force_download,
                         endpoint=endpoint)
    except CheckpointError as err:
        if missing_embedded is None:
            raise
        raise CheckpointError(f"{name} is in the catalog but its folder {missing_embedded} is not part of "
                              "this install (nor inside the package, where a wheel carries them); "
                              f"{err}") from err


def _from_hub(repo_id: str, *, local_files_only: bool, endpoint: str | None, **kwargs) -> Path:
    from huggingface_hub import snapshot_download

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    common = dict(repo_id=repo_id, allow_patterns=SAFE_PATTERNS, **kwargs)
    if not kwargs.get("force_download"):
        try:  # the HF cache first: no network when the snapshot is already there
            return Path(snapshot_download(local_files_only=True, **common))
        except Exception as err:  # noqa: BLE001 - any cache miss falls through to the Hub
            cache_error = err
    else:
        cache_error = None
    if local_files_only:
        why = "offline mode is on (HF_HUB_OFFLINE)" if is_offline() else "local_files_only=True"
        raise CheckpointError(
            f"{repo_id!r} is not embedded ({sorted(load_catalog()) or 'no embedded checkpoints'}) and not in "
            f"the Hugging Face cache, and {why} ({cache_error})")
    try:
        return Path(snapshot_download(endpoint=endpoint, **common))
    except Exception as err:
        if not (isinstance(err, ValueError) or is_network_error(err)):
            raise
        raise CheckpointError(f"{repo_id}: not a local folder nor an embedded checkpoint, and the Hub "
                              f"download failed ({type(err).__name__}: {err})") from err


def load_state_dict(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a checkpoint directory and the file each came from (safetensors only, checked)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in weight_files(directory):
        read_safetensors_header(path)
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors file ({err})") from err
        for key, value in part.items():
            tensors[key] = value
            origin[key] = path
    return tensors, origin


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise listing missing, unexpected, mis-shaped keys (both shapes) and dtypes that would need more than a
    floating-point cast; tied duplicates may be absent."""
    expected = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for key, value in expected.items():
        groups.setdefault(id(value), []).append(key)
    missing = [k for k in expected if k not in state and not any(o in state for o in groups[id(expected[k])])]
    unexpected = [k for k in state if k not in expected]
    misshaped = [(k, tuple(state[k].shape), tuple(expected[k].shape))
                 for k in state if k in expected and tuple(state[k].shape) != tuple(expected[k].shape)]
    mistyped = [(k, state[k].dtype, expected[k].dtype) for k in state if k in expected
                and state[k].dtype != expected[k].dtype
                and not (state[k].dtype.is_floating_point and expected[k].dtype.is_floating_point)]
    if not (missing or unexpected or misshaped or mistyped):
        return
    lines = [f"{source}: weights do not match the model built from its config ({type(model).__name__}):"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): " + ", ".join(unexpected))
    for key, got, want in misshaped:
        lines.append(f"  mis-shaped key {key}: checkpoint {list(got)} vs model {list(want)}")
    for key, got, want in mistyped:
        lines.append(f"  dtype of key {key}: checkpoint {got} vs model {want} (only floating-point weights "
                     "may be cast)")
    raise CheckpointError("\n".join(lines))


# Keyword arguments transformers' Auto classes and pipelines pass along that have no meaning for us.
_IGNORED = {"_from_auto", "_from_pipeline", "trust_remote_code", "code_revision", "low_cpu_mem_usage",
            "use_safetensors", "attn_implementation", "output_loading_info", "subfolder", "proxies",
            "adapter_kwargs", "_commit_hash", "user_agent", "local_files_only_fallback"}
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "endpoint")


def load_pretrained(
    model_cls: type,
    name_or_path: str | os.PathLike,
    *,
    config: Any = None,
    deq: dict[str, Any] | None = None,
    dtype: Any = None,
    device_map: Any = None,
    max_parameters: int | None = None,
    **kwargs: Any,
):
    """Build `model_cls` from its config and load verified safetensors weights (`deqzoo.from_pretrained`).

    Before anything is allocated, the model is built on the meta device: its size is checked against the
    parameter budget (`max_parameters`, $DEQZOO_MAX_PARAMETERS, 1e9) and its keys, shapes and dtypes against
    the safetensors headers."""
    if kwargs.pop("use_safetensors", None) is False:
        raise CheckpointError("deqzoo loads safetensors only; use_safetensors=False is not supported")
    dtype = dtype if dtype is not None else kwargs.pop("torch_dtype", None)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    for key in _IGNORED:
        kwargs.pop(key, None)
    directory = resolve(name_or_path, **hub)
    if config is None:
        config = load_config(model_cls.config_class, directory)
    if hasattr(config, "check_overrides"):  # a deqzoo config checks overrides like its __init__ does
        config.check_overrides(kwargs)
    for key, value in kwargs.items():  # transformers convention: extra kwargs override config attributes
        if not hasattr(config, key):
            raise TypeError(f"{model_cls.__name__}.from_pretrained got an unexpected keyword argument "
                            f"{key!r}")
        setattr(config, key, value)
    precheck(model_cls, config, directory, max_parameters=max_parameters)
    state, origin = load_state_dict(directory)
    model = model_cls(config)
    state = _strip_head(model, state)
    files = sorted({str(p) for p in origin.values()}) or [str(directory)]
    check_state_dict(model, state, ", ".join(files))
    model.load_state_dict(state, strict=False)
    if isinstance(dtype, torch.dtype):
        model.to(dtype)
    elif isinstance(dtype, str) and dtype != "auto":
        model.to(getattr(torch, dtype))
    if isinstance(device_map, (str, torch.device)) and str(device_map) != "auto":
        model.to(device_map)
    model.eval()
    model.name_or_path = str(name_or_path)
    model.config.name_or_path = str(name_or_path)
    if deq:
        model.set_deq(**deq)
    return model


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                       "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def header_state(directory: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Meta tensors (shape and dtype, no data) for every weight of a checkpoint, from the headers only."""
    state: dict[str, torch.Tensor] = {}
    files = []
    for path in weight_files(directory):
        files.append(str(path))
        for key, info in read_safetensors_header(path).items():
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which no deqzoo "
                                      "model uses")
            state[key] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return state, files


def precheck(model_cls: type, config: Any, directory: Path, *, max_parameters: int | None = None) -> None:
    """Build the model on the meta device (nothing allocated) and check its size against the budget and its
    keys, shapes and dtypes against the safetensors headers, before the real model or any tensor exists."""
    source = str(Path(directory) / "config.json")
    try:
        with torch.device("meta"):
            meta_model = model_cls(config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: {err}") from err
    tensors = list(meta_model.parameters()) + list(meta_model.buffers())
    count = sum(t.numel() for t in tensors)
    check_budget(count, sum(t.numel() * t.element_size() for t in tensors), source, max_parameters)
    state, files = header_state(directory)
    check_state_dict(meta_model, _strip_head(meta_model, state, quiet=True), ", ".join(files) or source)


def _strip_head(model: torch.nn.Module, state: dict[str, torch.Tensor], quiet: bool = False
                ) -> dict[str, torch.Tensor]:
    """Base model from a checkpoint with a task head (transformers convention): keep `<prefix>.*` keys."""
    prefix = getattr(model, "base_model_prefix", "")
    expected = model.state_dict().keys()
    if not prefix or any(k.startswith(prefix + ".") for k in expected):
        return state
    base = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
    if not base or set(base) != set(expected):  # not that case: let check_state_dict report the mismatch
        return state
    dropped = sorted(k for k in state if not k.startswith(prefix + "."))
    if quiet:
        return base
    logger.warning("Loading %s from a checkpoint with a task head; unused head weights: %s",
                   type(model).__name__, ", ".join(dropped))
    return base


def load_config(config_cls: type, directory: Path):
    """The config of a checkpoint folder, read with size/depth limits and validated (types, ranges) before
    anything is built; errors name the file and the key."""
    path = confined(directory, "config.json", directory)
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    data = read_json(path)
    want = getattr(config_cls, "model_type", "")
    if want and data.get("model_type") != want:
        raise CheckpointError(f"{path}: model_type {data.get('model_type')!r} but {config_cls.__name__} "
                              f"expects {want!r}")
    try:
        return config_cls.from_dict(data)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path}: {err}") from err
