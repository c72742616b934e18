"""The docs build executes every block of every page: `docs/_hooks.py` (mkdocs.yml `hooks:`) refuses a Python
block that is not executed and a shell block that is neither executed nor says why; this runs the same check
on the pages without building the site (the build itself runs in CI: `mkdocs build --strict`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("deqzoo_docs_hooks", ROOT / "docs" / "_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_loads_the_hooks():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert "docs/_hooks.py" in config["hooks"] and "_hooks.py" in config["exclude_docs"]


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT / "docs").as_posix()
                                        for p in (ROOT / "docs").rglob("*.md")))
def test_every_block_of_the_page_is_executed_or_says_why_not(page):
    assert _hooks().undeclared((ROOT / "docs" / page).read_text(encoding="utf-8"), page) == []


@pytest.mark.parametrize("block,problems", [
    ("```python\nprint(1)\n```\n", 1),                                    # not executed
    ('```python exec="on"\nprint(1)\n```\n', 0),
    ("<!-- not executed: installs -->\n```python\nprint(1)\n```\n", 1),   # Python: no excuse
    ("```bash\ndeqzoo demo\n```\n", 1),
    ("<!-- not executed: runs for minutes -->\n\n```bash\ndeqzoo demo\n```\n", 0),
    ('```bash exec="on"\ndeqzoo list\n```\n', 0),
    ("```\ndeqzoo/\n  core/\n```\n", 0),                                  # text, not code
    ("````markdown\n```python\nx\n```\n````\n", 0),                       # a fence inside a longer one
])
def test_the_check_itself(block, problems):
    assert len(_hooks().undeclared(block, "p.md")) == problems
