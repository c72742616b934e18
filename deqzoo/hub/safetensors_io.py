"""Safe weight files: safetensors only, headers checked before any tensor is read, errors name the file."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from ..errors import CheckpointError  # defined with the other errors; re-exported here

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files that would need unpickling to load; deqzoo refuses them outright.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_MAX_HEADER = 100 * 1024 * 1024
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Tensor metadata {name: {"dtype", "shape", "data_offsets"}} of a safetensors file, validated.

    Checks the header length, JSON, and that every tensor's byte range fits inside the file, so a truncated
    or corrupted file fails here with its path in the message instead of deep inside a loader.

    Example:
        >>> import tempfile, torch, safetensors.torch as st
        >>> p = tempfile.mktemp(suffix=".safetensors"); st.save_file({"w": torch.zeros(2, 3)}, p)
        >>> read_safetensors_header(p)["w"]["shape"]
        [2, 3]
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: not a safetensors file "
                                      f"(only {size} bytes, header length missing)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header claims {header_len} bytes, "
                    f"file has {size})")
            header_bytes = handle.read(header_len)
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: weights file not found") from err
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: corrupt safetensors header ({type(err).__name__}: {err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        # JSON booleans are ints to Python and a 2-character string unpacks into two "offsets": check types
        if not (_int_list(offsets) and len(offsets) == 2 and _int_list(shape) and dtype in _DTYPE_BYTES):
            shown = repr(info) if len(repr(info)) < 200 else repr(info)[:197] + "..."
            raise CheckpointError(f"{path}: corrupt safetensors entry for tensor {name!r}: {shown} (needs a "
                                  "known 'dtype', a 'shape' of non-negative integers and 'data_offsets' "
                                  "[start, end] of non-negative integers)")
        start, end = offsets
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if end > data_len or end - start != nbytes or start < 0:
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors file: tensor {name!r} needs bytes {start}..{end} "
                f"({nbytes} expected) but the data section has {data_len} bytes")
    return header


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def refuse_pickles(directory: str | os.PathLike, variant: str | None = None) -> None:
    """Raise when a checkpoint directory offers only pickle-based weights (which deqzoo never loads)."""
    directory = Path(directory)
    single, index = weight_names(variant)
    if (directory / single).is_file() or (directory / index).is_file():
        return
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(pickles)}); "
            "deqzoo loads safetensors only and "
            f"never unpickles. Convert them with `deqzoo convert` (uses torch.load(weights_only=True)).")
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
    from .validation import confined

    folder = Path(folder)
    entries = sorted(folder.iterdir())
    for entry in entries:
        confined(folder, entry.name, source)
    weights = [p for p in entries if p.suffix == ".safetensors"]
    pickles = [p.name for p in entries if p.suffix in PICKLE_SUFFIXES]
    if pickles and not weights:
        raise CheckpointError(f"{folder}: only pickle weights found ({', '.join(pickles)}); deqzoo loads "
                              "safetensors only and never unpickles")
    for path in weights:
        read_safetensors_header(path)


def weight_files(directory: str | os.PathLike, variant: str | None = None) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded via the index)."""
    from .validation import confined, read_json

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
