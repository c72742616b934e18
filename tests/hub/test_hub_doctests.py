"""The runnable examples in the hub's public docstrings run."""

import doctest
import importlib

import pytest

MODULES = ["deqzoo", "deqzoo.factory", "deqzoo.modeling_utils", "deqzoo.hub.cards", "deqzoo.hub.loading",
           "deqzoo.hub.safetensors_io", "deqzoo.hub.catalog", "deqzoo.integrations.transformers",
           "deqzoo.hub.saving", "deqzoo.hub.validation", "examples.tasks", "deqzoo.hub.push",
           "deqzoo.export", "deqzoo.models.registry", "deqzoo.predict", "deqzoo.core.hyper",
           "deqzoo.core.deq", "deqzoo.core.stats", "utils.cards", "conversion",
           "deqzoo.models.deq_flow.modeling_deq_flow", "deqzoo.integrations.timm"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
