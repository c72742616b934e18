"""transformers' common model tests (ModelTesterMixin, ConfigTester) run against every zoo family.

They are marked ``common`` and run by ``pytest -m common`` (a CI step of their own): collecting them needs the
transformers sdist (downloaded once into a cache folder, see ``_sdist.py``), so outside a run that selects the
marker the modules of this folder are not even imported.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# markers transformers' test module uses (its own conftest registers them; this run has not loaded that)
SDIST_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test")


def _selects_common(markexpr: str) -> bool:
    """Whether a -m expression names the marker other than negated ("common", "common or extended")."""
    return re.search(r"(?<!not )\bcommon\b", markexpr) is not None


def pytest_configure(config):
    for marker in SDIST_MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' common tests")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if collection_path.parent == HERE and collection_path.name.startswith("test_"):
        if not _selects_common(config.getoption("markexpr") or ""):
            return True
    return None


@pytest.fixture(scope="session", autouse=True)
def _zoo_in_transformers_name_tables():
    from ._harness import listed_in_name_tables

    with listed_in_name_tables():
        yield
