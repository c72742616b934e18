"""MDEQ model tests: original parameter counts, keys, shapes, determinism, gradients, solver knobs, I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

import deqzoo
from conversion import converter_module
from deqzoo.models.mdeq import (
    ARCHITECTURES,
    MDEQConfig,
    MDEQForImageClassification,
    MDEQModel,
)

torch.set_num_threads(1)


def tiny_config(**overrides) -> MDEQConfig:
    kwargs = dict(ARCHITECTURES["mdeq-tiny-mnist"]["config"])
    kwargs.update(overrides)
    return MDEQConfig(**kwargs)


# Trainable parameter counts of the original implementation (locuslab/deq MDEQ-Vision MDEQClsNet and
# MDEQSegNet built from each preset's yaml; weight norm counted as weight_g + weight_v), measured with their
# provenance in the conversion fixture. The paper (Bai et al. 2020, Tables 1-3) rounds them as 170K / 10M
# (CIFAR), 18M / 63M / 81M (ImageNet), 7.8M / 53M / 70M (Cityscapes).
_COUNTS = Path(__file__).resolve().parents[3] / "conversion/fixtures/mdeq/original_param_counts.json"
ORIGINAL_PARAMETER_COUNTS = {name: entry["parameters"] for name, entry in
                             json.loads(_COUNTS.read_text())["locuslab/deq MDEQ-Vision"]["configs"].items()}


@pytest.mark.parametrize("preset", sorted(ORIGINAL_PARAMETER_COUNTS))
def test_parameter_count_equals_original(preset):
    with torch.device("meta"):
        model = deqzoo.create_model(preset)
    assert sum(p.numel() for p in model.parameters()) == ORIGINAL_PARAMETER_COUNTS[preset]


def test_state_dict_keys_follow_the_original_structure():
    with torch.device("meta"):
        model = deqzoo.create_model("mdeq-imagenet-small")
    keys = set(model.state_dict())
    # a sample of the original's keys (locuslab/deq MDEQ-Vision MDEQClsNet), mapped by the converter's key map
    original = [
        "downsample.0.weight",
        "downsample.1.running_var",
        "stage0.0.weight",
        "fullstage.branches.0.blocks.0.conv1.weight_g",
        "fullstage.branches.0.blocks.0.conv1.weight_v",
        "fullstage.branches.3.blocks.0.gn3.bias",
        "fullstage.fuse_layers.3.0.net.2.conv.weight",
        "fullstage.fuse_layers.0.3.net.conv.weight",
        "fullstage.post_fuse_layers.2.conv.weight_v",
        "fullstage.post_fuse_layers.2.gnorm.weight",
        "incre_modules.0.0.conv1.weight",
        "incre_modules.0.0.downsample.1.running_mean",
        "downsamp_modules.2.0.bias",
        "final_layer.1.weight",
        "classifier.weight",
        "fullstage_copy.branches.0.blocks.0.gn1.weight",
    ]
    converter = converter_module("mdeq_locuslab")
    entries = converter.key_map(sorted(keys), original)
    found = {source for e in entries if e.transform != "missing" for source in e.sources}
    kept = [k for k in original if not k.startswith(converter.DROPPED)]
    assert kept == original[:-1]  # the 2020 release's frozen copy of f_θ is dropped
    assert set(kept) <= found, sorted(set(kept) - found)
    assert not any(k.startswith("mdeq.deq") for k in keys)  # the engine holds no state


def test_shapes_all_heads():
    cfg = tiny_config()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        base = MDEQModel(cfg).eval()(x, output_hidden_states=True)
        assert [tuple(h.shape) for h in base.hidden_states] == [(2, 16, 14, 14), (2, 16, 7, 7)]
        assert base.last_hidden_state is base.hidden_states[0]
        cls = MDEQForImageClassification(cfg).eval()(x)
        assert cls.logits.shape == (2, 10) and cls.deq_stats.nfe >= 1
        seg_model = deqzoo.models.mdeq.MDEQForSemanticSegmentation(tiny_config(num_labels=3)).eval()
        seg = seg_model(x, labels=torch.randint(0, 3, (2, 28, 28)))
        assert seg.logits.shape == (2, 3, 14, 14) and torch.isfinite(seg.loss)


def test_four_resolution_original_layout_runs():
    model = deqzoo.create_model("mdeq-cifar-large", deq={"f_max_iter": 2, "f_solver": "fixed_point"}).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32), output_hidden_states=True)
    assert [h.shape[1:] for h in out.hidden_states] == [(32, 32, 32), (64, 16, 16), (128, 8, 8), (256, 4, 4)]
    assert out.deq_stats.nfe == 2


def test_eval_is_deterministic_and_dropout_is_variational():
    torch.manual_seed(0)
    model = MDEQForImageClassification(tiny_config(dropout=0.3)).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        a, b = model(x).logits, model(x).logits
    assert torch.equal(a, b)
    model.train()
    drops = [m for m in model.modules() if type(m).__name__ == "VariationalDropout"]
    assert drops and all(d.p == 0.3 and d.shared_dims == (2, 3) for d in drops)
    with torch.no_grad():
        model(x)
        masks = [d.mask.clone() for d in drops]
        model(x)  # a new forward draws new masks (reset_dropout at the start of forward)
    assert any(not torch.equal(m, d.mask) for m, d in zip(masks, drops))


def test_gradients_reach_stem_f_and_head():
    torch.manual_seed(0)
    model = MDEQForImageClassification(tiny_config()).train()
    out = model(torch.randn(4, 1, 28, 28), labels=torch.tensor([0, 1, 2, 3]))
    out.loss.backward()
    named = dict(model.named_parameters())
    for key in [
        "mdeq.downsample.0.weight",
        "mdeq.stage0.0.weight",
        "mdeq.fullstage.branches.0.blocks.0.conv1.weight_v",
        "mdeq.fullstage.branches.1.blocks.0.conv2.weight_g",
        "mdeq.fullstage.fuse_layers.0.1.net.conv.weight",
        "mdeq.fullstage.post_fuse_layers.1.conv.weight_v",
        "incre_modules.1.0.conv1.weight",
        "classifier.weight",
    ]:
        g = named[key].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, key


def test_ift_gradient_matches_autograd_through_unrolled_iterations():
    # the Lipschitz f is a contraction (bound < 1): 80 plain iterations reach the fixed point to ~1e-12, so
    # autograd through them is an independent reference for the engine's implicit gradient through our forward
    torch.manual_seed(0)
    cfg = tiny_config(
        lipschitz=True,
        wnorm=False,
        spectral_fft_size=32,
        deq={
            "f_solver": "anderson",
            "f_max_iter": 200,
            "f_tol": 1e-11,
            "f_stop_mode": "abs",
            "b_mode": "ift",
            "b_solver": "anderson",
            "b_max_iter": 200,
            "b_tol": 1e-11,
            "b_stop_mode": "abs",
        },
    )
    model = MDEQForImageClassification(cfg).double().train()
    model.mdeq.fullstage.fuse_logits.data.normal_()
    for m in model.modules():  # BatchNorm in eval mode so both passes see identical stem/head functions
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    y = torch.tensor([3, 7])
    model.zero_grad()
    model(x, labels=y).loss.backward()
    implicit = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    m = model.mdeq
    stem = m.downsample(x)
    inj = [m.stage0(stem)] + [None]
    zs = tuple(stem.new_zeros(2, *s) for s in m.state_shapes(14, 14))
    for _ in range(80):
        zs = m.fullstage(zs, inj)
    torch.nn.functional.cross_entropy(model.classify(zs), y).backward()
    for k, g in implicit.items():
        ref = dict(model.named_parameters())[k].grad
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-9), (k, (g - ref).abs().max())


def test_set_deq_changes_the_solver():
    model = MDEQForImageClassification(tiny_config()).eval()
    model.set_deq(f_solver="fixed_point", f_max_iter=3)
    with torch.no_grad():
        stats = model(torch.randn(1, 1, 28, 28)).deq_stats
    assert stats.solver == "fixed_point" and stats.nfe == 3
    assert model.config.deq["f_max_iter"] == 3


def test_save_load_round_trip_with_auto_classes(tmp_path):
    torch.manual_seed(0)
    model = MDEQForImageClassification(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    __import__("deqzoo").register()  # stock transformers code: families registered explicitly
    assert AutoConfig.from_pretrained(tmp_path).model_type == "mdeq"
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is MDEQForImageClassification
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    model.mdeq.save_pretrained(tmp_path / "backbone")
    base = AutoModel.from_pretrained(tmp_path / "backbone").eval()
    assert type(base) is MDEQModel
    with torch.no_grad():
        assert torch.equal(base(x, output_hidden_states=True).hidden_states[1],
                           model.mdeq(x, output_hidden_states=True).hidden_states[1])
    changed = deqzoo.from_pretrained(tmp_path, deq={"f_max_iter": 5})
    assert changed.mdeq.deq.config.f_max_iter == 5


def test_bad_inputs_raise_clear_errors():
    model = MDEQForImageClassification(tiny_config()).eval()
    with pytest.raises(ValueError, match=r"\(batch, 1, H, W\).*\(2, 3, 28, 28\)"):
        model(torch.randn(2, 3, 28, 28))
    with pytest.raises(ValueError, match="num_blocks"):
        MDEQConfig(branch_channels=[16, 32], num_blocks=[1])
    with pytest.raises(ValueError, match="divisible"):
        MDEQConfig(branch_channels=[10, 20], num_groups=4)
    with pytest.raises(ValueError, match="wnorm=False"):
        tiny_config(lipschitz=True)


def test_jacobian_regularizer_is_added_to_the_training_loss():
    torch.manual_seed(0)
    cfg = tiny_config(
        jac_loss_weight=0.5, deq={**ARCHITECTURES["mdeq-tiny-mnist"]["config"]["deq"], "jac_reg_samples": 1}
    )
    model = MDEQForImageClassification(cfg).train()
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([1, 2])
    out = model(x, labels=y)
    jac = out.deq_stats.jac_loss
    assert jac is not None and jac.requires_grad and float(jac) > 0
    ce = torch.nn.functional.cross_entropy(out.logits, y)
    assert torch.allclose(out.loss, ce + 0.5 * jac)
    out.loss.backward()
    assert model.mdeq.fullstage.branches[0].blocks[0].conv1.weight_v.grad is not None
