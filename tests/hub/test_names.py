"""One name per model (hub id = published name, timm's derived from it), no aliases, did-you-mean on unknown
names."""

from __future__ import annotations

import pytest
import timm
import torch

import deqzoo
from deqzoo.factory import canonical_name, did_you_mean, model_names
from deqzoo.hub.catalog import load_catalog
from deqzoo.hub.loading import resolve
from deqzoo.integrations.timm import TIMM_MODELS
from deqzoo.models.registry import model_names_table


def test_every_embedded_checkpoint_has_one_canonical_name():
    assert {f"deqzoo/{n}" for n in model_names_table()} == set(load_catalog())
    for row in model_names():
        assert set(row) == {"name", "hub_id", "preset", "timm"}  # no aliases
        assert canonical_name(row["hub_id"]) == row["name"]
        if row["timm"]:
            assert row["timm"] == row["name"].replace("-", "_")
            assert TIMM_MODELS[row["timm"]][1] == row["hub_id"]


@pytest.mark.parametrize("row", model_names(), ids=lambda r: r["name"])
def test_canonical_name_builds_the_checkpoints_architecture(row):
    """create_model(<canonical name>) has exactly the parameter names and shapes of the published weights."""
    from safetensors import safe_open

    if row["preset"] is None:
        pytest.skip(f"{row['hub_id']} is a diffusers repository (diffusers builds its UNet from its config)")
    model = deqzoo.create_model(row["name"])
    with safe_open(str(resolve(row["hub_id"]) / "model.safetensors"), "pt") as f:
        published = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == published


def test_the_name_and_its_timm_spelling_load_the_same_model_and_old_aliases_name_the_new_name():
    ref = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").eval()
    bare = deqzoo.from_pretrained("mdeq-tiny-mnist").eval()  # the hub id's short name
    x = torch.randn(1, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(ref(x).logits, bare(x).logits)
    row = next(r for r in model_names() if r["hub_id"] == "deqzoo/lipschitz-mdeq-tiny-mnist")
    assert row["timm"] == "lipschitz_mdeq_tiny_mnist"  # the one derivation of the timm name
    net = timm.create_model(row["timm"], pretrained=True).eval()
    lip = deqzoo.from_pretrained("lipschitz-mdeq-tiny-mnist").eval()
    with torch.no_grad():
        assert torch.allclose(net(x), lip(x).logits, atol=1e-6)
    # the spellings that were aliases before 0.1.0 are refused, naming the model's one name
    with pytest.raises(Exception, match="Did you mean 'lipschitz-mdeq-tiny-mnist'"):
        deqzoo.from_pretrained("mdeq-lipschitz-tiny-mnist")
    with pytest.raises(Exception, match=r"'mdeq-cifar-tiny' is an architecture preset without published "
                                        r"weights: deqzoo.create_model\('mdeq-cifar-tiny'\)"):
        deqzoo.from_pretrained("mdeq-cifar-tiny")
    assert "mdeq_lipschitz_tiny_mnist" not in TIMM_MODELS


def test_did_you_mean_on_unknown_names(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "'mdeq-tiny-mnist'" in did_you_mean("mdeq-tiny-mnst")
    assert did_you_mean("completely-unrelated-zzz") == ""
    with pytest.raises(ValueError, match="Did you mean 'mdeq-tiny-mnist'"):
        deqzoo.create_model("mdeq-tiny-mnst")
    with pytest.raises(ValueError, match="Did you mean 'mdeq-cifar-tiny'"):
        deqzoo.create_model("mdeq-cifar-tin")
    with pytest.raises(Exception, match="Did you mean 'ignn-chains'"):
        deqzoo.from_pretrained("deqzoo/ignn-chain")
    with pytest.raises(Exception, match="Did you mean 'mdeq-tiny-mnist'"):  # a timm spelling
        deqzoo.from_pretrained("mdeq_tiny_mnst")


def test_hub_guide_lists_the_name_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "hub.md").read_text(encoding="utf-8")
    lines = {line.split("|")[1].strip(): line for line in readme.splitlines() if line.startswith("| ")}
    for row in model_names():
        cells = [c.strip() for c in lines[row["name"]].split("|")[1:-1]]
        assert cells[:3] == [row["name"], row["hub_id"], row["timm"] or ""], cells
