"""Implicit² family: shapes, the formulas of the paper, coordinate checks, save/load, rendering."""

import math

import pytest
import torch

import deqzoo
from deqzoo.core import FixedPointCache
from deqzoo.models.implicit2 import (
    ARCHITECTURES,
    Implicit2Config,
    Implicit2ForSignalRepresentation,
    Implicit2Model,
    coordinate_grid,
)


def _model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    cfg = Implicit2Config(**{"hidden_size": 16, **kw})
    return Implicit2ForSignalRepresentation(cfg).to(dtype).eval()


@pytest.mark.parametrize("filter_type", ["siren", "fourier", "gabor"])
@pytest.mark.parametrize("implicit", [True, False])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_shapes_for_every_filter_and_coordinate_dimension(filter_type, implicit, dim):
    model = _model(filter_type=filter_type, implicit=implicit, in_features=dim, out_features=3, num_layers=2)
    coords = coordinate_grid([5] * dim)
    out = model(coords)
    assert out.values.shape == (5**dim, 3)
    assert out.last_hidden_state.shape == (1, 5**dim, 16)
    assert (out.deq_stats is not None) == implicit
    if implicit:
        assert bool(out.deq_stats.converged.all())
    batched = model(torch.stack([coords, coords.flip(0)]))
    assert batched.values.shape == (2, 5**dim, 3)
    torch.testing.assert_close(batched.values[0], out.values, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(coords).values, out.values, rtol=0, atol=0)  # deterministic


def test_isiren_fixed_point_satisfies_the_papers_formula():
    """z* = sin(W(z* + sin(V x)) + U x + b) written out by hand from the parameters (float64)."""
    model = _model(torch.float64, filter_type="siren", deq={"f_tol": 1e-12, "f_max_iter": 2000})
    x = coordinate_grid((6, 7), dtype=torch.float64)
    z = model.implicit2(x).last_hidden_state[0]
    m = model.implicit2
    v, layer = m.init_filter.x_map, m.layers[0]
    w, u = layer.z_map, layer.filter.x_map
    rhs = torch.sin(
        w.weight @ (z + torch.sin(x @ v.weight.t() + v.bias)).t()
        + w.bias[:, None]
        + (x @ u.weight.t() + u.bias).t()
    ).t()
    torch.testing.assert_close(z, rhs, rtol=0, atol=1e-10)
    values = model(x).values
    torch.testing.assert_close(values, z @ model.head.weight.t() + model.head.bias)


def test_gabor_imfn_fixed_point_and_explicit_baseline_formulas():
    """iMFN: z* = (W(z* + g₀(x)) + b) ∘ g₁(x), g = sin(Ux + c) exp(-γ/2 ||x - μ||²); explicit = f(0)."""
    imp = _model(torch.float64, filter_type="gabor", deq={"f_tol": 1e-12, "f_max_iter": 2000})
    x = coordinate_grid((5, 4), dtype=torch.float64)
    m = imp.implicit2

    def gate(filt):
        d2 = ((x[:, None, :] - filt.mu[None]) ** 2).sum(-1)
        return torch.sin(x @ filt.x_map.weight.t() + filt.x_map.bias) * torch.exp(
            -0.5 * filt.gamma.relu() * d2
        )

    g0, g1, w = gate(m.init_filter), gate(m.layers[0].filter), m.layers[0].z_map
    z = m(x).last_hidden_state[0]
    torch.testing.assert_close(z, ((z + g0) @ w.weight.t() + w.bias) * g1, rtol=0, atol=1e-10)
    exp = _model(torch.float64, filter_type="gabor", implicit=False)
    exp.load_state_dict(imp.state_dict())
    e = exp.implicit2(x).last_hidden_state[0]
    torch.testing.assert_close(e, (g0 @ w.weight.t() + w.bias) * g1)


def test_the_originals_initialisation_scales():
    model = _model(filter_type="fourier", hidden_size=256, num_layers=1, input_scale=256.0)
    layer = model.implicit2.layers[0]
    bound = math.sqrt(1 / 256)
    assert float(layer.z_map.weight.abs().max()) <= bound
    # U ~ U(±1/sqrt(d)) · 256 / sqrt(L + 1)
    assert float(layer.filter.x_map.weight.abs().max()) <= 256 / math.sqrt(2) / math.sqrt(2) + 1e-4
    assert float(layer.filter.x_map.weight.abs().max()) > 0.9 * 256 / math.sqrt(2) / math.sqrt(2)
    assert float(layer.filter.x_map.bias.abs().max()) <= math.pi


def test_coordinate_dimension_mismatch_is_a_clear_error():
    model = _model(in_features=2)
    with pytest.raises(ValueError, match=r"in_features=2.*\(10, 3\)"):
        model(torch.zeros(10, 3))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(10))
    with pytest.raises(TypeError, match="floating"):
        model(torch.zeros(10, 2, dtype=torch.long))


