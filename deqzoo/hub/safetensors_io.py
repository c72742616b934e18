"""Safe weight files: safetensors only, headers checked before any tensor is read, errors name the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError  # defined with the other errors; re-exported here
from .validation import confined, read_json

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files that would need unpickling to load; deqzoo refuses them outright.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "C64", "U64", "I64", "F64",
           "F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Tensor metadata {name: {"dtype", "shape"}} of a safetensors file, validated by safetensors itself
    (header size and JSON, known dtypes, non-negative integer shapes, byte ranges that tile the data section)
    without reading any tensor; a truncated or corrupt file fails here with its path (and the tensor at fault)
    in the message instead of deep inside a loader.

    Example:
        >>> import tempfile, torch, safetensors.torch as st
        >>> p = tempfile.mktemp(suffix=".safetensors"); st.save_file({"w": torch.zeros(2, 3)}, p)
        >>> read_safetensors_header(p)["w"]["shape"]
        [2, 3]
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file not found")
    try:
        with safe_open(str(path), "pt") as handle:
            return {k: {"dtype": (s := handle.get_slice(k)).get_dtype(), "shape": s.get_shape()}
                    for k in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: {_bad_entry(path) or 'corrupt safetensors header'} or truncated file "
                              f"({type(err).__name__}: {err})") from err


def _bad_entry(path: Path) -> str | None:
    """'corrupt safetensors entry for tensor ...' naming the first malformed entry, when the header parses."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(min(length, 100 << 20)))
    except (OSError, ValueError, struct.error, RecursionError):
        return None
    for name, info in header.items() if isinstance(header, dict) else ():
        info = info if isinstance(info, dict) else {}
        if name != "__metadata__" and (info.get("dtype") not in _DTYPES or not all(
                isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)
                for v in (info.get("shape"), info.get("data_offsets")))):
            shown = repr(info) if len(repr(info)) < 200 else repr(info)[:197] + "..."
            return f"corrupt safetensors entry for tensor {name!r}: {shown}"
    return None


def refuse_pickles(directory: str | os.PathLike, variant: str | None = None, *,
                   has_weights: bool | None = None) -> None:
    """Raise when a checkpoint folder offers only pickle-based weights (which deqzoo never loads), or no
    weights at all; `has_weights` says instead whether it holds safetensors (a diffusers component may hold
    none)."""
    directory = Path(directory)
    single, index = weight_names(variant)
    found = has_weights if has_weights is not None else (directory / single).is_file() or (
        directory / index).is_file()
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not found:
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(pickles)}); "
            "deqzoo loads safetensors only and "
            f"never unpickles. Convert them with `deqzoo convert` (uses torch.load(weights_only=True)).")
    if not found and has_weights is None:
        raise CheckpointError(f"{directory}: no {single} found")


def weight_names(variant: str | None = None) -> tuple[str, str]:
    """(single file, shard index) names, with transformers' ``variant`` spelling (model.fp16.safetensors)."""
    if not variant:
        return WEIGHTS_NAME, WEIGHTS_INDEX_NAME
    return f"model.{variant}.safetensors", f"model.safetensors.index.{variant}.json"


def check_component_folder(folder: str | os.PathLike, source: str | os.PathLike) -> None:
    """A component folder of a diffusers repository (``unet/``, ``scheduler/``), before diffusers reads it:
    every entry stays inside it (a link leading out is refused), weights are safetensors with sound headers,
    and a folder offering only pickle weights is refused (diffusers would unpickle them)."""
    folder = Path(folder)
    entries = sorted(folder.iterdir())
    for entry in entries:
        confined(folder, entry.name, source)
    weights = [p for p in entries if p.suffix == ".safetensors"]
    refuse_pickles(folder, has_weights=bool(weights))  # diffusers would unpickle them
    for path in weights:
        read_safetensors_header(path)


def weight_files(directory: str | os.PathLike, variant: str | None = None) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded via the index)."""
    directory = Path(directory)
    refuse_pickles(directory, variant)
    single_name, index_name = weight_names(variant)
    single = directory / single_name
    if single.is_file() or single.is_symlink():
        return [confined(directory, single_name, directory)]
    index_path = confined(directory, index_name, directory)
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: malformed safetensors index (key 'weight_map' must be a "
                              "non-empty mapping of tensor name -> shard file)")
    shards = []
    for key, shard in weight_map.items():
        path = confined(directory, shard, f"{index_path} (weight_map[{key!r}])")
        if not str(shard).endswith(".safetensors"):
            raise CheckpointError(f"{index_path}: shard {shard!r} of {key!r} is not a .safetensors file")
        shards.append(path)
    return sorted(set(shards))
