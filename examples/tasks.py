"""The evaluation and demo programs of each task, by the name a model card's `deqzoo_task` gives.

`deqzoo eval` and `deqzoo demo` run these from a clone (they read data sets and draw figures: repository
programs, not part of the installed package); `deqzoo predict` is the package's (:mod:`deqzoo.predict`). A
task module has `evaluate(model, *, limit=None, progress=True) -> dict` and `demo(model[, output_dir]) ->
(summary, SolverStats)`. A card's value selects one of the modules registered here; it never names code to
import. A new task costs its module and one entry in `TASKS`.

Example:
    >>> from examples.tasks import TASKS, task_module
    >>> task_module("mnist").__name__
    'examples.mdeq.mnist'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["TASKS", "register_task", "task_module"]

# name -> module; the only modules a checkpoint's card can select
TASKS: dict[str, str] = {
    "mnist": "examples.mdeq.mnist",
    "pydoc_lm": "examples.deq_transformer.pydoc_lm",
    "pystd_lm": "examples.deq_transformer.pystd_lm",
    "chains": "examples.ignn.chains",
    "ddim_digits": "examples.deq_ddim.ddim_digits",
    "implicit2": "examples.implicit2.images",
    "flow": "examples.deq_flow.flow",
    "sudoku6": "examples.reasoner.sudoku",
    "sudoku9": "examples.reasoner.sudoku9",
}


def register_task(name: str, module: str) -> None:
    """Register a task module by name (for code that ships its own task, e.g. a plugin or a test)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"task name must be a non-empty string, got {name!r}")
    TASKS[name] = module


def task_module(name: object) -> ModuleType:
    """Import the module of the registered task a card's `deqzoo_task` value names."""
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"deqzoo_task {name!r} is not a registered task; registered tasks: {sorted(TASKS)}")
    return importlib.import_module(TASKS[name])
