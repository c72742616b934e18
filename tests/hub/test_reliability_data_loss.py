"""Reliability, data loss (issue 17): a save replaces only what it writes; nothing else in the folder (or the
working directory) is deleted or changed; `deqzoo convert` never touches its source."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

import deqzoo
from deqzoo.cli import main as cli_main

toy = importlib.import_module("deqzoo_hub_toy_family")

# what a training run keeps beside its checkpoint (the files save_pretrained used to delete)
RUN_FILES = {"optimizer.pt": b"adam", "training_args.bin": b"args", "rng_state.pth": b"rng",
             "scheduler.ckpt": b"sched", "dataset.pkl": b"data", "other_model.safetensors": b"another model",
             "trainer_state.json": b"{}", "runs/events.out": b"tb", "checkpoint-5/pytorch_model.bin": b"old",
             "checkpoint-5/model.safetensors": b"older weights"}


def _write(directory, files):
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)


def _intact(directory, files):
    for rel, data in files.items():
        assert (directory / rel).read_bytes() == data, rel


def _model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return toy.ToyDEQForImageClassification(toy.ToyDEQConfig(hidden_size=hidden))


def test_save_keeps_pickles_and_other_weights_in_a_new_folder(tmp_path, toy_family):
    _write(tmp_path / "out", RUN_FILES)
    model = _model()
    model.save_pretrained(tmp_path / "out")
    _intact(tmp_path / "out", RUN_FILES)
    assert torch.equal(deqzoo.from_pretrained(tmp_path / "out").mix.weight, model.mix.weight)


def test_resave_over_a_checkpoint_keeps_run_files(toy_checkpoint):
    directory, _ = toy_checkpoint
    _write(directory, RUN_FILES)
    card = (directory / "README.md").read_bytes()
    other = _model(3, 24)
    other.save_pretrained(directory)
    _intact(directory, RUN_FILES)
    assert (directory / "README.md").read_bytes() == card
    assert torch.equal(deqzoo.from_pretrained(directory).mix.weight, other.mix.weight)


def test_save_into_the_working_directory_keeps_its_files(tmp_path, toy_family, monkeypatch):
    _write(tmp_path, RUN_FILES)
    (tmp_path / "train.py").write_text("print('my script')")
    monkeypatch.chdir(tmp_path)
    for seed in (0, 1):  # the second save replaces the first in place
        model = _model(seed)
        model.save_pretrained(".")
    _intact(tmp_path, RUN_FILES)
    assert (tmp_path / "train.py").read_text() == "print('my script')"
    assert torch.equal(deqzoo.from_pretrained(".").mix.weight, model.mix.weight)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no journal or temp folder left
    assert os.getcwd() == str(tmp_path)


def test_save_into_a_parent_of_the_working_directory_keeps_it(tmp_path, toy_family, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "code.py").write_text("x = 1")
    monkeypatch.chdir(tmp_path / "src")
    _model().save_pretrained(tmp_path)
    assert os.getcwd() == str(tmp_path / "src") and (tmp_path / "src" / "code.py").read_text() == "x = 1"
    assert deqzoo.from_pretrained(tmp_path) is not None


def test_resave_removes_only_the_checkpoints_own_stale_shards(tmp_path, toy_family):
    directory = tmp_path / "ckpt"
    _write(directory, {"model-00001-of-00002.safetensors": b"shard", "model-00002-of-00002.safetensors": b"s",
                       "model.safetensors.index.json": b"{}", "model-final.safetensors": b"user's"})
    model = _model()
    model.save_pretrained(directory)
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["config.json", "model-final.safetensors", "model.safetensors"]
    assert torch.equal(deqzoo.from_pretrained(directory).mix.weight, model.mix.weight)


def test_save_through_a_symlink_keeps_the_link(tmp_path, toy_family):
    real = tmp_path / "real"
    _write(real, {"notes.txt": b"n"})
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    _model().save_pretrained(link)
    assert link.is_symlink() and (real / "model.safetensors").is_file()
    _intact(real, {"notes.txt": b"n"})


def test_save_onto_an_existing_file_refuses_and_keeps_it(tmp_path, toy_family):
    path = tmp_path / "ckpt"
    path.write_bytes(b"a user's file")
    with pytest.raises(FileExistsError, match="ckpt.*not a directory"):
        _model().save_pretrained(path)
    assert path.read_bytes() == b"a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_user_symlink_in_the_folder_survives_a_resave(tmp_path, toy_family):
    directory = tmp_path / "ckpt"
    _model().save_pretrained(directory)
    (tmp_path / "data.txt").write_text("outside")
    (directory / "data").symlink_to(tmp_path / "data.txt")
    _model(1).save_pretrained(directory)
    assert (directory / "data").is_symlink() and (directory / "data").read_text() == "outside"


def _fake_converter(monkeypatch):
    import conversion as converters

    def convert(src, out):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "converted.txt").write_text("ok")
        return Path(out)

    monkeypatch.setattr(converters, "_REGISTERED", {"fake-format": convert})


@pytest.mark.parametrize("where", ["same-folder", "parent-folder"])
def test_convert_refuses_an_output_that_contains_its_source(tmp_path, capsys, where, monkeypatch):
    release = tmp_path / "release"
    release.mkdir()
    src = release / "original_release.pt"
    src.write_bytes(b"original weights")
    out = release if where == "same-folder" else tmp_path
    _fake_converter(monkeypatch)
    code = cli_main(["convert", "fake-format", str(src), str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "contains the source" in err and str(src) in err
    assert src.read_bytes() == b"original weights"
    assert not (out / "converted.txt").exists()


def test_real_converter_refuses_an_output_containing_its_source(tmp_path):
    from conversion import converter_module

    src = tmp_path / "release.pt"
    torch.save({"w": torch.zeros(1)}, src)
    with pytest.raises(ValueError, match="contains the source"):
        converter_module("ignn_swiftieh").convert(src, tmp_path)
    assert src.is_file()


def test_converted_checkpoint_written_next_to_source_keeps_it(tmp_path):
    """A converter's save into a sibling folder of the release keeps every file of the release folder."""
    from conversion import converter_module
    from utils.catalog import REPO_ROOT

    src_fixture = REPO_ROOT / "conversion" / "fixtures" / "ignn" / "swiftieh_node_state_dict.pt"
    release = tmp_path / "release"
    release.mkdir()
    src = release / "weights.pt"
    src.write_bytes(src_fixture.read_bytes())
    out = converter_module("ignn_swiftieh").convert(src, release / "converted")
    assert src.read_bytes() == src_fixture.read_bytes()
    assert deqzoo.from_pretrained(out) is not None


@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00002.safetensors", "config.json"])
def test_a_user_directory_named_like_a_checkpoint_file_refuses_the_save_before_anything_moves(tmp_path, name):
    """Issue 57: a directory named model.safetensors was moved into a hidden .NAME.deqzoo-tmp-* folder in the
    parent, with a message giving the wrong reason."""
    import deqzoo

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    run = tmp_path / "run"
    (run / name).mkdir(parents=True)
    (run / name / "mine.txt").write_text("user data")
    (run / "notes.txt").write_text("keep")
    expected = f"{name}: this save writes the file {name} but the folder holds a directory of that name"
    with pytest.raises(FileExistsError, match=expected):
        model.save_pretrained(run)
    assert (run / name / "mine.txt").read_text() == "user data"
    assert sorted(p.name for p in run.iterdir()) == sorted([name, "notes.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hidden sibling left behind
