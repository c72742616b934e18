"""Resolution (local -> embedded -> HF cache -> Hub), safe weight loading and atomic saving.

Weights load only from safetensors; nothing here unpickles. Every mismatch between a config and its weights is
reported at once: missing, unexpected and mis-shaped keys (with both shapes) and the file they came from.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import CheckpointMismatchError
from .catalog import NAMESPACE, PACKAGED_CARDS_DIR, embedded_folder, load_catalog, sha256_file
from .safetensors_io import CheckpointError, read_safetensors_header, weight_files
from .saving import recover
from .validation import check_budget, confined, is_network_error, read_json

logger = logging.getLogger("deqzoo")
# What we fetch from the Hub: configs, safetensors, cards, tokenizer/processor text files. Never pickles.
SAFE_PATTERNS = ["*.json", "*.safetensors", "*.md", "*.txt", "*.model", "*.png"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read at call time (tests and users may set them late)."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def embedded_entry(name: str) -> dict[str, Any] | None:
    """The catalog entry of an embedded checkpoint or hypersolver (``deqzoo/<short>`` or just ``<short>``),
    or None."""
    for catalog in (load_catalog(), load_catalog(section="hypersolvers")):
        if entry := catalog.get(name) or catalog.get(f"{NAMESPACE}/{name}"):
            return entry
    return None


def verify_embedded(entry: dict[str, Any], folder: Path) -> None:
    """Check every file's sha256 against the catalog; raise naming the first file that differs."""
    for rel, expected in entry["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the catalog for {entry['id']} but missing")
        # hashed on every load (embedded files are a few MB): a cache keyed by size and mtime would accept a
        # file edited in place with its mtime restored
        actual = sha256_file(path)
        if actual != expected:
            raise CheckpointError(
                f"{path}: sha256 {actual} does not match the catalog ({expected}) for {entry['id']}; "
                "the embedded checkpoint was modified or corrupted "
                "(regenerate with `python -m utils.catalog` if intended)")


def is_shipped(directory: Path) -> bool:
    """Whether `directory` is an embedded checkpoint's folder holding exactly the catalog's files (sha256)."""
    entry = next((e for e in load_catalog().values() if embedded_folder(e) == directory), None)
    try:
        return entry is not None and verify_embedded(entry, directory) is None
    except CheckpointError:  # an edited embedded folder loads as any user folder: with the precheck
        return False


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
    if not str(name_or_path).strip():  # Path("") is the working directory: never load that by accident
        raise CheckpointError(f"{name_or_path!r}: an empty name is not a checkpoint (give a directory, an "
                              "embedded id or a Hub repo id)")
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


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    read_safetensors_header(path)  # errors name the file (and the tensor) before safetensors reads data
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{path}: cannot read safetensors file ({err})") from err


def load_state_dict(directory: str | os.PathLike, variant: str | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (safetensors only, every header checked first)."""
    return {key: tensor for path in weight_files(directory, variant)
            for key, tensor in _read_weights(path).items()}


def load_weights_file(model: torch.nn.Module, path: str | os.PathLike, *, strip_prefix: str = ""
                      ) -> torch.nn.Module:
    """Load one safetensors file into `model`: header checked first, then every key, shape and dtype against
    the model (errors name the file); never unpickles. Keys starting with `strip_prefix` (a wrapper's
    ``model.``) may be saved with it."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: deqzoo loads safetensors files only and never unpickles; convert it "
                              "with `deqzoo convert`")
    state = _read_weights(path)
    if strip_prefix and state and all(k.startswith(strip_prefix) for k in state):
        state = {k[len(strip_prefix):]: v for k, v in state.items()}
    check_state_dict(model, state, str(path))
    model.load_state_dict(state, strict=False)
    return model


def compare_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list]:
    """Missing, unexpected, mis-shaped ((key, checkpoint shape, model shape)) and mistyped keys of `state`
    against `model` (tied duplicates may be absent; floating-point weights may be cast)."""
    expected = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for key, value in expected.items():
        groups.setdefault(id(value), []).append(key)
    return {
        "missing_keys": [k for k in expected
                         if k not in state and not any(o in state for o in groups[id(expected[k])])],
        "unexpected_keys": [k for k in state if k not in expected],
        "mismatched_keys": [(k, tuple(state[k].shape), tuple(expected[k].shape)) for k in state
                            if k in expected and tuple(state[k].shape) != tuple(expected[k].shape)],
        "mistyped_keys": [(k, state[k].dtype, expected[k].dtype) for k in state if k in expected
                          and state[k].dtype != expected[k].dtype
                          and not (state[k].dtype.is_floating_point and expected[k].dtype.is_floating_point)],
    }


