"""transformers' from_pretrained behaviours a user relies on (issue 37), checked against what transformers
itself does with the same calls: loading info, missing keys reported, re-heading, base-model bridging,
config + state_dict without a folder, subfolder, meta device."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import deqzoo
from deqzoo.hub.safetensors_io import CheckpointError


def test_output_loading_info_returns_the_model_and_its_report(toy_checkpoint):
    directory, model = toy_checkpoint
    loaded, info = type(model).from_pretrained(directory, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {"missing_keys": [], "unexpected_keys": [],
                                                     "mismatched_keys": [], "error_msgs": []}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_missing_and_unexpected_keys_refuse_unless_strict_false_which_reports_them(toy_checkpoint):
    directory, model = toy_checkpoint
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del state["head.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, directory / "model.safetensors")
    for load in (type(model).from_pretrained, deqzoo.from_pretrained):
        with pytest.raises(CheckpointError, match=r"missing keys \(1\): head.bias") as err:
            load(directory, output_loading_info=True)
        assert "unexpected keys (1): extra.weight" in str(err.value) and "strict=False" in str(err.value)
    loaded, info = type(model).from_pretrained(directory, output_loading_info=True, strict=False)
    assert set(info["missing_keys"]) == {"head.bias"} and set(info["unexpected_keys"]) == {"extra.weight"}
    assert torch.equal(loaded.head.weight, model.head.weight)  # what the file holds is loaded


def test_mis_shaped_keys_raise_naming_the_keyword_and_ignore_mismatched_sizes_reheads(toy_checkpoint):
    directory, model = toy_checkpoint
    with pytest.raises(CheckpointError, match="ignore_mismatched_sizes=True") as err:
        type(model).from_pretrained(directory, num_labels=5)
    assert "mis-shaped key head.weight: checkpoint [3, 16] vs model [5, 16]" in str(err.value)
    loaded, info = type(model).from_pretrained(directory, num_labels=5,
                                               ignore_mismatched_sizes=True, output_loading_info=True)
    assert loaded.config.num_labels == 5 and loaded.head.weight.shape == (5, 16)
    assert sorted(k for k, _, _ in info["mismatched_keys"]) == ["head.bias", "head.weight", "label_bias"]
    assert torch.equal(loaded.mix.weight, model.mix.weight)  # the body still comes from the checkpoint
    assert loaded(torch.rand(2, 3, 8, 8)).logits.shape == (2, 5)


def test_from_none_with_config_and_state_dict(toy_checkpoint):
    _, model = toy_checkpoint
    loaded = type(model).from_pretrained(None, config=model.config, state_dict=model.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="config= and state_dict="):
        type(model).from_pretrained(None, config=model.config)


def test_from_pretrained_under_the_meta_device_raises(toy_checkpoint):
    directory, model = toy_checkpoint
    # transformers' own check (its wording), reached after deqzoo's checks, which allocate nothing
    with torch.device("meta"), pytest.raises(RuntimeError, match="with a meta device context manager"):
        type(model).from_pretrained(directory)


def test_subfolder_is_honoured_and_confined(toy_checkpoint, tmp_path):
    directory, model = toy_checkpoint
    parent = tmp_path / "repo"
    parent.mkdir()
    directory.rename(parent / "classifier")
    loaded = type(model).from_pretrained(parent, subfolder="classifier")
    assert torch.equal(loaded.head.weight, model.head.weight)
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        type(model).from_pretrained(parent, subfolder="../outside")


def test_base_model_checkpoint_loads_into_a_task_head_and_back(tmp_path):
    from deqzoo.models.mdeq.modeling_mdeq import MDEQForImageClassification, MDEQModel

    head = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    head.mdeq.save_pretrained(tmp_path / "base")  # a base model's checkpoint: keys without "mdeq."
    reheaded, info = MDEQForImageClassification.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert all(torch.equal(reheaded.mdeq.state_dict()[k], v) for k, v in head.mdeq.state_dict().items())
    assert info["missing_keys"] and all(not k.startswith("mdeq.") for k in info["missing_keys"])
    assert not info["unexpected_keys"]
    base = MDEQModel.from_pretrained("deqzoo/mdeq-tiny-mnist")  # and a head's checkpoint into the base
    assert all(torch.equal(base.state_dict()[k], v) for k, v in head.mdeq.state_dict().items())
    auto = pytest.importorskip("transformers").AutoModelForImageClassification
    deqzoo.register()  # stock Auto classes know the families after registration (no import hook)
    via_auto = auto.from_pretrained(str(tmp_path / "base"))
    assert torch.equal(via_auto.mdeq.state_dict()[next(iter(head.mdeq.state_dict()))],
                       next(iter(head.mdeq.state_dict().values())))


def test_documented_keywords_on_an_embedded_checkpoint(tmp_path):
    """transformers' from_pretrained / save_pretrained keywords behave as there or raise naming them."""
    name = "deqzoo/mdeq-tiny-mnist"
    reference = deqzoo.from_pretrained(name)
    cls = type(reference)
    assert cls.from_pretrained(name, revision="main").config.num_labels == reference.config.num_labels
    assert cls.from_pretrained(name, dtype=torch.float64).mdeq.parameters().__next__().dtype == torch.float64
    assert cls.from_pretrained(name, torch_dtype="float64").dtype == torch.float64
    assert next(cls.from_pretrained(name, device_map="cpu").parameters()).device.type == "cpu"
    assert cls.from_pretrained(name, local_files_only=True).config.name_or_path == name
    assert cls.from_pretrained(name, deq={"f_max_iter": 3}).config.deq["f_max_iter"] == 3
    with pytest.raises(CheckpointError, match="use_safetensors=False"):
        cls.from_pretrained(name, use_safetensors=False)
    with pytest.raises(TypeError, match="no_such_keyword"):
        cls.from_pretrained(name, no_such_keyword=1)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not list((tmp_path / "sharded").glob("*.bin"))
    resharded = cls.from_pretrained(tmp_path / "sharded")
    assert all(torch.equal(resharded.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_documented_save_keywords(tmp_path):
    """save_pretrained's safe_serialization / variant, as in transformers (safetensors only); push_to_hub's
    commit options are exercised against a loopback Hub in test_hub_push.py."""
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    cls = type(model)
    with pytest.raises(ValueError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert not (tmp_path / "pickled").exists()
    model.save_pretrained(tmp_path / "variant", variant="v2", safe_serialization=True)
    assert (tmp_path / "variant" / "model.v2.safetensors").is_file()
    loaded = cls.from_pretrained(tmp_path / "variant", variant="v2")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        cls.from_pretrained(tmp_path / "variant")  # no default variant there


def test_a_saved_config_is_one_the_loader_accepts(tmp_path):
    """A scalar image_std (transformers' image processors broadcast it) was saved, then refused on load."""
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    model.config.image_std = 0.25
    model.save_pretrained(tmp_path / "scalar")
    loaded = type(model).from_pretrained(tmp_path / "scalar")
    assert loaded.config.image_std == [0.25] * loaded.config.in_channels
    with pytest.raises(ValueError, match="num_layers"):  # a strict config checks every assignment
        model.config.num_layers = "ten"
    model.config.num_groups = 3  # a valid int, but it divides no stream: only the whole config can tell
    with pytest.raises(ValueError, match="num_groups"):
        model.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
