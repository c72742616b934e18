"""Reliability, code and paths (issue 17): checkpoint content never chooses code to import or a path outside
its folder."""

from __future__ import annotations

import json
import os
import sys

import pytest
from safetensors.torch import save_file

import deqzoo
from deqzoo.cli import main as cli_main
from deqzoo.hub import CheckpointError
from deqzoo.hub.cards import read_model_card
from deqzoo.hub.safetensors_io import weight_files
from examples.tasks import TASKS, task_module


def _set_task(directory, value) -> None:
    card = (directory / "README.md").read_text()
    meta, _ = read_model_card(directory)
    (directory / "README.md").write_text(card.replace(f"deqzoo_task: {meta['deqzoo_task']}",
                                                      f"deqzoo_task: {value}"))


def test_card_task_this_is_not_imported(toy_checkpoint, capsys):
    directory, _ = toy_checkpoint
    _set_task(directory, "this")
    sys.modules.pop("this", None)
    assert cli_main(["predict", str(directory), "x"]) == 2
    assert "not a registered task" in capsys.readouterr().err
    assert "this" not in sys.modules  # `import this` would print the Zen of Python


def test_card_task_naming_a_module_in_the_working_directory_never_runs_it(toy_checkpoint, tmp_path,
                                                                          monkeypatch, capsys):
    directory, _ = toy_checkpoint
    marker = tmp_path / "RAN"
    (tmp_path / "evil_task.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as with `python -m deqzoo.cli` run in that folder
    _set_task(directory, "evil_task")
    assert cli_main(["eval", str(directory)]) == 2
    assert "evil_task" in capsys.readouterr().err and not marker.exists()


@pytest.mark.parametrize("value", ["os", "deqzoo.cli", "subprocess", "../mnist", ["mnist"], {"a": 1}, 3])
def test_task_values_outside_the_registry_are_refused(value):
    with pytest.raises(ValueError, match="not a registered task"):
        task_module(value)


def test_a_card_selects_a_registered_task_by_its_name_only():
    assert task_module("mnist").__name__ == TASKS["mnist"] == "examples.mdeq.mnist"
    with pytest.raises(ValueError, match="not a registered task"):
        task_module(TASKS["mnist"])  # a module name is not a task name


def test_bench_name_never_imports_other_modules(capsys):
    sys.modules.pop("this", None)
    for name in ("this", "..cli", "os"):
        assert cli_main(["bench", name]) == 2
        assert "unknown benchmark" in capsys.readouterr().err
    assert "this" not in sys.modules


def _shard(directory, toy_checkpoint_dir, shard_name):
    """Turn a toy checkpoint into a sharded one whose index maps every key to `shard_name`."""
    from safetensors.torch import load_file

    tensors = load_file(str(toy_checkpoint_dir / "model.safetensors"))
    (toy_checkpoint_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: shard_name for k in tensors}}
    (toy_checkpoint_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


@pytest.mark.parametrize("name", ["../../../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors",
                                  "..\\x.safetensors", "C:\\x.safetensors"])
def test_index_shard_names_leaving_the_folder_are_refused(toy_checkpoint, name):
    directory, _ = toy_checkpoint
    _shard(directory, directory, name)
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder") as info:
        deqzoo.from_pretrained(directory)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_pointing_to_another_checkpoints_weights_by_absolute_path_is_refused(toy_checkpoint,
                                                                                   tmp_path):
    directory, _ = toy_checkpoint
    other = tmp_path / "other"
    other.mkdir()
    tensors = _shard(directory, directory, str(other / "weights.safetensors"))
    save_file(tensors, str(other / "weights.safetensors"))
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        deqzoo.from_pretrained(directory)


def test_shard_symlink_leading_outside_is_refused(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    outside = tmp_path / "outside.safetensors"
    tensors = _shard(directory, directory, "model-00001-of-00001.safetensors")
    save_file(tensors, str(outside))
    (directory / "model-00001-of-00001.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="link leading outside"):
        deqzoo.from_pretrained(directory)


def test_weights_and_config_symlinks_leading_outside_are_refused(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    for name in ("model.safetensors", "config.json"):
        moved = tmp_path / f"moved-{name}"
        os.replace(directory / name, moved)
        (directory / name).symlink_to(moved)
        with pytest.raises(CheckpointError, match=f"'{name}' is a link leading outside"):
            deqzoo.from_pretrained(directory)
        (directory / name).unlink()
        os.replace(moved, directory / name)
    assert deqzoo.from_pretrained(directory) is not None


def test_card_symlink_leading_outside_is_refused(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    os.replace(directory / "README.md", tmp_path / "card.md")
    (directory / "README.md").symlink_to(tmp_path / "card.md")
    with pytest.raises(CheckpointError, match="link leading outside"):
        read_model_card(directory)


@pytest.mark.parametrize("weight_map", [None, [], "x.safetensors", {"w": 3}, {"w": ""}, {"w": "notes.txt"}])
def test_malformed_index_names_the_file(toy_checkpoint, weight_map):
    directory, _ = toy_checkpoint
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        weight_files(directory)


def test_hub_cache_snapshot_symlinks_into_its_blobs_are_allowed(toy_checkpoint, tmp_path):
    """A Hugging Face cache snapshot is a folder of links into ../../blobs: that is inside the repository."""
    directory, model = toy_checkpoint
    repo = tmp_path / "hub" / "models--me--toy"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in directory.iterdir():
        blob = repo / "blobs" / f"blob-{path.name}"
        os.replace(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    loaded = deqzoo.from_pretrained(snapshot)
    assert loaded.mix.weight.equal(model.mix.weight)


def test_save_journal_naming_a_foreign_folder_is_refused(tmp_path):
    from deqzoo.hub import saving

    target = tmp_path / "ckpt"
    target.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("keep")
    (target / saving.JOURNAL).write_text(json.dumps({"tmp": "victim", "files": ["config.json"]}))
    with pytest.raises(OSError, match="does not use"):
        saving.recover(target)
    assert (victim / "config.json").read_text() == "keep" and not (target / "config.json").exists()