def test_nan_coordinates_are_rejected():
    model = _model()
    coords = coordinate_grid((4, 4))
    coords[5, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or infinite.*\[5\]"):
        model(coords)
    coords[5, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        model(coords)


def test_out_of_range_coordinates_raise_or_extrapolate_as_configured():
    model = _model()
    with pytest.raises(ValueError, match=r"outside the training range.*\[-1, 1\].*out_of_range='allow'"):
        model(torch.tensor([[0.0, 1.5]]))
    model(torch.tensor([[1.0 + 1e-7, -1.0 - 1e-7]]))  # rounding at the grid's end points is fine
    allow = _model(out_of_range="allow")
    out = allow(torch.tensor([[0.0, 1.5], [3.0, -2.0]]))
    assert torch.isfinite(out.values).all()


def test_config_validation_names_the_field():
    for kw, field in (
        ({"filter_type": "relu"}, "filter_type"),
        ({"in_features": 0}, "in_features"),
        ({"hidden_size": 10**6}, "hidden_size"),
        ({"coordinate_range": (1, -1)}, "coordinate_range"),
        ({"spectral_max_norm": -1.0}, "spectral_max_norm"),
        ({"out_of_range": "clip"}, "out_of_range"),
        ({"input_scale": float("nan")}, "input_scale"),
    ):
        with pytest.raises(ValueError, match=field):
            Implicit2Config(**kw)


def test_fixed_point_cache_through_the_model_cuts_solver_steps():
    model = _model(filter_type="gabor", hidden_size=32)
    x = coordinate_grid((8, 8))
    y = torch.rand(64, 1) * 2 - 1
    cache = FixedPointCache()
    model.train()
    first = model(x, y, fixed_point_cache=cache)
    first.loss.backward()
    second = model(x, y, fixed_point_cache=cache)
    assert cache.hits == 1 and second.deq_stats.nfe < first.deq_stats.nfe and second.deq_stats.nfe <= 2
    other = model(x.flip(0), y, fixed_point_cache=cache)  # other coordinates: no reuse
    assert cache.misses == 2 and other.deq_stats.nfe > 2


def test_save_load_roundtrip_and_auto_loading(tmp_path):
    model = _model(filter_type="gabor", task_specific_params={"implicit2": {"image": "camera", "size": 8}})
    model.save_pretrained(tmp_path / "ckpt")
    loaded = deqzoo.from_pretrained(str(tmp_path / "ckpt"))
    assert type(loaded).__name__ == "Implicit2ForSignalRepresentation"
    x = coordinate_grid((6, 6))
    torch.testing.assert_close(loaded.eval()(x).values, model(x).values, rtol=0, atol=0)
    base = Implicit2Model.from_pretrained(str(tmp_path / "ckpt"))
    assert base.config.filter_type == "gabor"


def test_render_covers_the_range_at_any_resolution():
    # a tight solve: the stopping test is per signal, so a 2-point and a 117-point batch stop at different
    # iterates at the default tolerance (1e-3); this test is about where the pixels are
    model = _model(filter_type="fourier", deq={"f_tol": 1e-9, "f_max_iter": 1000})
    img = model.render(9, 13)
    assert img.shape == (9, 13, 1) and float(img.min()) >= 0 and float(img.max()) <= 1
    # the render's pixel (r, c) is the model at (x = col, y = row) on the [-1, 1] grid
    vals = model(torch.tensor([[1.0, -1.0], [-1.0, 1.0]])).values
    torch.testing.assert_close(img[0, 12, 0], ((vals[0, 0] + 1) / 2).clamp(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(img[8, 0, 0], ((vals[1, 0] + 1) / 2).clamp(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="in_features=1"):
        _model(in_features=1).render(4, 4)


def test_presets_build():
    assert {"implicit2-isiren-camera", "implicit2-igabor-mfn-1l512d", "implicit2-gabor-mfn-4l256d"} <= set(
        ARCHITECTURES
    )
    model = deqzoo.create_model("implicit2-igabor-mfn-camera") if hasattr(deqzoo, "create_model") else None
    if model is not None:
        assert model.config.hidden_size == 256 and model.config.implicit


def test_two_layer_imfn_fixed_point_formula_with_the_folded_first_layer():
    """num_layers=2: z* = (W₂((W₁(z* + g₀) + b₁) ∘ g₁) + b₂) ∘ g₂ by hand; the model folds W₁g₀ + b₁ into one
    offset per forward, which must not change f."""
    model = _model(torch.float64, filter_type="fourier", num_layers=2,
                   deq={"f_tol": 1e-12, "f_max_iter": 4000})
    x = coordinate_grid((4, 5), dtype=torch.float64)
    m = model.implicit2

    def gate(filt):
        return torch.sin(x @ filt.x_map.weight.t() + filt.x_map.bias)

    (l1, l2), g0 = m.layers, gate(m.init_filter)
    z = m(x).last_hidden_state[0]
    h = ((z + g0) @ l1.z_map.weight.t() + l1.z_map.bias) * gate(l1.filter)
    rhs = (h @ l2.z_map.weight.t() + l2.z_map.bias) * gate(l2.filter)
    torch.testing.assert_close(z, rhs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gabor_log_envelope_matches_the_direct_distance(dtype):
    """The envelope exponent as one (d + 2)-wide product equals -γ/2 ||x - μ||² computed pointwise, also for
    sharp envelopes (large γ) and points far from the centres (3-D coordinates)."""
    torch.manual_seed(1)
    filt = _model(dtype, filter_type="gabor", in_features=3).implicit2.init_filter
    with torch.no_grad():
        filt.gamma.copy_(torch.logspace(-2, 3, filt.gamma.numel(), dtype=dtype))
        filt.gamma[0] = -1.0  # relu(γ) = 0: a flat envelope
    x = torch.cat([coordinate_grid((4, 4, 4), dtype=dtype), 1e-3 * torch.randn(5, 3, dtype=dtype)])
    direct = -0.5 * filt.gamma.relu() * ((x.double()[:, None] - filt.mu.double()[None]) ** 2).sum(-1)
    got = filt.log_envelope(x).double()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, direct, rtol=tol, atol=tol * float(direct.abs().max()))
    assert bool((got[:, 0] == 0).all())
