"""The engine's tests exercise the fused kernels: compile (or load) them before the first test, so no test
silently runs the torch path while they compile in the background."""

import pytest

from deqzoo.core import _kernels

_kernels.warm_up(block=True)


OPT_IN = {
    "generic_cpu": "reruns the hard-system tests with the kernels compiled for a generic x86-64 "
    "(a fresh compile, ~30 s CPU)",
    "fresh_compile": "starts kernel-compile child processes (a fresh compile, ~30 s CPU; minutes of wall "
    "time at the children's low priority on a busy machine)",
}


def pytest_configure(config):
    for name, what in OPT_IN.items():
        config.addinivalue_line("markers", f"{name}: {what}; skipped unless selected with `pytest -m {name}`")


def pytest_collection_modifyitems(config, items):
    """Opt-in tests run only when the marker expression names them (a CI step of their own:
    ``pytest -m "generic_cpu or fresh_compile" tests/core``)."""
    expr = config.getoption("markexpr") or ""
    for name in OPT_IN:
        if name in expr:
            continue
        skip = pytest.mark.skip(reason=f"a CI step of its own: pytest -m {name} tests/core")
        for item in items:
            if name in item.keywords:
                item.add_marker(skip)
