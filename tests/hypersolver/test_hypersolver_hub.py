"""Hypersolvers as hub artifacts: attach/remove, wrong model, corrupted files, other shapes, gradients."""

import json
import shutil

import pytest
import torch

import deqzoo
from deqzoo.core.solvers import anderson
from deqzoo.hub import resolve
from deqzoo.hypersolver import (
    HyperSolver,
    HyperSolverConfig,
    HyperSolverError,
    load_hypersolver,
    model_fingerprint,
    save_hypersolver,
    set_hypersolver,
)
from deqzoo.hypersolver.attach import HyperDEQ
from examples.hypersolver._problems import default_config

MDEQ, MDEQ_HS = "deqzoo/mdeq-tiny-mnist", "deqzoo/hyperdeq-mdeq-tiny-mnist"
LM, LM_HS = "deqzoo/deq-transformer-tiny-pydoc", "deqzoo/hyperdeq-deq-transformer-tiny-pydoc"


def _pixels(n=4, size=28, seed=0):
    from examples.mdeq import mnist

    x, _ = mnist.load_split("test")
    pixels = mnist.to_pixel_values(x[:n], deqzoo.from_pretrained(MDEQ))
    if size != 28:
        pixels = torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear")
    return pixels


def _with_hyperanderson(model, hs_id):
    """Attach a published hypersolver's HyperAnderson part (they ship `use="initializer"`)."""
    return set_hypersolver(model, load_hypersolver(hs_id), use="hyperanderson")


def test_attach_and_remove_keep_the_model():
    model = _with_hyperanderson(deqzoo.from_pretrained(MDEQ), MDEQ_HS).eval()
    keys = set(model.state_dict())
    assert model.hypersolver is not None and isinstance(model.mdeq.deq, HyperDEQ)
    pixels = _pixels()
    with torch.no_grad():
        out = model(pixels)
    assert out.deq_stats.solver == "hyperanderson" and out.deq_stats.converged.all()
    assert set(model.state_dict()) == keys  # the hypersolver is not part of the checkpoint
    model.remove_hypersolver()
    assert model.hypersolver is None
    with torch.no_grad():
        plain = model(pixels)
    assert plain.deq_stats.solver == "anderson"
    # both answer the same equilibrium (to the tolerance): same predictions
    assert torch.equal(out.logits.argmax(-1), plain.logits.argmax(-1))
    # solver settings still apply: the budget is config.deq's
    _with_hyperanderson(model, MDEQ_HS)
    model.set_deq(f_max_iter=3, on_nonconvergence="ignore")
    with torch.no_grad():
        short = model(pixels)
    assert short.deq_stats.nfe == 3 and short.deq_stats.solver == "hyperanderson"


def test_wrong_model_is_a_clear_error_naming_both():
    other = deqzoo.from_pretrained("deqzoo/lipschitz-mdeq-tiny-mnist")  # same family, other weights
    with pytest.raises(HyperSolverError) as err:
        other.set_hypersolver(MDEQ_HS)
    assert "mdeq-tiny-mnist" in str(err.value) and "lipschitz-mdeq-tiny-mnist" in str(err.value)
    lm = deqzoo.from_pretrained(LM)
    with pytest.raises(HyperSolverError, match="deq-transformer-tiny-pydoc"):
        lm.set_hypersolver(MDEQ_HS)
    # skipping the fingerprint check cannot attach a hypersolver of another state layout
    with pytest.raises(ValueError, match="multires"):
        lm.set_hypersolver(MDEQ_HS, check=False)
    cifar = deqzoo.create_model("mdeq-cifar-tiny")  # 3 channels, other widths
    cifar.set_hypersolver(MDEQ_HS, check=False)
    with (
        pytest.raises(ValueError, match=r"hypersolver .* needs .* this model's state has shapes"),
        torch.no_grad(),
    ):
        cifar(torch.randn(1, 3, 32, 32))


