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
        try:
            start, end = info["data_offsets"]
            shape = info["shape"]
            nbytes = math.prod(shape) * _DTYPE_BYTES.get(info["dtype"], 1)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors entry for tensor {name!r}: {info!r}") from err
        if end > data_len or end - start != nbytes or start < 0:
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors file: tensor {name!r} needs bytes {start}..{end} "
                f"({nbytes} expected) but the data section has {data_len} bytes")
    return header


def refuse_pickles(directory: str | os.PathLike) -> None:
    """Raise when a checkpoint directory offers only pickle-based weights (which deqzoo never loads)."""
    directory = Path(directory)
    if (directory / WEIGHTS_NAME).is_file() or (directory / WEIGHTS_INDEX_NAME).is_file():
        return
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(pickles)}); "
            "deqzoo loads safetensors only and "
            f"never unpickles. Convert them with `deqzoo convert` (uses torch.load(weights_only=True)).")
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} found")


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded via the index)."""
    from .validation import confined, read_json

    directory = Path(directory)
    refuse_pickles(directory)
    single = directory / WEIGHTS_NAME
    if single.is_file() or single.is_symlink():
        return [confined(directory, WEIGHTS_NAME, directory)]
    index_path = confined(directory, WEIGHTS_INDEX_NAME, directory)
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
