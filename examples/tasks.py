"""Task modules: data, `evaluate`, `demo` and `predict` for each kind of checkpoint.

A model card's `deqzoo_task` metadata selects one of the tasks registered here by name; it never names code to
import. A new task costs its module and one entry in `TASKS`.

Example:
    >>> from deqzoo.tasks import TASKS, task_module
    >>> "mnist" in TASKS
    True
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._demo import residual_figure  # public: `deqzoo demo`'s residual plot, which the app draws too
from ._files import open_image  # public: an image file checked before decoding (`predict`, the app)

__all__ = ["TASKS", "open_image", "register_task", "residual_figure", "task_module", "task_name"]

# name -> module; the only modules a checkpoint's card can select
TASKS: dict[str, str] = {
    "mnist": "deqzoo.tasks.mnist",
    "pydoc_lm": "deqzoo.tasks.pydoc_lm",
    "pystd_lm": "deqzoo.tasks.pystd_lm",
    "chains": "deqzoo.tasks.chains",
    "ddim_digits": "deqzoo.tasks.ddim_digits",
    "implicit2": "deqzoo.tasks.implicit2",
    "flow": "deqzoo.tasks.flow",
}


def register_task(name: str, module: str) -> None:
    """Register a task module by name (for code that ships its own task, e.g. a plugin or a test)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"task name must be a non-empty string, got {name!r}")
    TASKS[name] = module


def task_name(value: object) -> str:
    """The registered task a card's `deqzoo_task` value selects (short name or the module's full name)."""
    if isinstance(value, str):
        if value in TASKS:
            return value
        for name, module in TASKS.items():  # cards written before the registry named the module
            if module == value:
                return name
    raise ValueError(f"deqzoo_task {value!r} is not a registered task; registered tasks: {sorted(TASKS)}")


def task_module(value: object) -> ModuleType:
    """Import the module of the registered task a card's `deqzoo_task` value selects."""
    return importlib.import_module(TASKS[task_name(value)])
