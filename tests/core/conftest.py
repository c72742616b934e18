"""The engine's tests exercise the fused kernels: compile (or load) them before the first test, so no test
silently runs the torch path while they compile in the background."""

import pytest

from deqzoo.core import _kernels

_kernels.warm_up(block=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "generic_cpu: reruns the hard-system tests with the kernels compiled for a generic x86-64 (a fresh "
        "compile, ~30 s CPU); skipped unless selected with `pytest -m generic_cpu`",
    )


def pytest_collection_modifyitems(config, items):
    """`generic_cpu` tests run only when the marker expression names them (a CI step of their own)."""
    if "generic_cpu" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a CI step of its own: pytest -m generic_cpu tests/core")
    for item in items:
        if "generic_cpu" in item.keywords:
            item.add_marker(skip)
