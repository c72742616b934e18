"""timm integration: registered names, features_only (one map per resolution), pretrained loading offline."""

from __future__ import annotations

import pytest
import timm
import torch

import deqzoo
from deqzoo.integrations.timm import TIMM_MODELS

torch.set_num_threads(1)


def test_models_are_registered_with_pretrained_tags_each_listed_once():
    alias = "mdeq_lipschitz_tiny_mnist"  # the first spelling of lipschitz_mdeq_tiny_mnist
    assert set(timm.list_models("*mdeq*")) == set(TIMM_MODELS) - {alias}
    # issue 31: the alias was listed as a second pretrained model; each model is listed once now
    assert sorted(timm.list_models("*mdeq*", pretrained=True)) == [
        "lipschitz_mdeq_tiny_mnist.deqzoo",  # canonical: the hub id's spelling
        "mdeq_tiny_mnist.deqzoo",
        "mdeq_tiny_mnist_reversible.deqzoo",
    ]
    with pytest.warns(UserWarning, match="deprecated"):  # the alias still creates the same model
        net = timm.create_model(alias, pretrained=True)
    reference = timm.create_model("lipschitz_mdeq_tiny_mnist", pretrained=True)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), reference.state_dict().values()))
    cfg = timm.models.get_pretrained_cfg("mdeq_tiny_mnist")
    assert cfg.hf_hub_id == "deqzoo/mdeq-tiny-mnist" and cfg.input_size == (1, 28, 28)


def test_features_only_one_map_per_resolution_with_channels_and_strides():
    net = timm.create_model("mdeq_cifar_large", features_only=True, deq={"f_max_iter": 2})
    assert (
        net.model.model.config.deq["f_solver"] == "broyden"
    )  # the preset's solver, with the override merged
    assert net.feature_info.channels() == [32, 64, 128, 256]
    assert net.feature_info.reduction() == [1, 2, 4, 8]
    feats = net(torch.randn(1, 3, 32, 32))
    assert [tuple(f.shape) for f in feats] == [
        (1, 32, 32, 32),
        (1, 64, 16, 16),
        (1, 128, 8, 8),
        (1, 256, 4, 4),
    ]
    with torch.device("meta"):  # ImageNet layout: stride-4 stem
        big = timm.create_model("mdeq_imagenet_small", features_only=True, out_indices=(1, 3))
    assert big.feature_info.channels() == [64, 256] and big.feature_info.reduction() == [8, 32]


def test_pretrained_loads_the_embedded_checkpoint_offline():
    ref = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").eval()
    x = torch.randn(2, 1, 28, 28)
    clf = timm.create_model("mdeq_tiny_mnist", pretrained=True).eval()
    feats = timm.create_model("mdeq_tiny_mnist", pretrained=True, features_only=True).eval()
    with torch.no_grad():
        out = ref(x, output_hidden_states=True)
        assert torch.allclose(clf(x), out.logits, atol=1e-6)
        got = feats(x)
    assert feats.feature_info.reduction() == [2, 4] and feats.feature_info.channels() == [16, 16]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, out.hidden_states))
    new_head = timm.create_model("mdeq_tiny_mnist", pretrained=True, num_classes=3)
    assert new_head(x).shape == (2, 3)


def test_timm_wrapper_delegates_to_the_model_and_solves_once_per_call():
    """forward_features / forward_head are MDEQForImageClassification's own; forward, forward_features and
    forward_intermediates (features_only) each run the DEQ solve exactly once."""
    net = timm.create_model("mdeq_tiny_mnist", pretrained=True).eval()
    model = net.model
    solves = []
    model.mdeq.deq.register_forward_hook(lambda *_: solves.append(1))
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        logits = net(x)
        assert len(solves) == 1
        torch.testing.assert_close(logits, model(x).logits)
        solves.clear()
        final, inter = net.forward_intermediates(x)
        assert len(solves) == 1 and len(inter) == 2
        torch.testing.assert_close(net.forward_head(final), logits)
        solves.clear()
        torch.testing.assert_close(net.forward_head(net.forward_features(x), pre_logits=True),
                                   model.forward_head(model.forward_features(x), pre_logits=True))
    assert len(solves) == 2
