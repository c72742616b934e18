"""Post-import hooks: deqzoo registers with a library when that library is imported, not before.

``import deqzoo`` must stay cheap (no torch, transformers or timm), yet stock code such as
``import deqzoo, transformers; transformers.AutoModel.from_pretrained(path)`` must find deqzoo's families. So
``import deqzoo`` installs a finder on ``sys.meta_path`` that runs a callback right after a watched module
finishes executing (or at once when it is already imported):

* transformers' Auto modules (configuration, modeling, image processing, tokenization; every Auto class and
  ``pipeline`` go through them): register every family with the Auto classes, once none of those modules is
  half-imported (``modeling_auto`` imports ``configuration_auto`` midway: registering then would meet a
  partial module, so the outermost one's hook does it);
* ``timm`` (what ``timm.create_model`` needs): add the MDEQ entries to timm's registry.

The hook wraps the loader that Python's own finders return; it changes nothing in those libraries. A
failing callback warns and never breaks the user's import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from functools import partial

_HOOKS: dict[str, list[Callable[[], None]]] = {}


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run(self._name)
        if _PENDING and self._name.startswith(_RETRY_PREFIXES):  # a deferred registration may proceed now
            _register_transformers(self._name)

    def __getattr__(self, attr):  # get_resource_reader, is_package, ... of the wrapped loader
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        # deqzoo's and transformers' submodules are always wrapped: the one that finishes last retries a
        # deferred registration (its import began before the deferral, so it cannot be wrapped later)
        if name not in _HOOKS and not name.startswith(_RETRY_PREFIXES):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, name)
        return spec


_FINDER = _PostImportFinder()


def _run(name: str) -> None:
    """Run (and forget) the callbacks waiting on `name`."""
    for callback in _HOOKS.pop(name, []):
        try:
            callback()
        except Exception as err:  # noqa: BLE001 - the user's import of `name` must succeed regardless
            warnings.warn(f"deqzoo: registering with {name} failed ({type(err).__name__}: {err})",
                          stacklevel=2)


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Run `callback` once `name` is imported: now if it already is, else right after its import.

    Example:
        >>> calls = []
        >>> when_imported("json", lambda: calls.append("json"))  # already imported: runs at once
        >>> calls
        ['json']
    """
    if name in sys.modules:
        _HOOKS.setdefault(name, []).append(callback)
        _run(name)
        return
    _HOOKS.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


_TRANSFORMERS_AUTO = tuple(f"transformers.models.auto.{m}" for m in (
    "configuration_auto", "auto_factory", "modeling_auto", "image_processing_auto", "tokenization_auto"))


_RETRY_PREFIXES = ("deqzoo.", "transformers.")  # submodules whose completion retries a deferred registration
_PENDING = False  # a registration was deferred: the next deqzoo submodule to finish importing retries it


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _blocked(current: str | None) -> bool:
    """Whether a module registration may need is half-imported (other than `current`, whose hook is running
    and which is still flagged as initializing): any submodule of transformers or deqzoo. E.g.
    ``from transformers import PreTrainedModel`` runs modeling_utils, which imports configuration_auto midway:
    registering when that completes would meet a half-defined PreTrainedModel."""
    return any(name != current and name.startswith(_RETRY_PREFIXES) and _initializing(module)
               for name, module in list(sys.modules.items()))


def _register_transformers(name: str | None = None) -> None:
    global _PENDING
    if _blocked(name):  # the half-imported module completes later; the hook of it (or of a deqzoo
        _PENDING = True  # submodule finishing after it) registers then
        return
    _PENDING = False
    from .integrations.transformers import register_all

    register_all()


def _register_timm() -> None:
    importlib.import_module("deqzoo.integrations.timm")


def install() -> None:
    """Register deqzoo with transformers and timm when (or if) the user imports them."""
    for name in _TRANSFORMERS_AUTO:
        when_imported(name, partial(_register_transformers, name))
    when_imported("timm", _register_timm)

