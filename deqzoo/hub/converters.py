"""Access to the repository's `conversion/` folder: original research releases -> deqzoo checkpoints.

`conversion/` ships with the source tree, not inside the installed package (converters read pickles, so they
stay out of every import path a user's loading code takes). It is imported here as the package
``deqzoo_conversion``, so its modules can share code through relative imports.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from .catalog import REPO_ROOT

PACKAGE = "deqzoo_conversion"


def conversion_package(root: str | Path | None = None) -> ModuleType:
    """Import `<root>/conversion` as the package ``deqzoo_conversion`` (once per process).

    Example:
        >>> from deqzoo.hub.converters import conversion_package
        >>> conversion_package().__name__
        'deqzoo_conversion'
    """
    folder = (Path(root or REPO_ROOT) / "conversion").resolve()
    name = _package_name(folder)
    if name in sys.modules:
        return sys.modules[name]
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no conversion/ folder here; converters ship with the source "
                                "tree (clone the repository and install it with `pip install -e .`)")
    init = folder / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    else:  # a folder of loose converter modules works too
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)
    return module


def _package_name(folder: Path) -> str:
    """The repository's own folder is ``deqzoo_conversion``; another root (``--root``) gets its own name."""
    if folder == (REPO_ROOT / "conversion").resolve():
        return PACKAGE
    return f"{PACKAGE}_{hashlib.sha1(str(folder).encode()).hexdigest()[:10]}"


def converter_module(name: str, root: str | Path | None = None) -> ModuleType:
    """One converter module, e.g. ``converter_module("mdeq_locuslab")``."""
    package = conversion_package(root)
    return importlib.import_module(f"{package.__name__}.{name}")


def conversion_formats(root: str | Path | None = None) -> dict[str, Callable]:
    """Every format name a converter module declares in its `FORMATS` dict -> its convert function."""
    package = conversion_package(root)
    formats: dict[str, Callable] = {}
    for path in sorted(Path(package.__path__[0]).glob("*.py")):
        if not path.name.startswith("_"):
            formats.update(getattr(converter_module(path.stem, root), "FORMATS", {}))
    return formats
