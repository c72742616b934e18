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


def main(argv: list[str] | None = None) -> int:
    """``deqzoo convert FORMAT SRC OUT [--option KEY=VALUE ...]`` (``deqzoo convert list``: the formats)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="deqzoo convert", description="Convert an original release to a "
                                     "deqzoo checkpoint folder (the source is never modified).")
    parser.add_argument("format", nargs="?", help="a format name, or `list`")
    parser.add_argument("src", nargs="?")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--option", action="append", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    formats = conversion_formats()
    if args.format is None or args.format == "list":
        print("\n".join(sorted(formats)) or "no converters in this install")
        return 0
    if args.format not in formats:
        raise ValueError(f"unknown format {args.format!r}; known formats: {sorted(formats)}")
    if not args.src or not args.out:
        raise ValueError("usage: deqzoo convert FORMAT SRC OUT [--option key=value ...]")
    options = {}
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option {item!r}: expected key=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    src, out = Path(args.src).resolve(), Path(args.out).resolve()
    if out == src or out in src.parents:
        raise ValueError(f"output {args.out} contains the source {args.src}; choose an output folder "
                         "outside it (the source is never modified)")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {args.out} exists and is a file; a checkpoint is a folder")
    print(f"wrote {formats[args.format](args.src, args.out, **options)}")
    return 0
