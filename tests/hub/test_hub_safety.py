"""Loading never unpickles; corrupt, truncated and mismatched checkpoints fail with errors naming the fault;
saving is atomic."""

from __future__ import annotations

import importlib
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import save_file

import deqzoo
from deqzoo.hub import CheckpointError
from deqzoo.hub.safetensors_io import read_safetensors_header
from utils.cards import save

toy = importlib.import_module("deqzoo_hub_toy_family")


class _Boom:
    """Unpickling this object would create the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused_and_never_unpickled(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    marker = tmp_path / "PWNED"
    (directory / "model.safetensors").unlink()
    payload = pickle.dumps({"state_dict": _Boom(str(marker))})
    for name in ("pytorch_model.bin", "model.pt", "weights.pkl"):
        (directory / name).write_bytes(payload)
    with pytest.raises(CheckpointError, match="never unpickles") as info:
        deqzoo.from_pretrained(directory)
    assert "pytorch_model.bin" in str(info.value)
    with pytest.raises(CheckpointError):
        toy.ToyDEQForImageClassification.from_pretrained(directory)
    with pytest.raises(CheckpointError):  # even when the caller asks for non-safetensors loading
        toy.ToyDEQForImageClassification.from_pretrained(directory, use_safetensors=False)
    assert not marker.exists()
    # The payload is genuinely malicious: unpickling it (which deqzoo never does) creates the marker.
    pickle.loads(payload)
    assert marker.exists()


def test_safetensors_named_file_with_pickle_inside_is_rejected(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    marker = tmp_path / "PWNED"
    (directory / "model.safetensors").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        deqzoo.from_pretrained(directory)
    assert not marker.exists()


@pytest.mark.parametrize("cut", [4, 40, -10])
def test_truncated_safetensors_error_names_file(toy_checkpoint, cut):
    directory, _ = toy_checkpoint
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|not a safetensors)") as info:
        deqzoo.from_pretrained(directory)
    assert str(path) in str(info.value)


def test_corrupted_header_error_names_file(toy_checkpoint):
    directory, _ = toy_checkpoint
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\xff" * 12  # garbage inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt") as info:
        toy.ToyDEQForImageClassification.from_pretrained(directory)
    assert str(path) in str(info.value)


def test_header_reader_agrees_with_safetensors(tmp_path):
    tensors = {"a": torch.zeros(2, 3), "b": torch.ones(5, dtype=torch.int64)}
    save_file(tensors, tmp_path / "x.safetensors")
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert {k: v["shape"] for k, v in header.items()} == {"a": [2, 3], "b": [5]}


def test_mismatch_lists_missing_unexpected_and_misshaped_keys(toy_checkpoint):
    directory, model = toy_checkpoint
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del state["head.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["mix.weight"] = torch.zeros(16, 15)
    save_file(state, directory / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        deqzoo.from_pretrained(directory)
    message = str(info.value)
    assert str(directory / "model.safetensors") in message
    assert "missing keys (1): head.bias" in message
    assert "unexpected keys (1): extra.weight" in message
    assert "mis-shaped key mix.weight: checkpoint [16, 15] vs model [16, 16]" in message


def test_config_weights_mismatch_from_config_change(toy_checkpoint):
    directory, _ = toy_checkpoint
    config = json.loads((directory / "config.json").read_text())
    config["hidden_size"] = 12
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"inject\.weight: checkpoint \[16, 192\] vs model \[12, 192\]"):
        deqzoo.from_pretrained(directory)


def test_unknown_model_type_lists_known_ones(toy_checkpoint):
    directory, _ = toy_checkpoint
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "no_such_deq"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no_such_deq") as info:
        deqzoo.from_pretrained(directory)
    assert "known model types" in str(info.value) and toy.TOY_FAMILY.model_type in str(info.value)


def test_failed_save_leaves_previous_checkpoint_and_no_partial_dir(toy_checkpoint, monkeypatch):
    directory, model = toy_checkpoint
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    other = toy.ToyDEQForImageClassification(toy.ToyDEQConfig())

    def exploding_save_file(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as handle:  # half a file, then the disk "fills up"
            handle.write(b"\x00" * 100)
        raise OSError("No space left on device")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", exploding_save_file)
    import transformers.modeling_utils as tmu

    monkeypatch.setattr(tmu, "safe_save_file", exploding_save_file, raising=False)
    with pytest.raises(OSError, match="No space left"):
        other.save_pretrained(directory)
    with pytest.raises(OSError, match="No space left"):
        other.save_pretrained(directory.parent / "fresh")
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name]
    monkeypatch.undo()
    reloaded = deqzoo.from_pretrained(directory)
    assert torch.equal(reloaded.head.weight, model.head.weight)


def test_save_replaces_existing_checkpoint_atomically(toy_checkpoint):
    directory, _ = toy_checkpoint
    torch.manual_seed(9)
    other = toy.ToyDEQForImageClassification(toy.ToyDEQConfig())
    save(other, directory)
    assert torch.equal(deqzoo.from_pretrained(directory).mix.weight, other.mix.weight)
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name]


def test_directory_without_weights(toy_checkpoint):
    directory, _ = toy_checkpoint
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        deqzoo.from_pretrained(directory)


def test_offline_unknown_id_explains(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="offline"):
        deqzoo.hub.resolve("someone/not-cached", cache_dir=tmp_path)


def test_copy_of_checkpoint_loads_identically(toy_checkpoint, tmp_path):
    directory, model = toy_checkpoint
    shutil.copytree(directory, tmp_path / "copy")
    loaded = deqzoo.from_pretrained(tmp_path / "copy")
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])


def test_resave_keeps_card_processor_and_user_files(toy_checkpoint):
    """A save replaces only what it writes: a .bin beside the checkpoint is the user's file (issue 17)."""
    directory, _ = toy_checkpoint
    card = (directory / "README.md").read_bytes()
    (directory / "pytorch_model.bin").write_bytes(b"user pickle")
    torch.manual_seed(5)
    other = toy.ToyDEQForImageClassification(toy.ToyDEQConfig())
    other.save_pretrained(directory)
    assert (directory / "README.md").read_bytes() == card
    assert (directory / "preprocessor_config.json").is_file()
    assert (directory / "pytorch_model.bin").read_bytes() == b"user pickle"
    assert torch.equal(deqzoo.from_pretrained(directory).mix.weight, other.mix.weight)


def test_save_into_directory_with_subfolders_keeps_them(toy_checkpoint, tmp_path):
    directory, model = toy_checkpoint
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "events.txt").write_text("step 1")
    (run / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    model.save_pretrained(run)
    assert (run / "logs" / "events.txt").read_text() == "step 1"
    assert not (run / "model-00001-of-00002.safetensors").exists()
    assert torch.equal(deqzoo.from_pretrained(run).head.weight, model.head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", directory.name]


def test_saved_checkpoint_has_umask_permissions(toy_checkpoint):
    import os

    directory, _ = toy_checkpoint
    umask = os.umask(0)
    os.umask(umask)
    assert directory.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (directory / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_non_main_process_save_writes_nothing(toy_checkpoint):
    directory, _ = toy_checkpoint
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    toy.ToyDEQForImageClassification(toy.ToyDEQConfig()).save_pretrained(directory, is_main_process=False)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
