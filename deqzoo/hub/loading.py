"""Resolution (local -> embedded -> HF cache -> Hub) and safe loading: safetensors only, never unpickles;
every mismatch between a config and its weights reported at once (missing, unexpected, mis-shaped keys)."""

from __future__ import annotations

import copy
import logging
import os
import time
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
    """The catalog entry of an embedded checkpoint or hypersolver (``deqzoo/<short>`` or ``<short>``)."""
    for catalog in (load_catalog(), load_catalog(section="hypersolvers")):
        if entry := catalog.get(name) or catalog.get(f"{NAMESPACE}/{name}"):
            return entry
    return None


# (path, size, mtime, ctime, inode) -> sha256 of the files this process has hashed. ctime cannot be set back
# by the user, so an edit in place with the mtime restored misses the cache; as git does for its index, a file
# whose ctime is within the filesystem's timestamp granularity of the hash ("racily clean") is not cached.
_HASHED: dict[tuple, str] = {}
_RACY_NS = 2_000_000_000


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed once per process while the file is unchanged.

    Example:
        >>> from deqzoo.hub.catalog import load_catalog, embedded_folder
        >>> folder = embedded_folder(load_catalog()["deqzoo/mdeq-tiny-mnist"])
        >>> len(file_sha256(folder / "config.json"))
        64
    """
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key in _HASHED:
        return _HASHED[key]
    digest = sha256_file(path)
    if time.time_ns() - st.st_ctime_ns > _RACY_NS:
        _HASHED[key] = digest
    return digest


def verify_embedded(entry: dict[str, Any], folder: Path) -> None:
    """Check every file's sha256 against the catalog; raise naming the first file that differs."""
    for rel, expected in entry["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the catalog for {entry['id']} but missing")
        actual = file_sha256(path)
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


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None,
            cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
            local_files_only: bool = False, force_download: bool = False,
            endpoint: str | None = None) -> Path:
    """Local directory of a checkpoint: a directory, an embedded checkpoint (every file's sha256 checked), the
    HF cache, the Hub (safetensors, JSON and text files only).

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
    name, entry = str(name_or_path), embedded_entry(str(name_or_path))
    if entry is not None and (folder := embedded_folder(entry)) is not None:
        verify_embedded(entry, folder)
        return folder
    if entry is not None:  # folder not shipped with this install: the cache / Hub
        name = entry["id"]
    if path.exists():
        raise CheckpointError(f"{path}: is a file; a checkpoint is a directory (config.json + weights)")
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise CheckpointError(
            f"{name!r} is neither a directory nor an embedded checkpoint nor a Hub repo id (owner/name). "
            f"Embedded checkpoints: {sorted(load_catalog()) or 'none'}")
    try:
        return _from_hub(name, revision=revision, cache_dir=cache_dir, token=token,
                         local_files_only=local_files_only or is_offline(), force_download=force_download,
                         endpoint=endpoint)
    except CheckpointError as err:
        if entry is None:
            raise
        missing = PACKAGED_CARDS_DIR / Path(entry["location"]).name
        raise CheckpointError(f"{name} is in the catalog but its folder {missing} is not part of this "
                              f"install (nor inside the package, where a wheel carries them); {err}") from err


def _from_hub(repo_id: str, *, local_files_only: bool, endpoint: str | None, **kwargs) -> Path:
    from huggingface_hub import snapshot_download

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    common, cache_error = dict(repo_id=repo_id, allow_patterns=SAFE_PATTERNS, **kwargs), None
    if not kwargs.get("force_download"):
        try:  # the HF cache first: no network when the snapshot is already there
            return Path(snapshot_download(local_files_only=True, **common))
        except Exception as err:  # noqa: BLE001 - any cache miss falls through to the Hub
            cache_error = err
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


def load_weights_file(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Load one safetensors file into `model`, header, keys, shapes and dtypes checked first (errors name the
    file)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: deqzoo loads safetensors files only and never unpickles; convert it "
                              "with `deqzoo convert`")
    state = _read_weights(path)
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
                     strict: bool = True, ignore_mismatched_sizes: bool = False, new_head: bool = False
                     ) -> dict[str, list]:
    """`compare_state`'s findings; raises listing every problem when a key is mis-shaped (unless
    `ignore_mismatched_sizes`) or mistyped, or, with `strict`, missing or unexpected; with `new_head` (a
    checkpoint of another class: transformers' re-heading) keys outside the base model are not held to it."""
    found = compare_state(model, state)
    prefix = getattr(model, "base_model_prefix", "") + "."
    strict_keys = {kind: [k for k in found[kind] if not (new_head and not k.startswith(prefix))]
                   for kind in ("missing_keys", "unexpected_keys")} if strict else {}
    mismatched = found["mismatched_keys"] and not ignore_mismatched_sizes
    if found["mistyped_keys"] or mismatched or any(strict_keys.values()):
        hint = ("\n  (pass ignore_mismatched_sizes=True to re-initialise mis-shaped weights, as for a new "
                "number of labels)" if mismatched else "") + (
            "\n  (pass strict=False to load anyway: the missing weights are newly initialised and reported, "
            "as transformers does)" if any(strict_keys.values()) else "")
        raise CheckpointMismatchError(mismatch_report(model, {**found, **strict_keys}, source) + hint)
    return found


# `resolve`'s own keywords, the one list every loader passes on (transformers reads them too)
RESOLVE_KEYWORDS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
# Keywords of transformers' from_pretrained that would load something other than a safetensors checkpoint.
_REFUSED = {"gguf_file": "GGUF files are not safetensors",
            "adapter_kwargs": "adapters name another model to load",
            "quantization_config": "deqzoo models are not quantised"}


def prepare_pretrained(model_cls: type, name_or_path: str | os.PathLike | None, *,
                       max_parameters: int | None = None, strict: bool = True, **kwargs: Any
                       ) -> tuple[str | None, Any, dict]:
    """What deqzoo does before transformers' ``from_pretrained``: (local folder or None, the validated config,
    the caller's keywords for transformers). The name resolves (`resolve`); the config is read with limits
    (``config=`` may be its dict, already read) and overridden by keywords naming its attributes, as the Auto
    classes do. Refused before anything is allocated, naming the cause: other formats, adapters, a model
    above the parameter budget, weights whose headers do not match (`precheck`)."""
    if kwargs.get("use_safetensors", True) is False:
        raise CheckpointError("deqzoo loads safetensors only; use_safetensors=False is not supported")
    for key, why in _REFUSED.items():
        if kwargs.get(key):
            raise CheckpointError(f"{model_cls.__name__}.from_pretrained: {key}= is not supported ({why}; "
                                  "deqzoo loads safetensors checkpoints only)")
    endpoint = kwargs.pop("endpoint", None)  # deqzoo's own: where `resolve` downloads from
    config = kwargs.pop("config", None)
    folder = None
    if name_or_path is None:
        if isinstance(config, (str, os.PathLike, dict, type(None))) or kwargs.get("state_dict") is None:
            raise TypeError(f"{model_cls.__name__}.from_pretrained(None, ...) needs both config= and "
                            "state_dict= (there is no checkpoint folder to read them from)")
    else:
        directory = resolve(name_or_path, endpoint=endpoint,
                            **{k: kwargs[k] for k in RESOLVE_KEYWORDS if k in kwargs})
        name_or_path = str(directory)
        subfolder = kwargs.get("subfolder") or ""
        folder = confined(directory, subfolder, f"subfolder={subfolder!r}") if subfolder else directory
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: subfolder={subfolder!r} is not a folder of the checkpoint")
        if (folder / "adapter_config.json").exists():
            raise CheckpointError(f"{folder / 'adapter_config.json'}: adapter checkpoints name another "
                                  "model to load; deqzoo does not load them")
    pristine = False
    if config is None or isinstance(config, dict):  # a dict: the folder's config.json as the caller read it
        config, kwargs, pristine = load_config(model_cls.config_class, folder, raw=config, **kwargs)
    elif isinstance(config, (str, os.PathLike)):
        config, kwargs, _ = load_config(model_cls.config_class, Path(config), **kwargs)
    state_dict = kwargs.get("state_dict")
    if (pristine and state_dict is None and not kwargs.get("variant")
            and model_cls.__name__ in (config.architectures or []) and is_shipped(folder)):
        # The catalog's files (sha256 checked) into the class they were saved from, with their config:
        # tests/hub/test_hub_zoo.py runs `precheck` strictly on each shipped checkpoint, so its meta-device
        # build (most of deqzoo's CPU share here) would find nothing to refuse or bridge. The budget (the
        # caller may lower it) is still checked, on the tensors in the file.
        check_budget(header_state(folder)[0].values(), str(folder / "config.json"), max_parameters)
        bridge = None
    else:
        bridge = precheck(model_cls, config, folder if state_dict is None else None, state=state_dict,
                          max_parameters=max_parameters, variant=kwargs.get("variant"), strict=strict,
                          ignore_mismatched_sizes=kwargs.get("ignore_mismatched_sizes", False))
    if bridge:  # base model <-> task head: transformers' own bridging misses weight-norm's renamed keys
        kwargs["state_dict"] = _bridge_prefix(bridge, load_state_dict(folder, kwargs.get("variant")))
        kwargs.pop("subfolder", None)
        name_or_path = None  # transformers takes either a folder or tensors
    kwargs.update(use_safetensors=True, trust_remote_code=False)  # config.json's auto_map never runs
    return name_or_path, config, kwargs


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


def precheck(model_cls: type, config: Any, directory: Path | None, *, state: dict | None = None,
             max_parameters: int | None = None, ignore_mismatched_sizes: bool = False,
             variant: str | None = None, strict: bool = True) -> torch.nn.Module | None:
    """Build the model on the meta device and check its size against the budget and its keys, shapes and
    dtypes against the headers (or `state`). Returns the meta model when the keys need base-model bridging."""
    source = str(Path(directory) / "config.json") if directory is not None else "the given config"
    try:
        with torch.device("meta"):
            meta_model = model_cls(config)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: {err}") from err
    check_budget([*meta_model.parameters(), *meta_model.buffers()], source, max_parameters)
    if directory is None and state is None:
        return None
    state, files = header_state(directory, variant) if directory is not None else (state, ["state_dict="])
    bridged = _bridge_prefix(meta_model, state)
    other_class = bool(config.architectures) and model_cls.__name__ not in config.architectures
    check_state_dict(meta_model, bridged, ", ".join(files) or source, strict=strict, new_head=other_class,
                     ignore_mismatched_sizes=ignore_mismatched_sizes)
    return meta_model if bridged is not state else None


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


def load_config(config_cls: type, directory: Path, *, raw: dict | None = None, **kwargs: Any
                ) -> tuple[Any, dict[str, Any], bool]:
    """(config, the keywords it did not take, whether none overrode it): ``config.json`` (or `raw`) read with
    limits and validated, errors naming the file and key; keywords naming an attribute override it."""
    path = confined(directory, "config.json", directory)
    if raw is None:
        if not path.is_file():
            raise CheckpointError(f"{directory}: no config.json")
        raw = read_json(path)
    want = getattr(config_cls, "model_type", "")
    if want and raw.get("model_type") != want:
        raise CheckpointError(f"{path}: model_type {raw.get('model_type')!r} but {config_cls.__name__} "
                              f"expects {want!r}")
    try:
        config = config_cls.from_dict(copy.deepcopy(raw))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path}: {err}") from err
    # the loading dtype is from_pretrained's, not a config override (transformers pops it before it reads
    # the config: ``dtype="auto"`` set on the config would reach torch as ``torch.auto``)
    loading = {k: kwargs.pop(k) for k in ("dtype", "torch_dtype") if k in kwargs}
    if not kwargs:
        return config, loading, True
    config, unused = config_cls.from_dict(copy.deepcopy(raw), return_unused_kwargs=True, **kwargs)
    if len(unused) < len(kwargs) and callable(getattr(config, "validate", None)):
        config.validate()  # the overrides together, as __init__ checks them
    return config, {**unused, **loading}, len(unused) == len(kwargs)