def test_corrupted_and_invalid_files(tmp_path):
    src = resolve(MDEQ_HS)
    bad = tmp_path / "hs"
    shutil.copytree(src, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(HyperSolverError, match=r"model.safetensors: sha256 .* does not match"):
        load_hypersolver(bad)
    model = deqzoo.from_pretrained(MDEQ)
    with pytest.raises(HyperSolverError, match="corrupted"):
        model.set_hypersolver(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)  # not safetensors, with a matching digest
    cfg = json.loads((bad / "config.json").read_text())
    import hashlib

    cfg["training"]["weights_sha256"] = hashlib.sha256(b"\x00" * 16).hexdigest()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HyperSolverError, match="model.safetensors: corrupt safetensors"):
        load_hypersolver(bad)
    cfg["model_type"] = "mdeq"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HyperSolverError, match="'model_type' must be 'hypersolver'"):
        load_hypersolver(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(HyperSolverError, match="config.json: malformed JSON"):
        load_hypersolver(bad)
    with pytest.raises(HyperSolverError, match="hypersolver 'deqzoo/hyperdeq-nothing': .* is not embedded"):
        load_hypersolver("deqzoo/hyperdeq-nothing")


def test_save_load_round_trip(tmp_path):
    model = deqzoo.create_model("mdeq-tiny-mnist")
    hs = HyperSolver(default_config(model, "mine", alpha_base="anderson"))
    for p in hs.parameters():
        p.data.normal_()
    save_hypersolver(hs, tmp_path / "hs")
    (tmp_path / "hs" / "README.md").write_text("card")
    save_hypersolver(hs, tmp_path / "hs")  # saving again keeps other files
    assert (tmp_path / "hs" / "README.md").read_text() == "card"
    back = load_hypersolver(tmp_path / "hs")
    assert back.config.model_fingerprint == model_fingerprint(model)
    for (k, a), (_, b) in zip(hs.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    model.set_hypersolver(back)  # fingerprint matches
    assert model.hypersolver is back


def test_save_refuses_a_model_checkpoint_folder(tmp_path):
    """--out pointing at a model's own folder must not replace the model's config.json/model.safetensors."""
    model = deqzoo.create_model("mdeq-tiny-mnist")
    model.save_pretrained(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir() if p.is_file()}
    hs = HyperSolver(default_config(model, "mine", alpha_base="anderson"))
    with pytest.raises(HyperSolverError, match="not a hypersolver"):
        save_hypersolver(hs, tmp_path / "model")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir() if p.is_file()} == before


def test_solving_with_the_hypersolver_leaves_the_layer_config_alone():
    """The hypersolver's settings are per call: while f runs, the layer's config is still the model's own
    (another thread using the model at that moment sees the model's settings, not a half-swapped config)."""
    model = _with_hyperanderson(deqzoo.from_pretrained(MDEQ), MDEQ_HS).eval()
    layer = model.mdeq.deq
    seen = []
    hook = model.mdeq.register_forward_pre_hook(lambda *_: seen.append(layer.config.f_solver))
    original = layer.config
    inner = layer.solve_with

    def spy(cfg, f, z0):
        return inner(cfg, lambda z: (seen.append(layer.config.f_solver), f(z))[1], z0)

    layer.solve_with = spy
    with torch.no_grad():
        out = model(_pixels(n=2))
    hook.remove()
    assert out.deq_stats.solver == "hyperanderson"
    assert layer.config is original and set(seen) == {"anderson"} and len(seen) > 2


def test_larger_image_solves():
    """The compressors and initializer are shape-agnostic: a 40x40 image (trained on 28x28) solves."""
    model = _with_hyperanderson(deqzoo.from_pretrained(MDEQ, deq={"f_max_iter": 40}), MDEQ_HS).eval()
    with torch.no_grad():
        out = model(_pixels(n=3, size=40))
    stats = out.deq_stats
    assert out.logits.shape == (3, 10) and stats.solver == "hyperanderson"
    assert stats.converged.all() and float(stats.rel_residual.max()) < 1e-3


def test_longer_sequence_solves():
    """A 128-token input (trained on 64-token chunks) solves with the sequence hypersolver."""
    model = _with_hyperanderson(deqzoo.from_pretrained(LM, deq={"f_max_iter": 60}), LM_HS).eval()
    model.set_deq(on_nonconvergence="ignore")
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    stats = out.deq_stats
    assert out.logits.shape == (1, 128, model.config.vocab_size) and stats.solver == "hyperanderson"
    assert torch.isfinite(stats.rel_residual).all() and float(stats.rel_residual.max()) < 1e-2


def test_model_trains_with_the_hypersolver_float64():
    """IFT gradients of the MDEQ's parameters with the hypersolver equal those with Anderson (1e-4)."""
    model = deqzoo.from_pretrained(MDEQ).double().eval()
    model.set_deq(f_max_iter=120, f_tol=1e-11, b_max_iter=120, b_tol=1e-11, on_nonconvergence="raise")
    pixels, labels = _pixels(n=2).double(), torch.tensor([3, 7])
    grads = {}
    for name in ("anderson", "hyper"):
        if name == "hyper":
            _with_hyperanderson(model, MDEQ_HS)
        model.zero_grad()
        out = model(pixels, labels=labels)
        assert out.deq_stats.solver == ("hyperanderson" if name == "hyper" else "anderson")
        out.loss.backward()
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert grads["anderson"].keys() == grads["hyper"].keys() and len(grads["hyper"]) > 10
    a = torch.cat([g.flatten() for g in grads["anderson"].values()])
    h = torch.cat([g.flatten() for g in grads["hyper"].values()])
    assert float(torch.linalg.vector_norm(a - h) / torch.linalg.vector_norm(a)) < 1e-4


def test_base_anderson_with_zero_correction_is_anderson():
    """alpha_base="anderson" with an untrained network (correction 0, β = 1) takes Anderson's steps."""
    cfg = HyperSolverConfig(state_kind="vector", pool=4, alpha_base="anderson", m=5)
    net = HyperSolver(cfg).double().bind([(3, 24)])
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 24, generator=g, dtype=torch.float64) * 0.3
    x = torch.randn(3, 24, generator=g, dtype=torch.float64)
    f = lambda z: torch.tanh(z @ W.T + x)  # noqa: E731
    from deqzoo.core.solvers import hyperanderson

    x0 = torch.zeros(3, 24, dtype=torch.float64)
    za, sa = anderson(f, x0, max_iter=12, tol=1e-14, m=6)
    zh, sh = hyperanderson(f, x0, max_iter=12, tol=1e-14, m=5, net=net, base="anderson")
    torch.testing.assert_close(sh.trace, sa.trace, rtol=1e-7, atol=1e-13)
    torch.testing.assert_close(zh, za, rtol=1e-7, atol=1e-12)


