"""Lipschitz MDEQ: the bound's value, the conv operator norm, the projection, and that the bound holds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deqzoo.models.mdeq import (
    ARCHITECTURES,
    MDEQConfig,
    MDEQForImageClassification,
    conv_operator_norm,
    lipschitz_bound,
    project_lipschitz,
)
from deqzoo.models.mdeq.lipschitz import MeanOnlyGroupNorm

torch.set_num_threads(1)

PAPER = dict(
    alpha1=0.5, alpha2=0.3, conv_norm=2.0, gamma_bound=1.0, relu_slope=0.35, num_branches=4, dropout=0.3
)


def test_bound_of_the_papers_example_is_in_range():
    value = lipschitz_bound(**PAPER)
    assert 0.80 <= value <= 0.92
    # closed form of the documented derivation: block 0.5 + 0.5*0.7²/0.7, fusion 0.7 + 0.3*sqrt(3)*0.7
    assert value == pytest.approx(0.85 * (0.7 + 0.3 * math.sqrt(3) * 0.7), rel=1e-12)


def test_bound_edge_cases_and_validation():
    assert lipschitz_bound(0.5, 0.3, 2.0, 1.0, 0.35, 1, 0.0) == pytest.approx(0.5 + 0.5 * 0.49)
    assert lipschitz_bound(1.0, 0.0, 2.0, 1.0, 0.35, 4, 0.0) == pytest.approx(1.0)  # pure identity residual
    with pytest.raises(ValueError, match="dropout"):
        lipschitz_bound(0.5, 0.3, 2.0, 1.0, 0.35, 4, 1.0)
    with pytest.raises(ValueError, match="alpha1"):
        lipschitz_bound(1.5, 0.3, 2.0, 1.0, 0.35, 4, 0.3)


def _power_norm(apply, shape, iters=60, adjoint=None):
    """Largest singular value of a linear map by power iteration on A^T A (adjoint via autograd)."""
    v = torch.randn(shape, dtype=torch.float64)
    sigma = 0.0
    for _ in range(iters):
        v = v / v.norm()
        x = v.clone().requires_grad_(True)
        y = apply(x)
        (g,) = torch.autograd.grad(y, x, y)
        sigma = float(y.detach().norm())
        v = g
    return sigma


@pytest.mark.parametrize("stride,kernel", [(1, 3), (2, 3), (1, 1), (1, 5)])
def test_conv_operator_norm_bounds_and_is_tight_for_zero_padded_convs(stride, kernel):
    torch.manual_seed(kernel + stride)
    w = torch.randn(6, 4, kernel, kernel, dtype=torch.float64)
    fft_norm = conv_operator_norm(w, 32)
    measured = _power_norm(lambda x: F.conv2d(x, w, stride=stride, padding=kernel // 2), (1, 4, 24, 24))
    assert measured <= fft_norm * (1 + 1e-9)
    if stride == 1:  # a 24x24 map is large enough for the zero-padded norm to approach the circulant one
        assert measured >= 0.9 * fft_norm
    # the reshaped-kernel spectral norm is NOT the operator norm (why the projection uses the FFT)
    assert torch.linalg.matrix_norm(w.reshape(6, -1), ord=2) < fft_norm or kernel == 1


def _paper_model(dropout: float) -> MDEQForImageClassification:
    cfg = MDEQConfig(
        in_channels=1,
        branch_channels=[4, 4, 8, 8],
        head_channels=[2, 2, 2, 2],
        final_chansize=8,
        num_labels=2,
        expansion_factor=2,
        num_groups=2,
        dropout=dropout,
        downsample_times=0,
        image_size=[16, 16],
        image_mean=[0.0],
        image_std=[1.0],
        wnorm=False,
        lipschitz=True,
        residual_alpha=0.5,
        fusion_alpha=0.3,
        conv_norm=2.0,
        gamma_bound=1.0,
        relu_slope=0.35,
        spectral_fft_size=20,
    )
    return MDEQForImageClassification(cfg).double()


def _adversarial(model) -> None:
    """Push every constrained quantity to (or past) its limit before projecting: large convs, |γ| > γ̄."""
    torch.manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "_deqzoo_lipschitz_conv", False):
                m.weight.mul_(50.0)
            if isinstance(m, MeanOnlyGroupNorm):
                m.weight.copy_(torch.sign(torch.randn_like(m.weight)) * 3.0)
        model.mdeq.fullstage.fuse_logits.normal_(0, 3.0)


def _jacobian_norm(model, train: bool) -> float:
    m = model.mdeq
    m.train(train)
    x = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    from deqzoo.core.regularize import reset_dropout

    reset_dropout(m.fullstage)
    stem = m.downsample.eval()(x)
    inj = [m.stage0(stem) if m.stage0 is not None else stem] + [None] * 3
    z = tuple(torch.randn(1, *s, dtype=torch.float64) for s in m.state_shapes(16, 16))
    sizes = [t.numel() for t in z]

    def f_flat(flat):
        parts = torch.split(flat, sizes)
        zs = tuple(p.reshape(t.shape) for p, t in zip(parts, z))
        return torch.cat([o.reshape(-1) for o in m.fullstage(zs, inj)])

    z_flat = torch.cat([t.reshape(-1) for t in z])
    v = torch.randn_like(z_flat)
    sigma = 0.0
    for _ in range(15):  # power iteration on J^T J with jvp / vjp at a fixed state (fixed dropout mask)
        v = v / v.norm()
        _, jv = torch.func.jvp(f_flat, (z_flat,), (v,))
        _, vjp = torch.func.vjp(f_flat, z_flat)
        (v,) = vjp(jv)
        sigma = float(jv.detach().norm())
    return sigma


@pytest.mark.parametrize("train", [True, False])
def test_power_iteration_jacobian_norm_stays_below_the_bound(train):
    model = _paper_model(dropout=0.3)
    bound = model.lipschitz_bound()
    assert bound == pytest.approx(lipschitz_bound(**PAPER))
    _adversarial(model)
    project_lipschitz(model)
    estimates = [_jacobian_norm(model, train) for _ in range(2)]  # two random states (and dropout masks)
    assert max(estimates) <= bound, (estimates, bound)
    assert min(estimates) > 0.05  # a real, non-degenerate Jacobian was measured


def test_without_projection_the_same_model_violates_the_bound():
    # negative control: the measurement above can fail, it is the projection that makes it pass
    model = _paper_model(dropout=0.0)
    _adversarial(model)
    assert _jacobian_norm(model, train=False) > model.lipschitz_bound()


def test_projection_enforces_conv_norm_and_gamma():
    model = _paper_model(dropout=0.0)
    _adversarial(model)
    stats = project_lipschitz(model)
    assert stats["max_conv_norm_before"] > 2.0 and stats["projected"] > 0
    for m in model.modules():
        if getattr(m, "_deqzoo_lipschitz_conv", False):
            assert conv_operator_norm(m.weight, 20) <= 2.0 * (1 + 1e-9)
        if isinstance(m, MeanOnlyGroupNorm):
            assert m.weight.abs().max() <= 1.0


def test_lipschitz_preset_contracts_and_plain_mdeq_has_no_bound():
    cfg = MDEQConfig(**ARCHITECTURES["lipschitz-mdeq-tiny-mnist"]["config"])
    model = MDEQForImageClassification(cfg).eval()
    bound = model.lipschitz_bound()
    assert bound < 1
    model.set_deq(f_solver="fixed_point", f_max_iter=12, f_tol=1e-12, f_stop_mode="abs")
    with torch.no_grad():
        trace = model(torch.randn(2, 1, 28, 28)).deq_stats.trace
    # fixed-point residuals of a contraction shrink at least by the Lipschitz factor each step
    ratios = (trace[1:] / trace[:-1]).tolist()
    assert max(ratios) <= bound + 1e-6, ratios
    plain = MDEQForImageClassification(MDEQConfig(**ARCHITECTURES["mdeq-tiny-mnist"]["config"]))
    with pytest.raises(ValueError, match="lipschitz=True"):
        plain.lipschitz_bound()
