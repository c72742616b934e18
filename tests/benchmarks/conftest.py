"""The benchmark tests run the repository's benchmark programs at toy scale (minutes on 2 cores): they sit
behind the `extended` marker, a CI step of their own (`pytest -m extended`), to keep the default run short."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/benchmarks/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.extended)