def mismatch_report(model: torch.nn.Module, found: dict[str, list], source: str) -> str:
    lines = [f"{source}: weights do not match the model built from its config ({type(model).__name__}):"]
    if found["missing_keys"]:
        lines.append(f"  missing keys ({len(found['missing_keys'])}): " + ", ".join(found["missing_keys"]))
    if found["unexpected_keys"]:
        lines.append(f"  unexpected keys ({len(found['unexpected_keys'])}): "
                     + ", ".join(found["unexpected_keys"]))
    for key, got, want in found["mismatched_keys"]:
        lines.append(f"  mis-shaped key {key}: checkpoint {list(got)} vs model {list(want)}")
    for key, got, want in found["mistyped_keys"]:
        lines.append(f"  dtype of key {key}: checkpoint {got} vs model {want} (only floating-point weights "
                     "may be cast)")
    return "\n".join(lines)


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, *,
                     strict: bool = True, ignore_mismatched_sizes: bool = False) -> dict[str, list]:
    """Compare `state` with `model`; raise listing every problem (both shapes of a mis-shaped key) when a key
    is mis-shaped (unless `ignore_mismatched_sizes`) or mistyped, or, with `strict`, missing or unexpected.
    Returns what `compare_state` found."""
    found = compare_state(model, state)
    fatal = found["mistyped_keys"] or (found["mismatched_keys"] and not ignore_mismatched_sizes) or (
        strict and (found["missing_keys"] or found["unexpected_keys"]))
    if fatal:
        hint = ("\n  (pass ignore_mismatched_sizes=True to re-initialise mis-shaped weights, as for a new "
                "number of labels)" if found["mismatched_keys"] and not ignore_mismatched_sizes else "")
        raise CheckpointMismatchError(mismatch_report(model, found, source) + hint)
    return found


# The keywords transformers' PreTrainedModel.from_pretrained reads itself (5.x); any other keyword naming a
# config attribute overrides it, as in transformers, and anything else is an error naming it.
TRANSFORMERS_KEYWORDS = frozenset({
    "config", "cache_dir", "ignore_mismatched_sizes", "force_download", "local_files_only", "token",
    "revision", "use_safetensors", "weights_only", "fusion_config", "disable_mmap", "state_dict", "proxies",
    "tqdm_class",
    "output_loading_info", "_from_pipeline", "_from_auto", "dtype", "torch_dtype", "device_map", "max_memory",
    "offload_folder", "offload_buffers", "quantization_config", "subfolder", "_commit_hash", "variant",
    "adapter_kwargs", "adapter_name", "generation_config", "gguf_file", "distributed_config", "device_mesh",
    "tp_plan", "tp_size", "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config",
    "key_mapping", "attn_implementation", "experts_implementation", "low_cpu_mem_usage", "code_revision",
    "user_agent", "mirror", "resume_download", "from_tf", "from_flax", "local_files_only_fallback"})
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "endpoint", "proxies")
_REFUSED = {"gguf_file": "GGUF files are not safetensors",
            "from_tf": "TensorFlow checkpoints are not safetensors",
            "from_flax": "Flax checkpoints are not safetensors",
            "adapter_kwargs": "adapters name another model to load",
            "quantization_config": "deqzoo models are not quantised"}


