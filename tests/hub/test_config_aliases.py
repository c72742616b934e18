"""The names ecosystem tools read on a config (issue 57 item 5): ``config.hidden_size`` on every family's
config, ``config.num_channels`` where a family takes images with a channel count; each an alias of the
family's own field (transformers' ``attribute_map``), read, set and passed to ``__init__`` alike."""

from __future__ import annotations

import importlib

import pytest

from deqzoo.models.registry import declared_families

# model_type -> {alias: the family's own field}; an alias naming itself is a field of that name
ALIASES = {
    "mdeq": {"hidden_size": "final_chansize", "num_channels": "in_channels"},
    "deq_flow": {"hidden_size": "hidden_dim"},
    "deq_transformer": {"hidden_size": "d_model"},
    "ignn": {"hidden_size": "hidden_size"},
    "implicit2": {"hidden_size": "hidden_size"},
    "reasoner": {"hidden_size": "hidden_size"},
}


def _config_class(family):
    module, _, name = family.config.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_family_is_covered():
    assert set(ALIASES) == set(declared_families())


@pytest.mark.parametrize("model_type", sorted(ALIASES))
def test_aliases_read_set_and_init(model_type):
    cls = _config_class(declared_families()[model_type])
    config = cls()
    for alias, field in ALIASES[model_type].items():
        value = getattr(config, field)
        assert isinstance(value, int) and value > 0 and getattr(config, alias) == value, (alias, field)
        setattr(config, alias, value + 1)
        assert getattr(config, field) == value + 1
        if model_type == "deq_transformer":  # d_model must equal n_head * d_head: change them together
            built = cls(**{alias: 64, "n_head": 2, "d_head": 32})
        else:
            built = cls(**{alias: 1 if alias == "num_channels" else 16})
        assert getattr(built, field) == getattr(built, alias) == (1 if alias == "num_channels" else 64
                                                                 if model_type == "deq_transformer" else 16)
        assert alias == field or alias not in built.to_dict()  # saved under the family's own name


def test_a_loaded_checkpoint_answers_the_ecosystem_names():
    import deqzoo

    config = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").config
    assert (config.num_channels, config.hidden_size) == (1, config.final_chansize)