def test_published_hypersolvers_ship_the_initializer_with_the_models_own_solver():
    """`use="initializer"` (what the published cards ship): the solve is the model's own DEQ solve (same
    solver, budget and tolerance) started from h_φ(injection), step for step (reference: the engine's solver
    called directly on the recorded problem from `initial_flat`)."""
    from examples.hypersolver._problems import initial_flat, record_problems

    hs = load_hypersolver(MDEQ_HS)
    assert hs.config.use == "initializer" and load_hypersolver(LM_HS).config.use == "initializer"
    model = deqzoo.from_pretrained(MDEQ, hypersolver=MDEQ_HS).eval()
    assert isinstance(model.mdeq.deq, HyperDEQ) and model.mdeq.deq.use == "initializer"
    pixels = _pixels(n=6)
    with torch.no_grad():
        out = model(pixels)
    cfg = model.config.deq_config
    assert out.deq_stats.solver == cfg.f_solver == "anderson"
    plain = deqzoo.from_pretrained(MDEQ).eval()
    with torch.no_grad(), record_problems(plain) as problems:
        ref_out = plain(pixels)
    p = problems[0]
    with torch.no_grad():
        z, stats = anderson(p.g, initial_flat(hs, p), max_iter=cfg.f_max_iter, tol=cfg.f_tol, stop_mode="rel")
    assert out.deq_stats.nfe == stats.nfe < ref_out.deq_stats.nfe  # it starts nearer: fewer evaluations
    torch.testing.assert_close(out.deq_stats.trace, stats.trace, rtol=1e-4, atol=1e-7)
    assert bool(out.deq_stats.converged.all())
    assert torch.equal(out.logits.argmax(-1), ref_out.logits.argmax(-1))


def test_use_override_and_old_configs(tmp_path):
    """A config without ``use`` (saved before the key existed) loads as HyperAnderson, as it ran then;
    ``use`` is validated, and an initializer-only use of a hypersolver without h_φ is refused."""
    old = tmp_path / "old"
    shutil.copytree(resolve(MDEQ_HS), old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["use"]
    (old / "config.json").write_text(json.dumps(cfg))
    model = deqzoo.from_pretrained(MDEQ, hypersolver=old).eval()
    assert model.mdeq.deq.use == "hyperanderson"
    with torch.no_grad():
        assert model(_pixels(n=2)).deq_stats.solver == "hyperanderson"
    set_hypersolver(model, load_hypersolver(old), use="initializer")
    assert model.mdeq.deq.use == "initializer"
    with pytest.raises(ValueError, match="use must be one of"):
        set_hypersolver(model, load_hypersolver(old), use="fast")
    cfg["use"] = "fast"
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HyperSolverError, match="use"):
        load_hypersolver(old)
    vector = HyperSolver(HyperSolverConfig(state_kind="vector", pool=4, use="initializer"))
    with pytest.raises(ValueError, match="has no initializer"):
        set_hypersolver(deqzoo.create_model("mdeq-tiny-mnist"), vector, check=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [28, 40, 17])
def test_fast_image_initializer_equals_the_convolutions(dtype, size):
    """h_φ for image maps (channels-last, pooling skipped at the injection's size, the 1x1 projection as a
    matrix product) equals the plain NCHW formula: depthwise 3x3 conv, ReLU, adaptive pooling, 1x1 conv."""
    import torch.nn.functional as F

    hs = load_hypersolver(MDEQ_HS).to(dtype)
    torch.manual_seed(0)
    x = torch.randn(3, 16, size, size, dtype=dtype)
    shapes = [(3, 16, size, size), (3, 16, (size + 1) // 2, (size + 1) // 2)]
    got = hs.initial_state(x, shapes)
    h = F.relu(F.conv2d(x, hs.init_conv.weight, hs.init_conv.bias, padding=1, groups=16))
    want = [F.conv2d(F.adaptive_avg_pool2d(h, s[-2:]), proj.weight, proj.bias)
            for proj, s in zip(hs.init_proj, shapes)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        torch.testing.assert_close(g, w, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                                   atol=1e-6 if dtype == torch.float32 else 1e-13)


def test_the_model_method_passes_use_through():
    model = deqzoo.from_pretrained(MDEQ).eval()
    assert model.set_hypersolver(MDEQ_HS).mdeq.deq.use == "initializer"  # what the published config ships
    with torch.no_grad():
        assert model(_pixels(n=2)).deq_stats.solver == "anderson"
    assert model.set_hypersolver(MDEQ_HS, use="hyperanderson").mdeq.deq.use == "hyperanderson"
    with torch.no_grad():
        assert model(_pixels(n=2)).deq_stats.solver == "hyperanderson"
