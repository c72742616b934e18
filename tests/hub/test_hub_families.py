"""The real families through the hub: every small preset saves and reloads through the stock Auto classes, and
every embedded checkpoint loads offline (network blocked) and through transformers."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import deqzoo
from deqzoo.factory import _architectures
from deqzoo.hub import read_model_card, resolve
from deqzoo.hub.catalog import load_catalog
from deqzoo.integrations.transformers import register_all


def _presets() -> list[tuple[str, str]]:
    families = register_all()
    out = []
    for model_type, family in families.items():
        for name in _architectures(family):
            out.append((model_type, name))
    return out


@pytest.fixture
def no_network(monkeypatch):
    real_connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"network access attempted during an offline test: {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def architectures():
    """`deqzoo.list_models("architecture")` by name, listed once (it counts every preset's parameters, ~1 s;
    the ModelInfo rows are only read)."""
    return {m.name: m for m in deqzoo.list_models("architecture")}


@pytest.mark.parametrize("model_type,preset", _presets())
def test_preset_roundtrip_through_auto_classes(model_type, preset, tmp_path, architectures):
    info = architectures[preset]
    if info.parameters is None or info.parameters > 2_000_000:
        pytest.skip(f"{preset}: {info.parameters} parameters, too large for the suite")
    torch.manual_seed(0)
    model = deqzoo.create_model(preset)
    model.save_pretrained(tmp_path / preset)
    config = transformers.AutoConfig.from_pretrained(tmp_path / preset)
    assert config.model_type == model_type and config.deq == model.config.deq
    family = register_all()[model_type]
    auto_name = _architectures(family)[preset].get("auto", "AutoModel")
    # a head with no transformers Auto class (graph tasks) is found through config.architectures
    load = (deqzoo.from_pretrained if type(model).__name__ in family.heads
            else getattr(transformers, auto_name).from_pretrained)
    loaded = load(tmp_path / preset, deq={"f_max_iter": 3})
    assert type(loaded) is type(model) and loaded.config.deq_config.f_max_iter == 3
    reference = model.state_dict()
    assert loaded.state_dict().keys() == reference.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert sum(p.numel() for p in model.parameters()) == info.parameters


def test_base_model_loads_from_head_checkpoint(tmp_path):
    if "mdeq" not in register_all():
        pytest.skip("mdeq family not available")
    torch.manual_seed(0)
    model = deqzoo.create_model("mdeq-tiny-mnist")
    model.save_pretrained(tmp_path)
    base = transformers.AutoModel.from_pretrained(tmp_path)
    prefix = model.base_model_prefix
    assert type(base) is type(getattr(model, prefix))
    for key, value in base.state_dict().items():
        assert torch.equal(value, model.state_dict()[f"{prefix}.{key}"]), key


EMBEDDED = sorted(load_catalog())


@pytest.mark.parametrize("checkpoint", EMBEDDED)
def test_embedded_checkpoint_offline(checkpoint, no_network):
    entry = load_catalog()[checkpoint]
    model = deqzoo.from_pretrained(checkpoint)
    if (resolve(checkpoint) / "model_index.json").is_file():  # a diffusers repository (DEQ-DDIM pipeline)
        assert sum(p.numel() for p in model.unet.parameters()) == entry["parameters"]
        meta, body = read_model_card(resolve(checkpoint))
        assert meta["library_name"] == "diffusers" and meta["deqzoo_task"] and "deqzoo eval" in body
        assert type(model).__name__ == "DEQDDIMPipeline" and entry["model_type"] == "DDIMPipeline"
        return
    assert sum(p.numel() for p in model.parameters()) == entry["parameters"]  # buffers are not parameters
    directory = resolve(checkpoint)
    meta, body = read_model_card(directory)
    assert meta["library_name"] == "deqzoo" and meta["deqzoo_task"] and "deqzoo eval" in body
    config = transformers.AutoConfig.from_pretrained(directory)
    assert config.model_type == entry["model_type"]


@pytest.mark.parametrize("checkpoint", [c for c in EMBEDDED
                                        if load_catalog()[c]["task"] == "image-classification"])
def test_embedded_vision_checkpoint_pipeline(checkpoint, no_network):
    directory = resolve(checkpoint)
    model = transformers.AutoModelForImageClassification.from_pretrained(directory)
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    pipe = transformers.pipeline("image-classification", model=str(directory))
    image = Image.fromarray((np.random.default_rng(1).random((28, 28)) * 255).astype("uint8"))
    result = pipe(image, top_k=1)[0]
    with torch.no_grad():
        probs = model(**processor(image, return_tensors="pt")).logits.softmax(-1)[0]
    assert result["label"] == model.config.id2label[int(probs.argmax())]
    assert result["score"] == pytest.approx(float(probs.max()), abs=1e-5)


@pytest.mark.parametrize("checkpoint", [c for c in EMBEDDED
                                        if load_catalog()[c]["task"] == "text-generation"])
def test_embedded_text_checkpoint_pipeline(checkpoint, no_network):
    directory = str(resolve(checkpoint))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    pipe = transformers.pipeline("text-generation", model=directory)
    prompt = "The for statement"
    text = pipe(prompt, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert text == tokenizer.decode(greedy[0], skip_special_tokens=True)
