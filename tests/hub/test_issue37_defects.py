"""The hub defects listed in issue 37, one test each (every one failed before its fix)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import deqzoo
from deqzoo.hub.safetensors_io import CheckpointError, read_safetensors_header
from utils.catalog import REPO_ROOT

DDIM = REPO_ROOT / "model_cards" / "ddim-digits-16"
UNET_WEIGHTS = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture
def ddim_copy(tmp_path):
    if not DDIM.is_dir():
        pytest.skip("the ddim-digits-16 checkpoint is not part of this checkout")
    pytest.importorskip("diffusers")
    folder = tmp_path / "ddim"
    shutil.copytree(DDIM, folder, ignore=shutil.ignore_patterns("evaluator"))
    return folder


def _pipeline_loaders():
    from deqzoo.pipelines.deq_ddim import DEQDDIMPipeline

    return {"deqzoo.from_pretrained": deqzoo.from_pretrained,
            "DEQDDIMPipeline.from_pretrained": lambda d: DEQDDIMPipeline.from_pretrained(str(d))}


def test_diffusers_unet_weights_linking_out_of_the_folder_are_refused(ddim_copy, tmp_path):
    """Critical: a symlinked unet weights file pointing outside the repository must never be followed."""
    foreign = tmp_path / "foreign.safetensors"
    shutil.copy(ddim_copy / UNET_WEIGHTS, foreign)
    (ddim_copy / UNET_WEIGHTS).unlink()
    (ddim_copy / UNET_WEIGHTS).symlink_to(foreign)
    for name, load in _pipeline_loaders().items():
        with pytest.raises(CheckpointError, match="link leading outside") as err:
            load(ddim_copy)
        assert "diffusion_pytorch_model.safetensors" in str(err.value), name


def test_diffusers_pickle_only_unet_is_refused_without_unpickling(ddim_copy, monkeypatch):
    weights = load_file(ddim_copy / UNET_WEIGHTS)
    (ddim_copy / UNET_WEIGHTS).unlink()
    torch.save(weights, ddim_copy / "unet" / "diffusion_pytorch_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    for name, load in _pipeline_loaders().items():
        with pytest.raises(CheckpointError, match="only pickle weights") as err:
            load(ddim_copy)
        assert "unet" in str(err.value), name


def test_diffusers_repository_still_loads_and_knows_its_folder(ddim_copy):
    pipe = deqzoo.from_pretrained(ddim_copy)
    assert pipe.name_or_path == str(ddim_copy)
    assert torch.equal(pipe.unet.conv_in.weight, load_file(ddim_copy / UNET_WEIGHTS)["conv_in.weight"])


def test_eval_of_the_embedded_ddim_checkpoint_runs(capsys):
    """`deqzoo eval deqzoo/ddim-digits-16` (the card's own command) exited 2: the pipeline had no
    name_or_path, so the task could not find the evaluator shipped beside it."""
    if not DDIM.is_dir():
        pytest.skip("the ddim-digits-16 checkpoint is not part of this checkout")
    from deqzoo.cli import main

    assert main(["eval", "deqzoo/ddim-digits-16", "--limit", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "mean_nfe:" in printed and "classes_covered:" in printed


def test_push_leaves_arbitrary_text_files_local(tmp_path):
    from deqzoo.hub.push import checkpoint_upload_files

    for name in ("config.json", "model.safetensors", "vocab.txt", "merges.txt", "secrets.txt",
                 "wandb-key.txt", "notes.txt"):
        (tmp_path / name).write_text("x")
    upload, stray = checkpoint_upload_files(tmp_path)
    assert upload == ["config.json", "merges.txt", "model.safetensors", "vocab.txt"]
    assert stray == ["notes.txt", "secrets.txt", "wandb-key.txt"]


def _raw_safetensors(path, entry, nbytes):
    header = json.dumps({"w": entry}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * nbytes)
    return path


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]},  # (-2)*(-2)*4 == 16 bytes: count matches
    {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]},  # a JSON boolean is an int to Python
    {"dtype": "F32", "shape": [2, 2], "data_offsets": "ab"},  # a 2-character string unpacks into 2 values
    {"dtype": "F32", "shape": [2, 2], "data_offsets": [0.0, 16.0]},
    {"dtype": "NOPE", "shape": [2, 2], "data_offsets": [0, 16]},
])
def test_malformed_safetensors_header_entries_are_named(tmp_path, entry):
    path = _raw_safetensors(tmp_path / "model.safetensors", entry, 16)
    with pytest.raises(CheckpointError, match="corrupt safetensors entry for tensor 'w'") as err:
        read_safetensors_header(path)
    assert str(path) in str(err.value)


def test_malformed_header_in_a_checkpoint_fails_naming_the_file(toy_checkpoint):
    directory, model = toy_checkpoint
    weights = directory / "model.safetensors"
    state = load_file(weights)
    key = next(iter(state))
    entries = {}
    offset = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        shape = [-1, -tensor.numel()] if name == key else list(tensor.shape)
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries).encode()
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * offset)
    with pytest.raises(CheckpointError, match=f"tensor '{key}'") as err:
        type(model).from_pretrained(directory)
    assert str(weights) in str(err.value)


def test_embedded_file_edited_in_place_is_refused_on_the_next_load(tmp_path):
    """An in-process cache keyed by (path, size, mtime) accepted a same-size edit with its mtime restored."""
    from deqzoo.hub.catalog import sha256_file
    from deqzoo.hub.loading import verify_embedded

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, weights)
    entry = {"id": "deqzoo/edited", "files": {"model.safetensors": sha256_file(weights)}}
    verify_embedded(entry, tmp_path)
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(CheckpointError, match="does not match the catalog"):
        verify_embedded(entry, tmp_path)


@pytest.mark.parametrize("name", ["", " "])
def test_empty_name_never_loads_the_working_directory(toy_checkpoint, monkeypatch, name):
    directory, model = toy_checkpoint
    monkeypatch.chdir(directory)  # a complete checkpoint in the working directory
    for load in (deqzoo.from_pretrained, type(model).from_pretrained):
        with pytest.raises(CheckpointError, match="empty name"):
            load(name)


def test_timm_pretrained_cfg_overlay_file_is_loaded(tmp_path):
    timm = pytest.importorskip("timm")
    deqzoo.register()  # registration is explicit (or on first deqzoo use), no import hook
    net = timm.create_model("mdeq_tiny_mnist", pretrained=True)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in net.state_dict().items()}
    path = tmp_path / "other.safetensors"
    save_file(state, path)
    other = timm.create_model("mdeq_tiny_mnist", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert all(torch.equal(other.state_dict()[k], state[k]) for k in state)
    key = "classifier.weight"
    assert not torch.equal(other.state_dict()[key], net.state_dict()[key])
    torch.save(state, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match="safetensors files only"):
        timm.create_model("mdeq_tiny_mnist", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / "other.pth")))
    with pytest.raises(ValueError, match="url"):
        timm.create_model("mdeq_tiny_mnist", pretrained=True, pretrained_cfg_overlay=dict(url="http://x/y.pth"))


def test_list_and_readme_show_each_cards_headline_with_its_data_set(capsys):
    """Two metrics of one type (held-out EPE, motorcycle EPE) used to collapse into the last one."""
    from deqzoo.hub.cards import read_model_card
    from deqzoo.hub.catalog import load_catalog
    from utils.cards import card_headline
    from utils.catalog import CARDS_DIR, build_catalog, catalog_markdown

    flow = CARDS_DIR / "deq-flow-cpu-synth"
    if not flow.is_dir():
        pytest.skip("the deq-flow-cpu-synth checkpoint is not part of this checkout")
    meta, _ = read_model_card(flow)
    result = meta["model-index"][0]["results"][0]
    first = result["metrics"][0]
    assert card_headline(meta) == f"{first['name']} {first['value']} ({result['dataset']['name']})"
    assert "Held-out synthetic EPE (px) 2.8332" in card_headline(meta)
    catalog = load_catalog()
    assert catalog["deqzoo/deq-flow-cpu-synth"]["headline"] == card_headline(meta)
    assert build_catalog()["checkpoints"] == catalog  # the shipped catalog is current
    readme = (REPO_ROOT / "README.md").read_text()
    assert catalog_markdown({"checkpoints": catalog}) in readme
    from deqzoo.cli import main

    assert main(["list", "--kind", "checkpoint"]) == 0
    printed = capsys.readouterr().out
    for cid, entry in catalog.items():
        line = next(line for line in printed.splitlines() if line.startswith(cid + " "))
        assert entry["headline"] in line, cid
