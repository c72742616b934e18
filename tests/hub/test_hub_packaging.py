"""The README's first commands are what CI runs; the constraints pin the stack the suite runs on; the embedded
checkpoints stay small and match the catalog."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from deqzoo.hub.catalog import load_catalog
from utils.catalog import CARDS_DIR, REPO_ROOT, build_catalog

README = REPO_ROOT / "README.md"


def _readme_commands() -> list[str]:
    head = README.read_text().split("\n---\n", 1)[0]
    return [line.strip() for line in head.splitlines() if line.startswith("    python3 -m venv")]


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    commands = _readme_commands()
    assert len(commands) == 2
    setup_demo, setup_tests = commands
    assert setup_demo.endswith("deqzoo demo") and "-c constraints.txt" in setup_demo
    assert ".venv/bin/pytest" in setup_tests and "ruff check" in setup_tests
    assert "deqzoo bench solvers --quick" in setup_tests  # toy-scale proof the benchmark command works
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert setup_tests in ci.splitlines()
    assert "set -euo pipefail" in ci


def test_constraints_pin_the_installed_stack():
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", (REPO_ROOT / "constraints.txt").read_text(), re.M))
    norm = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    stack = ("torch", "torchvision", "transformers", "timm", "safetensors", "huggingface-hub", "tokenizers")
    for dist in stack:
        assert dist in norm, dist
        assert metadata.version(dist) == norm[dist], dist
    assert norm["torch"] == "2.14.1" and norm["torchvision"] == "0.29.1"


def test_pyproject_declares_extras_and_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert project["scripts"]["deqzoo"] == "deqzoo.cli:main"
    assert {"dev", "bench", "graph", "app"} <= set(project["optional-dependencies"])
    # the library only: the app (deqzoo_app/, beside app.py) is a program of the repository, as benchmarks/ is
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["deqzoo", "deqzoo.*"]


@pytest.mark.skipif(not CARDS_DIR.is_dir(), reason="no model_cards/ folder in this checkout")
def test_catalog_matches_model_cards_and_sizes():
    fresh = build_catalog()["checkpoints"]
    assert load_catalog() == fresh, "deqzoo/hub/catalog.json is stale: run `python -m utils.catalog`"
    total = sum(entry["size_bytes"] for entry in fresh.values())
    assert total < 50e6, f"embedded checkpoints total {total / 1e6:.1f} MB (budget 50 MB)"
    for entry in fresh.values():
        assert entry["size_bytes"] < 10e6, entry["id"]
        assert (Path(REPO_ROOT / entry["location"]) / "README.md").is_file()
