"""Reliability, validation (issue 17): every config value and file is checked (types, ranges, sizes, depth)
before anything is allocated; errors name the file and the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import deqzoo
from deqzoo.hub import CheckpointError
from deqzoo.hub.validation import read_json
from deqzoo.modeling_utils import ConfigError
from utils.catalog import REPO_ROOT

CARDS = REPO_ROOT / "model_cards"


def _copy(name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(CARDS / name, folder)
    return folder


def _edit(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("card,key,value,message", [
    ("mdeq-tiny-mnist", "num_groups", 0, "outside the allowed range"),
    ("mdeq-tiny-mnist", "num_groups", "2", "must be int, got '2'"),
    ("mdeq-tiny-mnist", "branch_channels", [16, -16], "an entry of 'branch_channels' is -16"),
    ("mdeq-tiny-mnist", "branch_channels", [16] * 5000, "5,000 entries"),
    ("mdeq-tiny-mnist", "dropout", float("nan"), "must be float"),
    ("mdeq-tiny-mnist", "wnorm", "yes", "must be bool"),
    ("deq-transformer-tiny-pydoc", "d_model", "128", "must be int, got '128'"),
    ("deq-transformer-tiny-pydoc", "n_head", -4, "outside the allowed range"),
    ("deq-transformer-tiny-pydoc", "vocab_size", 10**12, "outside the allowed range"),
    ("ignn-chains", "hidden_size", True, "must be int, got True"),
    ("ignn-chains", "num_layers", 0, "outside the allowed range"),
    ("mdeq-tiny-mnist", "num_labels", 10**9, "num_labels"),
    ("mdeq-tiny-mnist", "deq", "fast", "key 'deq' must be a mapping"),
])
def test_bad_config_value_names_file_and_key(tmp_path, card, key, value, message):
    path = _edit(_copy(card, tmp_path), **{key: value})
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        deqzoo.from_pretrained(path.parent)
    text = str(info.value)
    assert str(path) in text and message in text, text
    assert repr(key) in text or key in text
    assert time.perf_counter() - start < 30  # refused up front, nothing large built


def test_config_error_in_python_names_class_and_key():
    from deqzoo.models.mdeq import MDEQConfig

    with pytest.raises(ConfigError, match="MDEQConfig: key 'num_groups' must be int, got '2'"):
        MDEQConfig(num_groups="2")


@pytest.mark.parametrize("content,kind", [("[1, 2]", "list"), ("null", "null"), ('"a string"', "str"),
                                          ("3", "int")])
def test_config_json_that_is_not_an_object(tmp_path, content, kind):
    folder = _copy("mdeq-tiny-mnist", tmp_path)
    (folder / "config.json").write_text(content)
    message = f"config.json: the top level must be a JSON object, got {kind}"
    with pytest.raises(CheckpointError, match=message):
        deqzoo.from_pretrained(folder)
    from deqzoo.models.mdeq import MDEQForImageClassification

    with pytest.raises(CheckpointError, match="config.json: the top level"):
        MDEQForImageClassification.from_pretrained(folder)


def test_deeply_nested_config_names_the_file(tmp_path):
    folder = _copy("mdeq-tiny-mnist", tmp_path)
    (folder / "config.json").write_text('{"model_type": "mdeq", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="config.json: JSON nested too deeply"):
        deqzoo.from_pretrained(folder)


def test_moderately_nested_json_over_the_depth_limit(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": ' + "[" * 39 + "]" * 39 + "}")
    with pytest.raises(CheckpointError, match="nested 40 levels deep, above the limit of 32"):
        read_json(path)


def test_oversized_config_json_is_refused_unread(tmp_path):
    folder = _copy("mdeq-tiny-mnist", tmp_path)
    with open(folder / "config.json", "a") as handle:
        handle.write(" " * (17 * 1024 * 1024))
    with pytest.raises(CheckpointError, match="above the limit of 16,777,216"):
        deqzoo.from_pretrained(folder)


@pytest.mark.parametrize("value", [None, 3, ["mdeq"]])
def test_model_type_that_is_not_a_string(tmp_path, value):
    path = _edit(_copy("mdeq-tiny-mnist", tmp_path), model_type=value)
    with pytest.raises(CheckpointError, match="model_type"):
        deqzoo.from_pretrained(path.parent)


def test_config_over_the_parameter_budget_states_the_count(tmp_path):
    path = _edit(_copy("deq-transformer-tiny-pydoc", tmp_path), vocab_size=9_000_000)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"would allocate 1,16\d,\d{3},\d{3} parameters .* above the "
                                              r"budget of 1,000,000,000") as info:
        deqzoo.from_pretrained(path.parent)
    assert str(path) in str(info.value)
    # the stated number is the model's: the tiny model's count plus 128 (tied embedding row) per extra token
    tiny = deqzoo.from_pretrained(CARDS / "deq-transformer-tiny-pydoc")
    tiny_count = sum(t.numel() for t in [*tiny.parameters(), *tiny.buffers()])
    per_token = sum(t.numel() // tiny.config.vocab_size for t in [*tiny.parameters(), *tiny.buffers()]
                    if tiny.config.vocab_size in t.shape)
    expected = tiny_count + (9_000_000 - tiny.config.vocab_size) * per_token
    assert f"would allocate {expected:,} parameters" in str(info.value)
    assert time.perf_counter() - start < 30


def test_budget_is_configurable(toy_checkpoint, monkeypatch):
    directory, model = toy_checkpoint
    count = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setenv("DEQZOO_MAX_PARAMETERS", str(count - 1))
    with pytest.raises(CheckpointError, match=f"would allocate {count:,} parameters"):
        deqzoo.from_pretrained(directory)
    assert deqzoo.from_pretrained(directory, max_parameters=count) is not None


def test_big_config_with_small_weights_fails_before_allocating(tmp_path):
    """Issue 17: a small config.json described a 3.6 GB model, built before the key mismatch was reported.
    In a fresh interpreter, the peak memory stays far below what the config describes (~2.3 GB here)."""
    folder = _copy("deq-transformer-tiny-pydoc", tmp_path)
    _edit(folder, vocab_size=4_500_000)  # ~0.58 B parameters (2.3 GB), under the budget
    code = (
        "import resource, deqzoo, sys\n"
        "from deqzoo.hub import CheckpointError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        f"    deqzoo.from_pretrained({str(folder)!r}, max_parameters=5_000_000_000)\n"
        "except CheckpointError as err:\n"
        "    print('ERROR', str(err).splitlines()[0][:300])\n"
        "print('PEAK_MB', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=REPO_ROOT).stdout
    assert "ERROR" in out and "weights do not match" in out, out
    peak = float(out.split("PEAK_MB")[1])
    assert peak < 500, f"grew by {peak:.0f} MB while the config describes ~2.3 GB of float32"


def test_integer_weights_for_a_float_parameter_are_refused(toy_checkpoint):
    directory, _ = toy_checkpoint
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["mix.weight"] = tensors["mix.weight"].to(torch.int32)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="dtype of key mix.weight: checkpoint torch.int32 vs model "
                                              "torch.float32"):
        deqzoo.from_pretrained(directory)


def test_float64_weights_are_cast_into_float32_parameters(toy_checkpoint):
    directory, model = toy_checkpoint
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({k: v.double() if v.is_floating_point() else v for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    loaded = deqzoo.from_pretrained(directory)
    assert loaded.mix.weight.dtype == torch.float32 and torch.equal(loaded.mix.weight, model.mix.weight)


def test_card_yaml_aliases_are_refused(toy_checkpoint):
    directory, _ = toy_checkpoint
    bomb = "---\na: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
           "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n---\nbody\n"
    (directory / "README.md").write_text(bomb)
    from deqzoo.hub.cards import read_model_card

    with pytest.raises(ValueError, match="README.md: malformed or unsafe YAML front matter: aliases are not "
                                         "allowed"):
        read_model_card(directory)


def test_card_yaml_nested_too_deeply(toy_checkpoint):
    directory, _ = toy_checkpoint
    (directory / "README.md").write_text("---\na: " + "[" * 200 + "]" * 200 + "\n---\n")
    from deqzoo.hub.cards import read_model_card

    with pytest.raises(ValueError, match="README.md: .*nested"):
        read_model_card(directory)


def test_card_with_malformed_model_index_still_reads(toy_checkpoint):
    from deqzoo.hub.cards import card_metrics

    assert card_metrics({"model-index": "oops"}) == {}
    index = [{"results": [3, {"metrics": [None, {"type": "acc", "value": 1}]}]}]
    assert card_metrics({"model-index": index}) == {"acc": 1}
    # two metrics of one type (held-out and motorcycle EPE): the first, the card's headline, stands for it
    two = [{"results": [{"metrics": [{"type": "epe", "name": "held-out", "value": 1.5},
                                     {"type": "epe", "name": "motorcycle", "value": 8.0},
                                     {"type": "nfe", "value": 12.0}]}]}]
    assert card_metrics({"model-index": two}) == {"epe": 1.5, "nfe": 12.0}


def test_safetensors_header_nested_too_deeply_names_file(toy_checkpoint):
    import struct

    directory, _ = toy_checkpoint
    header = ("[" * 100_000 + "]" * 100_000).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        deqzoo.from_pretrained(directory)


def test_huge_num_labels_in_python_is_refused_before_building_labels():
    from deqzoo.models.ignn import IGNNConfig

    start = time.perf_counter()
    with pytest.raises(ConfigError, match="num_labels"):
        IGNNConfig(num_labels=10**9)
    assert time.perf_counter() - start < 1


def test_create_model_checks_the_budget_before_building():
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"create_model\('deq-transformer-tiny-pydoc'\): this config "
                                              r"would allocate 1,16\d,\d{3},\d{3} parameters"):
        deqzoo.create_model("deq-transformer-tiny-pydoc", vocab_size=9_000_000)
    assert time.perf_counter() - start < 10
    with pytest.raises(ConfigError, match="key 'd_model' must be int"):
        deqzoo.create_model("deq-transformer-tiny-pydoc", d_model="128")


def test_create_model_refuses_an_unknown_key_instead_of_building_the_preset_unchanged():
    """PretrainedConfig keeps unknown keywords as attributes no model reads: a typo must not pass silently."""
    with pytest.raises(ConfigError, match="DEQFlowConfig: unknown key 'hiden_dim'. Did you mean 'hidden_dim"):
        deqzoo.create_model("deq-flow-cpu-synth", hiden_dim=96)
    with pytest.raises(ConfigError, match="unknown key 'num_lables'. Did you mean 'num_labels'"):  # property
        deqzoo.create_model("mdeq-tiny-mnist", num_lables=3)
    # fields and settable properties still work, and change the model
    assert deqzoo.create_model("deq-flow-cpu-synth", hidden_dim=96).config.hidden_dim == 96
    head = deqzoo.create_model("mdeq-tiny-mnist", num_labels=3).classifier
    assert head.out_features == 3


def test_from_pretrained_overrides_are_checked_like_the_config():
    with pytest.raises(ConfigError, match="MDEQConfig: key 'num_groups' must be int, got '4'"):
        deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", num_groups="4")
    with pytest.raises(ConfigError, match="key 'dropout' is 2.0, outside the allowed range"):
        deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", dropout=2.0)
