"""Every fenced python block of every model card runs offline, as a new user would paste it.

Each card's blocks run in one fresh interpreter (network off: HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), each
block in its own namespace, from a scratch working directory. The interpreters are forked children of one
that imported torch first (tests/_fresh_runner.py): one start-up for all cards instead of one per card.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CARDS = sorted((ROOT / "model_cards").glob("*/README.md"))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(card: Path) -> list[str]:
    """The fenced ```python blocks of a card, in order."""
    return [m.group(1) for m in FENCE.finditer(card.read_text(encoding="utf-8"))]


def test_extractor_finds_blocks():
    text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert [m.group(1) for m in FENCE.finditer(text)] == ["x = 1\n", "y = 2\n"]
    assert len(CARDS) >= 4, "model cards not found"


@pytest.fixture(scope="module")
def card_runs(run_fresh, tmp_path_factory):
    """Every card's blocks, each card in a fresh interpreter (a forked child of one that has imported torch
    and no deqzoo/transformers/timm/diffusers module: tests/_fresh_runner.py) and its own scratch folder."""
    base = tmp_path_factory.mktemp("card-snippets")
    jobs = [{"name": card.parent.name, "blocks": python_blocks(card), "cwd": str(base / card.parent.name),
             "timeout": 600} for card in CARDS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return run_fresh(jobs, env, base / "runner", timeout=600 * len(jobs))


@pytest.mark.parametrize("card", CARDS, ids=[c.parent.name for c in CARDS])
def test_card_python_blocks_run_offline(card, card_runs):
    blocks = python_blocks(card)
    assert blocks, f"{card} has no python usage snippet"
    proc = card_runs[card.parent.name]
    assert proc["returncode"] == 0, proc["stderr"][-4000:]
    assert f"ran {len(blocks)} blocks" in proc["stdout"]


def test_readme_quickstart_runs_and_warns_once(tmp_path, monkeypatch):
    import warnings

    from deqzoo.modeling_utils import DEQNonConvergenceWarning

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[text.index("## Quickstart"):]
    block = FENCE.search(quick).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        exec(compile(block, "<README Quickstart>", "exec"), namespace)
    ours = [w for w in got if issubclass(w.category, DEQNonConvergenceWarning)]
    assert len(ours) == 1 and "f_max_iter=3" in str(ours[0].message)
    assert namespace["model"].config.on_nonconvergence == "raise"
    assert (tmp_path / "my-mdeq" / "config.json").is_file()


def test_readme_and_docs_catalogs_are_current_and_complete():
    """Both tables come from one catalog (utils/catalog.py); each lists every checkpoint and hypersolver."""
    from deqzoo.hub.catalog import load_catalog
    from utils.catalog import main as catalog_main

    assert catalog_main(["--check"]) == 0, "run `python -m utils.catalog`"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    docs = (ROOT / "docs" / "hub.md").read_text(encoding="utf-8")
    assert len(readme) <= 8000, len(readme)
    ids = list(load_catalog()) + [f"deqzoo/{p.name}" for p in (ROOT / "model_cards").glob("hyperdeq-*")]
    assert any("hyperdeq" in i for i in ids)
    for cid in ids:
        assert f"[`{cid}`]" in readme and f"[`{cid}`]" in docs, cid
