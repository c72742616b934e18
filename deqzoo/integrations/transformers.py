"""Register deqzoo families with the transformers Auto classes, one family at a time. deqzoo's own entry
points need none (they build the class a declaration names); stock code (``AutoModel.from_pretrained(path)``,
``pipeline(...)``) needs ``deqzoo.register()`` first. A family whose extra is missing is reported by
:func:`deqzoo.models.registry.unavailable_families` with the ``pip install "deqzoo[...]"`` that enables it.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import transformers

from ..models.registry import (
    Family,
    MissingExtraError,
    declare_family,
    declared_families,
    declared_family,
    forget_family,
    require,
)

_REGISTERED: dict[str, Family] = {}


def _backend_of(processor_cls: type) -> str:
    """transformers v5 keys image processors by backend ("torchvision" or "pil")."""
    from transformers.image_processing_backends import TorchvisionBackend

    return "torchvision" if issubclass(processor_cls, TorchvisionBackend) else "pil"


def register_family(family: Family) -> None:
    """Declare (if new) and register one family's config, model classes, image processor and tokenizer with
    the Auto classes (and its timm entries when timm is already imported).

    Example:
        >>> from deqzoo.models.registry import family_for
        >>> register_family(family_for("ignn"))
        >>> import transformers
        >>> transformers.AutoConfig.for_model("ignn").model_type
        'ignn'
    """
    if declared_family(family.model_type) is not family:  # reads only that model type's package
        declare_family(family)
    require(family.extra, family.requires, f"the {family.model_type} family")
    config_cls = family.load(family.config)
    # transformers refuses a config class whose model_type differs from the declaration's, naming both
    transformers.AutoConfig.register(family.model_type, config_cls, exist_ok=True)
    for auto_name, path in family.models.items():
        getattr(transformers, auto_name).register(config_cls, family.load(path), exist_ok=True)
    if family.image_processor:
        processor_cls = family.load(family.image_processor)
        transformers.AutoImageProcessor.register(
            config_cls, image_processor_classes={_backend_of(processor_cls): processor_cls}, exist_ok=True)
    if family.tokenizer:
        transformers.AutoTokenizer.register(config_cls, tokenizer_class=family.load(family.tokenizer),
                                            exist_ok=True)
    if family.timm_module and "timm" in sys.modules:  # else by deqzoo.register() or importing the adapter
        importlib.import_module(family.timm_module)
    _REGISTERED[family.model_type] = family


def _try_register(family: Family) -> None:
    try:
        register_family(family)
    except MissingExtraError:
        pass  # listed by deqzoo.models.registry.unavailable_families with the extra to install
    except Exception as err:  # noqa: BLE001 - one broken family must not break the others
        warnings.warn(f"deqzoo family {family.model_type!r} failed to register: {err}", stacklevel=3)


def register_all() -> dict[str, Family]:
    """Register every declared family whose dependencies are installed; returns the registered."""
    for model_type, family in declared_families().items():
        if model_type not in _REGISTERED:
            _try_register(family)
    return dict(_REGISTERED)


def unregister_family(model_type: str) -> None:
    """Forget a family in deqzoo's registry (transformers' Auto mappings keep it; used by tests)."""
    _REGISTERED.pop(model_type, None)
    forget_family(model_type)
