"""deqzoo: the model zoo and pretrained-model hub for deep equilibrium models.

``import deqzoo`` is cheap: it imports no torch, transformers or timm. The public functions load their modules
on first use, and deqzoo registers its families with transformers' Auto classes (and its MDEQ entries with
timm's registry) as soon as the user's code imports those libraries (see ``deqzoo._imports``), so stock code
such as ``transformers.AutoModel.from_pretrained(path)`` works after ``import deqzoo``.

Example:
    >>> import deqzoo
    >>> isinstance(deqzoo.list_models(), list)
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _imports

__version__ = "0.1.0"

_LAZY = {"ModelInfo": "factory", "create_model": "factory", "from_pretrained": "factory",
         "list_models": "factory"}
_SUBMODULES = {"bench", "cli", "core", "export", "factory", "hub", "integrations", "modeling_utils", "models",
               "tasks"}

if TYPE_CHECKING:  # static tools see the real names
    from .factory import ModelInfo, create_model, from_pretrained, list_models


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'deqzoo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


_imports.install()

__all__ = ["ModelInfo", "__version__", "create_model", "from_pretrained", "list_models"]
