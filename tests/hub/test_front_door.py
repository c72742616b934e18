"""`deqzoo.from_pretrained` is transformers' path with a name resolved once (issue 57 items 2 and 3): every
keyword reaches transformers, each embedded file is hashed once and config.json read once per load, and a
checkpoint whose weights do not cover the model refuses to load, naming the keys."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import deqzoo
from deqzoo.hub import CheckpointError, loading
from deqzoo.hub.catalog import embedded_folder, load_catalog

NAME = "deqzoo/mdeq-tiny-mnist"


@pytest.fixture
def ck(tmp_path) -> Path:
    folder = tmp_path / "ck"
    shutil.copytree(embedded_folder(load_catalog()[NAME]), folder)
    return folder


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_subfolder_through_the_front_door(ck, tmp_path):
    reference = deqzoo.from_pretrained(NAME)
    repo = tmp_path / "repo"
    repo.mkdir()
    ck.rename(repo / "inner")
    (repo / "README.md").write_text("a repository whose checkpoint sits in a subfolder\n")
    loaded = deqzoo.from_pretrained(repo, subfolder="inner")
    assert type(loaded) is type(reference) and _equal(loaded, reference)
    with pytest.raises(CheckpointError, match="no config.json"):
        deqzoo.from_pretrained(repo)  # the subfolder is where the checkpoint is
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        deqzoo.from_pretrained(repo, subfolder="../ck")


def test_output_loading_info_through_the_front_door():
    model, info = deqzoo.from_pretrained(NAME, output_loading_info=True)
    assert model.name_or_path == NAME and model.config.name_or_path == NAME
    assert {k: list(v) for k, v in info.items()} == {"missing_keys": [], "unexpected_keys": [],
                                                     "mismatched_keys": [], "error_msgs": []}
    assert _equal(model, deqzoo.from_pretrained(NAME))


def test_other_transformers_keywords_through_the_front_door():
    assert next(deqzoo.from_pretrained(NAME, dtype=torch.float64).parameters()).dtype == torch.float64
    assert next(deqzoo.from_pretrained(NAME, torch_dtype="float64").parameters()).dtype == torch.float64
    assert next(deqzoo.from_pretrained(NAME, device_map="cpu").parameters()).device.type == "cpu"
    assert deqzoo.from_pretrained(NAME, revision="main", local_files_only=True).name_or_path == NAME
    assert deqzoo.from_pretrained(NAME, output_hidden_states=True).config.output_hidden_states
    with pytest.raises(TypeError, match="no_such_keyword"):
        deqzoo.from_pretrained(NAME, no_such_keyword=1)


def test_one_load_hashes_each_embedded_file_once_and_reads_config_once(monkeypatch):
    hashed: list[str] = []
    real_hash = loading.sha256_file
    monkeypatch.setattr(loading, "sha256_file",
                        lambda path: hashed.append(Path(path).name) or real_hash(path))
    monkeypatch.setattr(loading, "_HASHED", {})  # a fresh process's cache
    reads: list[str] = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or real_read(self))
    deqzoo.from_pretrained(NAME)
    files = sorted(load_catalog()[NAME]["files"])
    assert sorted(hashed) == files  # each file of the catalog entry, once
    assert reads.count("config.json") == 1
    hashed.clear()
    deqzoo.from_pretrained(NAME)
    assert hashed == []  # once per process while the files are unchanged


def test_weights_that_do_not_cover_the_model_refuse_naming_the_keys(ck):
    """Issue 57's reproduction: it loaded with random weights (classifier.bias summing to 0)."""
    save_file({"a": torch.zeros(1)}, ck / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        deqzoo.from_pretrained(ck)
    message = str(err.value)
    assert "missing keys" in message and "classifier.bias" in message and "mdeq." in message
    assert "unexpected keys (1): a" in message and str(ck / "model.safetensors") in message
    model, info = deqzoo.from_pretrained(ck, strict=False, output_loading_info=True)  # transformers' report
    assert "classifier.bias" in info["missing_keys"] and set(info["unexpected_keys"]) == {"a"}


def test_a_config_naming_another_head_refuses_naming_the_heads_keys(ck):
    """The classification checkpoint with a config naming the segmentation head loaded with a random head."""
    import json

    config = json.loads((ck / "config.json").read_text())
    config["architectures"] = ["MDEQForSemanticSegmentation"]
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        deqzoo.from_pretrained(ck)
    message = str(err.value)
    assert "MDEQForSemanticSegmentation" in message
    missing = message.split("missing keys")[1].split("\n")[0]
    unexpected = message.split("unexpected keys")[1].split("\n")[0]
    assert "classifier.weight" in unexpected and "mdeq." not in missing and missing.count(",") >= 1


def test_a_base_model_into_a_task_head_keeps_transformers_semantics(tmp_path):
    from deqzoo.models.mdeq.modeling_mdeq import MDEQForImageClassification, MDEQForSemanticSegmentation

    head = deqzoo.from_pretrained(NAME)
    head.mdeq.save_pretrained(tmp_path / "base")
    for cls in (MDEQForImageClassification, MDEQForSemanticSegmentation):
        reheaded, info = cls.from_pretrained(tmp_path / "base", output_loading_info=True)
        assert _equal(reheaded.mdeq, head.mdeq)  # the body from the checkpoint, the head new and reported
        assert info["missing_keys"] and not any(k.startswith("mdeq.") for k in info["missing_keys"])
    # a body key missing from the base checkpoint still refuses, even into a head
    state = {k: v for k, v in head.mdeq.state_dict().items()}
    dropped = sorted(state)[0]
    del state[dropped]
    save_file(state, tmp_path / "base" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"missing keys \\(1\\): mdeq.{dropped}"):
        MDEQForImageClassification.from_pretrained(tmp_path / "base")
