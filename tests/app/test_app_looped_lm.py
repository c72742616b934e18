"""The looped-LM tab's computation (`deqzoo_app.looped_lm`) without a browser, on a tiny randomly initialised
HRM-Text (conftest's ``looped_lm_checkpoint``): the compute slider sets each token's f-call budget, the
per-token colours carry the f calls `LoopedLM` reports, and bad input is refused with a clear message."""

from __future__ import annotations

import doctest
import json
import re

import pytest
import torch


@pytest.fixture
def tab(looped_lm_checkpoint, monkeypatch):
    from deqzoo_app import looped_lm

    monkeypatch.setenv(looped_lm.ENV, str(looped_lm_checkpoint))
    return looped_lm


TOL = 0.03  # on conftest's tiny model: halting runs to the budget unconverged, Anderson stops at 6 or 7


def _tokens(page: str) -> list[tuple[int, int, bool]]:
    found = re.findall(r'data-id="(\d+)" data-nfe="(\d+)" data-converged="(\w+)"', page)
    return [(int(i), int(n), c == "true") for i, n, c in found]


def test_own_loop_spends_the_slider_budget_on_every_token(tab):
    page, summary = tab.generate_looped("The for statement", 6, "own loop", 2.0, 0.03, 0)
    tokens = _tokens(page)
    assert len(tokens) == 6 and {n for _, n, _ in tokens} == {8}  # 2.0 x H_cycles = 4
    assert "budget 8 f calls per token (2x the model's own loop of 4)" in summary
    assert "mean **8.00 f calls per token**" in summary


@pytest.mark.parametrize("mode,solver", [("per-token halting", "fixed_point"),
                                         ("Anderson fixed point", "anderson")])  # fmt: skip
def test_per_token_calls_are_the_adapters(tab, mode, solver):
    """The colours' f calls are those `LoopedLM` reports when it decodes the same tokens with the same
    settings: the tab's token ids are read from its HTML and decoded again, teacher-forced."""
    from transformers import AutoTokenizer, DynamicCache, HrmTextForCausalLM

    from deqzoo.integrations.looped_lm import LoopedLM

    page, summary = tab.generate_looped("The while statement", 8, mode, 1.5, TOL, 3)
    tokens = _tokens(page)
    # budget round(1.5 x 4) = 6; Anderson answers at its best iterate: one more call when that is not the last
    assert len(tokens) == 8 and all(1 <= n <= 7 for _, n, _ in tokens)
    mean = sum(n for _, n, _ in tokens) / len(tokens)
    assert f"mean **{mean:.2f} f calls per token**" in summary
    folder = tab.model_dir()
    model = HrmTextForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    kw = {"solver_kwargs": {"m": 5}} if solver == "anderson" else {"answer": "last"}
    ref = LoopedLM.from_model(model, solver=solver, max_iter=6, tol=TOL, **kw)
    prompt = tok("The while statement", return_tensors="pt")["input_ids"]
    ids = torch.tensor([[i for i, _, _ in tokens]])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = ref(prompt, past_key_values=cache, use_cache=True)
        expected = []
        for i in range(ids.shape[1]):
            out = ref(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            expected.append((int(ids[0, i]), int(out.nfe[0, 0]), bool(out.converged[0, 0])))
    assert tokens == expected


def test_bad_input_is_named(tab, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="mode must be one of"):
        tab.generate_looped("x", 2, "fastest", 1.0, 0.03, 0)
    with pytest.raises(ValueError, match="the prompt is empty"):
        tab.generate_looped("   ", 2, "own loop", 1.0, 0.03, 0)
    with pytest.raises(ValueError, match="compute must be a number"):
        tab.generate_looped("x", 2, "own loop", "lots", 0.03, 0)
    assert tab.budget(1e9, 4) == 16 and tab.budget(-3, 4) == 1  # clamped to the slider's range
    other = tmp_path / "not-hrm"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv(tab.ENV, str(other))
    with pytest.raises(ValueError, match=r"config.json: model_type is 'llama'; the tab runs 'hrm_text'"):
        tab.generate_looped("x", 2, "own loop", 1.0, 0.03, 0)
    monkeypatch.setenv(tab.ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        tab.generate_looped("x", 2, "own loop", 1.0, 0.03, 0)


def test_without_a_checkpoint_the_tab_says_where_one_goes(monkeypatch, tmp_path):
    from deqzoo_app import looped_lm

    monkeypatch.delenv(looped_lm.ENV, raising=False)
    monkeypatch.setattr(looped_lm, "CARD_DIRS", (tmp_path / "a", tmp_path / "b"))
    assert looped_lm.model_dir() is None
    with pytest.raises(ValueError, match=r"no looped LM in this clone: no model in .*a or .*b \(train one"):
        looped_lm.generate_looped("x", 2)
    looped_lm.warm_up()  # nothing to warm up: no error either


@pytest.mark.parametrize("name", ["deqzoo_app.looped_lm", "deqzoo.integrations.looped_lm"])
def test_docstring_examples(name):
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
