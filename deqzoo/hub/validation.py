"""One validation layer for every file a checkpoint brings: size- and depth-limited JSON and YAML, file names
confined to the checkpoint folder, and the allocation budget a config is checked against before anything is
built. Every error names the file (and the key) at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ..errors import CheckpointError

MAX_JSON_BYTES = 16 * 1024 * 1024  # config.json, index files: real ones are a few KB
MAX_YAML_BYTES = 1024 * 1024  # a model card's front matter
MAX_DEPTH = 32  # nesting of any JSON/YAML document (a config nests a few levels)
DEFAULT_MAX_PARAMETERS = 1_000_000_000  # 4 GB in float32; the zoo's largest models hold ~0.3 B


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON/YAML, iteratively (a deep document must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON file with size and nesting limits; the top level must be an object (a dict).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "config.json"; _ = p.write_text('{"a": [1, 2]}')
        >>> read_json(p)
        {'a': [1, 2]}
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: {size:,} bytes, above the limit of {max_bytes:,} for this file")
        raw = path.read_bytes()
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: file not found") from err
    except IsADirectoryError as err:
        raise CheckpointError(f"{path}: is a directory, expected a JSON file") from err
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not UTF-8 text ({err})") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: malformed JSON ({err})") from err
    except RecursionError as err:
        raise CheckpointError(f"{path}: JSON nested too deeply to parse (limit {max_depth} levels)") from err
    depth = _depth(data)
    if depth > max_depth:
        raise CheckpointError(f"{path}: JSON nested {depth} levels deep, above the limit of {max_depth}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the top level must be a JSON object, got "
                              f"{'null' if data is None else type(data).__name__}")
    return data


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader without anchors/aliases (a few lines of them expand to gigabytes: 'billion laughs')."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases are not allowed (line {event.start_mark.line + 1})")
        if len(self.__dict__.setdefault("_deqzoo_stack", [])) > MAX_DEPTH:
            raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels")
        self._deqzoo_stack.append(None)
        try:
            return super().compose_node(parent, index)
        finally:
            self._deqzoo_stack.pop()


def load_yaml(text: str, source: str | os.PathLike, *, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """yaml.safe_load with a size limit, no aliases and a depth limit; errors name `source`.

    Example:
        >>> load_yaml("a: [1, 2]", "README.md")
        {'a': [1, 2]}
    """
    if len(text.encode("utf-8", "replace")) > max_bytes:
        raise ValueError(f"{source}: YAML metadata larger than {max_bytes:,} bytes")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: malformed or unsafe YAML front matter: {err}") from err
    except RecursionError as err:
        raise ValueError(f"{source}: YAML nested too deeply") from err


def _allowed_roots(directory: Path) -> list[Path]:
    root = directory.resolve()
    roots = [root]
    # A Hugging Face cache snapshot (and each subfolder of it) is a folder of symlinks into the repository's
    # blobs/ folder.
    for folder in (root, *root.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            roots.append(folder.parent.parent / "blobs")
            break
    return roots


def confined(directory: str | os.PathLike, name: Any, source: str | os.PathLike) -> Path:
    """`directory / name` for a file name read from `source`, refused unless it stays inside `directory`:
    no absolute path, no `..`, no symlink leading out (a Hub cache snapshot may link into its own blobs/).

    Example:
        >>> confined(".", "model-00001-of-00002.safetensors", "index.json").name
        'model-00001-of-00002.safetensors'
    """
    directory = Path(directory)
    if not isinstance(name, str) or not name.strip():
        raise CheckpointError(f"{source}: file name {name!r} is not a non-empty string")
    pure = PurePosixPath(name)
    if ("\x00" in name or "\\" in name or pure.is_absolute() or Path(name).is_absolute() or ".." in pure.parts
            or (len(name) > 1 and name[1] == ":")):
        raise CheckpointError(f"{source}: file name {name!r} leaves the checkpoint folder {directory} "
                              "(only plain names inside it are allowed)")
    path = directory / name
    real = path.resolve()
    if not any(real == root or root in real.parents for root in _allowed_roots(directory)):
        raise CheckpointError(f"{source}: {name!r} is a link leading outside the checkpoint folder "
                              f"{directory} (to {real})")
    return path


_NETWORK_MODULES = ("httpx", "httpcore", "huggingface_hub", "requests", "urllib3")


def is_network_error(err: BaseException) -> bool:
    """An error raised by the HTTP stack (httpx/httpcore in any packaging, requests, huggingface_hub)."""
    return isinstance(err, OSError) or any(cls.__module__.startswith(_NETWORK_MODULES)
                                           for cls in type(err).__mro__)


def max_parameters(value: int | None = None) -> int:
    """The parameter budget: `value`, else $DEQZOO_MAX_PARAMETERS, else 1e9."""
    if value is not None:
        return int(value)
    env = os.environ.get("DEQZOO_MAX_PARAMETERS", "").strip()
    if env:
        try:
            return int(float(env))
        except ValueError as err:
            raise ValueError(f"DEQZOO_MAX_PARAMETERS={env!r} is not a number") from err
    return DEFAULT_MAX_PARAMETERS


def check_budget(tensors: Iterable[Any], source: str, budget: int | None = None) -> None:
    """Refuse a model whose parameters and buffers (`tensors`, meta tensors will do) exceed the budget,
    stating both numbers."""
    tensors, limit = list(tensors), max_parameters(budget)
    if (count := sum(t.numel() for t in tensors)) > limit:
        raise CheckpointError(
            f"{source}: this config would allocate {count:,} parameters and buffers "
            f"({sum(t.numel() * t.element_size() for t in tensors) / 2**30:.2f} GiB), "
            f"above the budget of {limit:,}; if that is intended, pass max_parameters= or set "
            "DEQZOO_MAX_PARAMETERS")
