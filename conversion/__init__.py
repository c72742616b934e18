"""Converters from original DEQ releases to deqzoo checkpoints: one module per upstream format, each declaring
a ``FORMATS`` dict (format name -> convert function).

A program of the repository, not of the installed package: ``deqzoo convert FORMAT SRC OUT`` runs it from a
clone. Other packages add formats through the ``deqzoo.converters`` entry-point group (name = format, value =
its convert function) or :func:`register_converter`. Converters read the originals' pickles
(``torch.load(weights_only=True)``), so nothing on a loading path imports them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from importlib.metadata import entry_points
from types import ModuleType

ENTRY_POINT_GROUP = "deqzoo.converters"
_REGISTERED: dict[str, Callable] = {}


def converter_module(name: str) -> ModuleType:
    """One converter module, e.g. ``converter_module("mdeq_locuslab")``.

    Example:
        >>> converter_module("mdeq_locuslab").__name__
        'conversion.mdeq_locuslab'
    """
    return importlib.import_module(f"{__name__}.{name}")


def register_converter(format_name: str, convert: Callable) -> None:
    """Add a format to `deqzoo convert` (for code that ships its own converter; entry points do it too)."""
    if not format_name or not callable(convert):
        raise ValueError(f"register_converter needs a format name and a callable, got {format_name!r}, "
                         f"{convert!r}")
    _REGISTERED[format_name] = convert


def conversion_formats() -> dict[str, Callable]:
    """Every format name -> its convert function: this package's modules, then entry points, then
    :func:`register_converter`."""
    formats: dict[str, Callable] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            formats.update(getattr(converter_module(info.name), "FORMATS", {}))
    for point in entry_points(group=ENTRY_POINT_GROUP):
        formats[point.name] = point.load()
    formats.update(_REGISTERED)
    return formats
