"""timm integration: registered names, features_only (one map per resolution), pretrained loading offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

import deqzoo
from deqzoo.integrations.timm import TIMM_MODELS

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]


def test_models_are_registered_with_pretrained_tags_each_listed_once():
    assert set(timm.list_models("*mdeq*")) == set(TIMM_MODELS)
    # one name per model: each published model under its name's timm spelling, no alias
    assert sorted(timm.list_models("*mdeq*", pretrained=True)) == [
        "lipschitz_mdeq_tiny_mnist.deqzoo",
        "mdeq_tiny_mnist.deqzoo",
        "mdeq_tiny_mnist_reversible.deqzoo",
    ]
    with pytest.raises(RuntimeError, match="Unknown model"):  # the first spelling, an alias before 0.1.0
        timm.create_model("mdeq_lipschitz_tiny_mnist", pretrained=True)
    cfg = timm.models.get_pretrained_cfg("mdeq_tiny_mnist")
    assert cfg.hf_hub_id == "deqzoo/mdeq-tiny-mnist" and cfg.input_size == (1, 28, 28)


def test_features_only_one_map_per_resolution_with_channels_and_strides():
    net = timm.create_model("mdeq_cifar_large", features_only=True, deq={"f_max_iter": 2})
    assert net.model.config.deq["f_solver"] == "broyden"  # the preset's solver, with the override merged
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


def test_timm_model_solves_once_per_call():
    """forward, forward_features and forward_intermediates (features_only) each run the DEQ solve exactly
    once; the timm class's results equal the transformers class's on the same weights."""
    net = timm.create_model("mdeq_tiny_mnist", pretrained=True).eval()
    model = deqzoo.from_pretrained("mdeq-tiny-mnist").eval()
    solves = []
    net.mdeq.deq.register_forward_hook(lambda *_: solves.append(1))
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
    assert len(solves) == 1


def test_timm_native_class_meets_timms_own_expectations(tmp_path):
    """The timm entry point is MDEQForImageClassification itself with timm's conventions, not a wrapper:
    the embedded checkpoint's keys are its keys (timm's own `load_checkpoint` reads the safetensors file into
    it), forward returns the logits tensor equal to the transformers class's, `forward_head(pre_logits=True)`
    is that class's pooled feature, `reset_classifier` follows timm (0: the pooled features), `pretrained_cfg`
    / `default_cfg` are timm's, and a saved one loads back as the same class (transformers' Auto class reads
    it as the plain head)."""
    import transformers
    from safetensors.torch import save_file
    from timm.models import load_checkpoint

    from deqzoo.hub.loading import resolve
    from deqzoo.integrations.timm import MDEQTimm
    from deqzoo.models.mdeq import MDEQForImageClassification

    ref = deqzoo.from_pretrained("mdeq-tiny-mnist").eval()
    net = timm.create_model("mdeq_tiny_mnist", pretrained=True).eval()
    assert type(net) is MDEQTimm and isinstance(net, MDEQForImageClassification)
    assert net.pretrained_cfg["hf_hub_id"] == "deqzoo/mdeq-tiny-mnist"
    assert net.default_cfg == net.pretrained_cfg and net.pretrained_cfg["classifier"] == "classifier"
    assert isinstance(net.get_submodule("classifier"), torch.nn.Linear)
    assert net.get_submodule(net.pretrained_cfg["first_conv"]).in_channels == net.in_chans == 1
    fresh = timm.create_model("mdeq_tiny_mnist").eval()
    load_checkpoint(fresh, str(resolve("deqzoo/mdeq-tiny-mnist") / "model.safetensors"))  # timm's loader
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        logits = net(x)
        assert isinstance(logits, torch.Tensor) and logits.shape == (3, net.num_classes) == (3, 10)
        assert torch.equal(logits, ref(x).logits) and torch.equal(fresh(x), logits)
        pooled = net.forward_head(net.forward_features(x), pre_logits=True)
        assert pooled.shape == (3, net.num_features) == (3, ref.config.final_chansize)
        torch.testing.assert_close(pooled, ref.forward_head(ref.forward_features(x), pre_logits=True))
        torch.testing.assert_close(ref.classifier(pooled), logits)
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "timm.safetensors")
        again = timm.create_model("mdeq_tiny_mnist", pretrained=True,  # timm's state dict, no prefix
                                  pretrained_cfg_overlay=dict(file=str(tmp_path / "timm.safetensors")))
        assert torch.equal(again.eval()(x), logits)
        net.reset_classifier(0)  # timm: no head, forward gives the pooled features
        assert net.num_classes == 0 and isinstance(net.get_classifier(), torch.nn.Identity)
        torch.testing.assert_close(net(x), pooled)
        net.reset_classifier(4)
        assert net(x).shape == (3, 4) and net.config.num_labels == 4
    net.save_pretrained(tmp_path / "saved")
    deqzoo.register()  # transformers' Auto classes know the family
    back = deqzoo.from_pretrained(tmp_path / "saved").eval()
    auto = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "saved").eval()
    assert type(back) is MDEQTimm and type(auto) is MDEQForImageClassification
    with torch.no_grad():
        assert torch.equal(back(x), net.eval()(x)) and torch.equal(auto(x).logits, back(x))


def _stratified_held_out(per_class: int = 20):
    """The first `per_class` held-out digits of each class (the split is ordered by class, 100 each)."""
    import numpy as np

    from examples.mdeq.mnist import load_split

    x, y = load_split("test")
    keep = np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(10)])
    return x[keep], y[keep]


def test_rgb_images_through_timms_own_transform_classify_as_the_originals():
    """issue 31: an RGB PIL image through timm's create_transform(resolve_data_config(model)) gives 3 channels
    normalized with the model's one mean/std; the 1-channel model takes them as luminance. On 200 held-out
    digits (20 per class) given as RGB, accuracy is within 1 point of the originals' through the deqzoo image
    processor (the card's path), and each RGB batch equals the processor's "L" conversion."""
    from PIL import Image

    from examples.mdeq.mnist import to_pixel_values

    _ = deqzoo.register()
    net = timm.create_model("mdeq_tiny_mnist", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=net))
    images, labels = _stratified_held_out()
    rgb = torch.stack([transform(Image.fromarray(im, mode="L").convert("RGB")) for im in images])
    assert rgb.shape == (200, 3, 28, 28)
    reference = to_pixel_values(images, net)  # the image processor on the originals
    torch.testing.assert_close(net._pixels(rgb), reference, atol=1e-5, rtol=0)
    with torch.no_grad():
        acc_rgb = float((net(rgb).argmax(1) == torch.as_tensor(labels)).float().mean())
        acc_ref = float((net(reference).argmax(1) == torch.as_tensor(labels)).float().mean())
    assert abs(acc_rgb - acc_ref) <= 0.01 and acc_ref >= 0.95, (acc_rgb, acc_ref)
    # a coloured image: timm's path equals the image processor's conversion (PIL's "L", no inversion)
    # within its 8-bit rounding
    from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor

    g = torch.Generator().manual_seed(0)
    colour = torch.randint(0, 256, (28, 28, 3), generator=g, dtype=torch.uint8).numpy()
    pil = Image.fromarray(colour, mode="RGB")
    std = net.config.image_std[0]
    processor = MDEQImageProcessor.from_pretrained(ROOT / "model_cards" / "mdeq-tiny-mnist")
    gray = processor(pil, do_invert=False, return_tensors="pt")["pixel_values"]
    assert gray.shape == (1, 1, 28, 28)
    diff = net._pixels(transform(pil)[None]) - gray
    assert float(diff.abs().max()) <= 0.5 / 255 / std + 1e-5
    with pytest.raises(ValueError, match=r"\(batch, 1, H, W\)"):  # two channels are not an image mode here
        net(torch.zeros(1, 2, 28, 28))
    features = timm.create_model("mdeq_tiny_mnist", pretrained=True, features_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(features(rgb[:4]), features(reference[:4]), atol=1e-4, rtol=0)


def _train_step(net, x, y):
    net.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def test_grad_checkpointing_recomputes_the_head_with_the_same_gradients_and_statistics():
    """timm's set_grad_checkpointing(): the head (fusion + final layer) runs again in the backward pass
    instead of keeping its activations; gradients equal those without checkpointing (the reference), and the
    batch norms' running statistics are updated once per step, as without it."""
    _ = deqzoo.register()
    torch.manual_seed(0)
    plain = timm.create_model("mdeq_tiny_mnist", pretrained=True).train()
    ckpt = timm.create_model("mdeq_tiny_mnist", pretrained=True).train()
    assert ckpt.set_grad_checkpointing() is None and ckpt.grad_checkpointing
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 3, 7, 9])
    head_runs = []
    # a pre-hook: the recomputation stops once the saved tensors are recomputed, before forward hooks
    ckpt.final_layer.register_forward_pre_hook(lambda *_: head_runs.append(1))
    ref = _train_step(plain, x, y)
    got = _train_step(ckpt, x, y)
    assert len(head_runs) == 2, "the head is recomputed in the backward pass"
    assert ref.keys() == got.keys() and len(ref) > 0
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-5, msg=name)
    for (name, a), b in zip(plain.named_buffers(), ckpt.buffers()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    ckpt.set_grad_checkpointing(False)
    head_runs.clear()
    _train_step(ckpt, x, y)
    assert len(head_runs) == 1
    ckpt.set_grad_checkpointing(enable=True)
    with torch.no_grad():  # inference: nothing to recompute
        head_runs.clear()
        ckpt.eval()(x)
        assert len(head_runs) == 1
