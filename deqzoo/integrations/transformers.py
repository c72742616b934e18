"""Register deqzoo families with the transformers Auto classes so stock loading code works on them.

`import deqzoo` arranges for :func:`register_all` to run when transformers' Auto machinery is first
imported (``deqzoo._imports``); deqzoo's own loading calls it too. A family whose package is not there (yet)
is skipped and reported by :func:`unavailable_families`; a family that is present but fails to import emits
a warning naming the error.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import transformers

from ..models.registry import FAMILIES, Family

_REGISTERED: dict[str, Family] = {}
_BUSY = False
_UNAVAILABLE: dict[str, str] = {}


def _module_missing(err: ModuleNotFoundError, family: Family) -> bool:
    """True when the family's own package is absent (not when one of its imports is broken)."""
    package = family.config.partition(":")[0].rpartition(".")[0]  # deqzoo.models.<family>
    name = err.name or ""
    return name == package or name.startswith(package + ".") or package.startswith(name + ".")


def _backend_of(processor_cls: type) -> str:
    """transformers v5 keys image processors by backend ("torchvision" or "pil")."""
    try:
        from transformers.image_processing_backends import TorchvisionBackend
    except ImportError:  # older transformers: a single slow class
        return "pil"
    return "torchvision" if issubclass(processor_cls, TorchvisionBackend) else "pil"


def register_family(family: Family) -> None:
    """Register one family's config, model classes, image processor and tokenizer with the Auto classes.

    Example:
        >>> from deqzoo.integrations.transformers import registered_families
        >>> sorted(registered_families())  # doctest: +SKIP
        ['deq_transformer', 'ignn', 'mdeq']
    """
    config_cls = family.load(family.config)
    if getattr(config_cls, "model_type", None) != family.model_type:
        raise ValueError(f"{config_cls.__name__}.model_type={config_cls.model_type!r} but the registry says "
                         f"{family.model_type!r}")
    transformers.AutoConfig.register(family.model_type, config_cls, exist_ok=True)
    for auto_name, path in family.models.items():
        auto_cls = getattr(transformers, auto_name)
        auto_cls.register(config_cls, family.load(path), exist_ok=True)
    if family.image_processor:
        processor_cls = family.load(family.image_processor)
        transformers.AutoImageProcessor.register(
            config_cls, image_processor_classes={_backend_of(processor_cls): processor_cls}, exist_ok=True)
    if family.tokenizer:
        transformers.AutoTokenizer.register(config_cls, tokenizer_class=family.load(family.tokenizer),
                                            exist_ok=True)
    if family.timm_module and "timm" in sys.modules:  # else registered when timm is imported (_imports)
        importlib.import_module(family.timm_module)
    _REGISTERED[family.model_type] = family
    _UNAVAILABLE.pop(family.model_type, None)


def register_all() -> dict[str, Family]:
    """Register every importable family of `deqzoo.models.registry.FAMILIES`; returns the registered."""
    global _BUSY
    if _BUSY:  # re-entered through an import that registration itself triggered: the outer call finishes
        return dict(_REGISTERED)
    _BUSY = True
    try:
        _register_missing()
    finally:
        _BUSY = False
    return dict(_REGISTERED)


def _register_missing() -> None:
    for family in FAMILIES:
        if family.model_type in _REGISTERED:
            continue
        try:
            register_family(family)
        except ModuleNotFoundError as err:
            _UNAVAILABLE[family.model_type] = f"not installed ({err.name})"
            if not _module_missing(err, family):
                warnings.warn(f"deqzoo family {family.model_type!r} failed to import: {err}", stacklevel=2)
        except Exception as err:  # noqa: BLE001 - one broken family must not break `import deqzoo`
            _UNAVAILABLE[family.model_type] = f"{type(err).__name__}: {err}"
            warnings.warn(f"deqzoo family {family.model_type!r} failed to register: {err}", stacklevel=2)


def unregister_family(model_type: str) -> None:
    """Forget a family in deqzoo's registry (transformers' Auto mappings keep it; used by tests)."""
    _REGISTERED.pop(model_type, None)


def registered_families() -> dict[str, Family]:
    """{model_type: family} of the registered families (registering them first if not done yet)."""
    register_all()
    return dict(_REGISTERED)


def unavailable_families() -> dict[str, str]:
    """{model_type: reason} for registry families that could not be registered."""
    register_all()
    return dict(_UNAVAILABLE)


def family_for(model_type: str) -> Family:
    """The registered family of a model_type; the error lists the known ones."""
    if model_type not in _REGISTERED:
        register_all()
    if model_type not in _REGISTERED:
        known = sorted(_REGISTERED)
        extra = f" (registry families not available: {_UNAVAILABLE})" if _UNAVAILABLE else ""
        raise ValueError(f"Unknown deqzoo model_type {model_type!r}; known model types: {known}{extra}")
    return _REGISTERED[model_type]