def prepare_pretrained(model_cls: type, name_or_path: str | os.PathLike | None, *,
                       max_parameters: int | None = None, **kwargs: Any) -> tuple[str | None, Any, dict]:
    """What deqzoo does before transformers' ``from_pretrained`` runs; returns (local folder or None, the
    validated config, the keywords left for transformers).

    The name resolves to a local folder (`resolve`: directory, embedded checkpoint with sha256 check, HF
    cache, Hub with safe files only; ``subfolder`` confined to it). Refused with an error naming the cause,
    before anything is allocated: pickle-only or non-safetensors loading, keywords that would load other
    formats or another model (``gguf_file``, adapters), an ``adapter_config.json`` in the folder, a config
    that fails validation (types, ranges), a model above the parameter budget, weights whose headers do not
    match the model (mis-shaped keys unless ``ignore_mismatched_sizes``, dtypes that need more than a float
    cast). Config attributes given as keywords override the config (validated like ``__init__``)."""
    if kwargs.get("use_safetensors", True) is False:
        raise CheckpointError("deqzoo loads safetensors only; use_safetensors=False is not supported")
    for key, why in _REFUSED.items():
        if kwargs.pop(key, None):
            raise CheckpointError(f"{model_cls.__name__}.from_pretrained: {key}= is not supported ({why}; "
                                  "deqzoo loads safetensors checkpoints only)")
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    subfolder = kwargs.pop("subfolder", "") or ""
    config = kwargs.pop("config", None)
    directory = None
    if name_or_path is None:
        if config is None or kwargs.get("state_dict") is None:
            raise TypeError(f"{model_cls.__name__}.from_pretrained(None, ...) needs both config= and "
                            "state_dict= (there is no checkpoint folder to read them from)")
    else:
        directory = resolve(name_or_path, **hub)
        if subfolder:
            directory = confined(directory, subfolder, f"subfolder={subfolder!r}")
            if not directory.is_dir():
                raise CheckpointError(f"{directory}: subfolder={subfolder!r} is not a folder of the "
                                      "checkpoint")
        if (directory / "adapter_config.json").exists():
            raise CheckpointError(f"{directory / 'adapter_config.json'}: adapter checkpoints name another "
                                  "model to load; deqzoo does not load them")
    own_config = config is None and directory is not None
    if config is None:
        config = load_config(model_cls.config_class, directory)
    elif isinstance(config, (str, os.PathLike)):
        config = load_config(model_cls.config_class, Path(config))
    else:
        config = copy.deepcopy(config)
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k not in TRANSFORMERS_KEYWORDS}
    unknown = sorted(k for k in overrides if not hasattr(config, k))
    if unknown:
        raise TypeError(f"{model_cls.__name__}.from_pretrained got an unexpected keyword argument "
                        f"{unknown[0]!r}")
    if overrides and hasattr(config, "check_overrides"):  # a deqzoo config checks them like its __init__
        config.check_overrides(overrides)
    for key, value in overrides.items():
        setattr(config, key, value)
    if (own_config and not (overrides or subfolder or kwargs.get("variant"))
            and kwargs.get("state_dict") is None and model_cls.__name__ in (config.architectures or [])
            and is_shipped(directory)):
        # The catalog's files (sha256 just checked) into the class they were saved from, with their config:
        # tests/hub/test_hub_zoo.py runs `precheck` on each shipped checkpoint, so its meta-device build (most
        # of deqzoo's CPU share here) would find nothing to refuse or bridge. The budget (the caller may lower
        # it) is still checked, on the tensors in the file (buffers rebuilt from the config are not in it).
        check_budget(header_state(directory)[0].values(), str(directory / "config.json"), max_parameters)
        bridge = None
    else:
        bridge = precheck(model_cls, config, directory if kwargs.get("state_dict") is None else None,
                          max_parameters=max_parameters, variant=kwargs.get("variant"),
                          ignore_mismatched_sizes=kwargs.get("ignore_mismatched_sizes", False))
    if bridge:  # base model <-> task head: transformers' own bridging misses weight-norm's renamed keys
        kwargs["state_dict"] = _bridge_prefix(bridge, load_state_dict(directory, kwargs.get("variant")))
        directory = None  # transformers takes either a folder or tensors
    kwargs.update(use_safetensors=True, trust_remote_code=False)  # config.json's auto_map never runs
    return (str(directory) if directory is not None else None), config, kwargs


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                       "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def header_state(directory: Path, variant: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Meta tensors (shape and dtype, no data) for every weight of a checkpoint, from the headers only."""
    state: dict[str, torch.Tensor] = {}
    files = []
    for path in weight_files(directory, variant):
        files.append(str(path))
        for key, info in read_safetensors_header(path).items():
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which no deqzoo "
                                      "model uses")
            state[key] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return state, files


def precheck(model_cls: type, config: Any, directory: Path | None, *, max_parameters: int | None = None,
             ignore_mismatched_sizes: bool = False, variant: str | None = None) -> torch.nn.Module | None:
    """Build the model on the meta device (nothing allocated) and check its size against the budget and its
    keys, shapes and dtypes against the safetensors headers, before the real model or any tensor exists.
    Returns the meta model when the checkpoint's keys need base-model bridging (`_bridge_prefix`)."""
    source = str(Path(directory) / "config.json") if directory is not None else "the given config"
    try:
        with torch.device("meta"):
            meta_model = model_cls(config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: {err}") from err
    check_budget([*meta_model.parameters(), *meta_model.buffers()], source, max_parameters)
    if directory is not None:
        state, files = header_state(directory, variant)
        bridged = _bridge_prefix(meta_model, state)
        check_state_dict(meta_model, bridged, ", ".join(files) or source,
                         strict=False, ignore_mismatched_sizes=ignore_mismatched_sizes)
        return meta_model if bridged is not state else None
    return None


def _bridge_prefix(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' base-model bridging: a task head's checkpoint into its base model (keep the
    ``<base_model_prefix>.*`` keys, unprefixed) and a base model's checkpoint into a task head (prefixed)."""
    prefix = getattr(model, "base_model_prefix", "")
    expected = model.state_dict().keys()
    if not prefix or not state:
        return state
    head_model = any(k.startswith(prefix + ".") for k in expected)
    head_state = any(k.startswith(prefix + ".") for k in state)
    if head_state and not head_model:
        return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")} or state
    if head_model and not head_state and any(f"{prefix}.{k}" in expected for k in state):
        return {f"{prefix}.{k}": v for k, v in state.items()}
    return state


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
