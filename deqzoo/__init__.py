"""deqzoo: the model zoo and pretrained-model hub for deep equilibrium models.

``import deqzoo`` imports no torch, transformers or timm; loading one checkpoint imports only its family.
Stock code (``transformers.AutoModel.from_pretrained(path)``, ``timm.create_model("mdeq_tiny_mnist")``)
needs ``deqzoo.register()`` first.

Example:
    >>> import deqzoo
    >>> isinstance(deqzoo.list_models(), list)
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import DeqzooError

__version__ = "0.1.0"

_LAZY = {"ModelInfo": "factory", "create_model": "factory", "from_pretrained": "factory",
         "list_models": "factory"}
_SUBMODULES = {"cli", "core", "export", "factory", "hub", "integrations", "modeling_utils", "models",
               "pipelines", "predict"}

if TYPE_CHECKING:  # static tools see the real names
    from .factory import ModelInfo, create_model, from_pretrained, list_models


def register() -> list[str]:
    """Register every available family with the transformers Auto classes, and MDEQ with timm's registry
    when timm is installed; returns the registered model types. deqzoo's own functions do not need it.

    Example:
        >>> import deqzoo
        >>> "mdeq" in deqzoo.register()
        True
    """
    import importlib.util

    from .integrations.transformers import register_all

    families = register_all()
    if importlib.util.find_spec("timm") is not None:
        for family in families.values():
            if family.timm_module:
                importlib.import_module(family.timm_module)
    return sorted(families)


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


__all__ = ["DeqzooError", "ModelInfo", "__version__", "create_model", "from_pretrained", "list_models",
           "register"]
