"""Norms (weight / spectral) and regularizers (Jacobian, dropout, mixed init, fixed-point correction)."""

import pytest
import torch
from torch import nn

from deqzoo.core import (
    DEQ,
    DEQConfig,
    VariationalDropout,
    apply_norm,
    fp_correction,
    jacobian_reg,
    mixed_init,
    remove_norm,
    reset_dropout,
    reset_norm,
)
from deqzoo.core.norm import _norms_of


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 3, 3, padding=1),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 7),
    )


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("clip", [False, True])
def test_remove_norm_leaves_outputs_unchanged(kind, clip):
    net = _net().double()
    apply_norm(net, kind, learn_scale=True, clip=clip, clip_value=0.9)
    with torch.no_grad():  # move the learned scales away from their init so the factor matters
        for name, p in net.named_parameters():
            if name.endswith("_g"):
                p.mul_(1.3)
    net.eval()
    reset_norm(net)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    y = net(x)
    remove_norm(net)
    assert all(isinstance(m.weight, nn.Parameter) for m in net if hasattr(m, "weight"))
    assert not any(n.endswith(("_g", "_v", "_orig")) for n, _ in net.named_parameters())
    torch.testing.assert_close(net(x), y, atol=1e-6, rtol=1e-6)


def test_weight_norm_is_per_output_and_spectral_norm_hits_target():
    lin = nn.Linear(6, 5).double()
    apply_norm(lin, "weight_norm", learn_scale=False, target_norm=2.0)
    torch.testing.assert_close(lin.weight.norm(dim=1), torch.full((5,), 2.0, dtype=torch.float64))
    lin2 = nn.Linear(6, 5).double()
    apply_norm(lin2, "spectral_norm", learn_scale=False, target_norm=0.7)
    assert abs(torch.linalg.matrix_norm(lin2.weight, 2).item() - 0.7) < 1e-6


def test_clip_only_shrinks():
    lin = nn.Linear(6, 5).double()
    with torch.no_grad():
        lin.weight.mul_(1e-3)  # tiny weight: unclipped factor g/sigma would blow it up to norm 1
    w0 = lin.weight.detach().clone()
    apply_norm(lin, "spectral_norm", learn_scale=False, target_norm=1.0, clip=True, clip_value=1.0)
    torch.testing.assert_close(lin.weight, w0)  # factor clipped at 1


def test_reset_norm_reparametrizes_once_per_forward_and_gradients_reach_scales():
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    apply_norm(lin, "spectral_norm", learn_scale=True)
    (fn,) = _norms_of(lin)
    deq = DEQ(DEQConfig(f_solver="anderson", f_max_iter=40, f_tol=1e-6, b_mode="ift"))
    x = torch.randn(3, 6)
    calls = 0

    def f(z):
        nonlocal calls
        calls += 1
        return torch.tanh(0.8 * lin(z) + x)

    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(3):
        before = fn.n_resets
        reset_norm(lin)
        z, stats = deq(f, torch.zeros(3, 6))
        z.sum().backward()
        assert fn.n_resets - before == 1, "reparametrized more than once in one forward"
        assert stats.nfe > 5 and calls > stats.nfe
        assert lin.weight_g.grad is not None and lin.weight_orig.grad is not None
        opt.step()
        opt.zero_grad()
    # a forward that forgets reset_norm after an optimizer step still sees fresh weights (pre-hook safety net)
    before = fn.n_resets
    with torch.no_grad():
        y = lin(x)
    assert fn.n_resets == before + 1
    torch.testing.assert_close(y, torch.nn.functional.linear(x, fn.compute(lin, update=False), lin.bias))


def test_jacobian_reg_matches_exact_frobenius_norm():
    torch.manual_seed(0)
    d, b = 6, 4
    W = torch.randn(d, d, dtype=torch.float64)
    u = torch.randn(b, d, dtype=torch.float64)
    z = torch.randn(b, d, dtype=torch.float64, requires_grad=True)
    fz = torch.tanh(z @ W.T + u)
    exact = sum(
        torch.autograd.functional.jacobian(lambda v, i=i: torch.tanh(W @ v + u[i]), z[i].detach())
        .pow(2)
        .sum()
        for i in range(b)
    ) / (b * d)
    est = jacobian_reg(fz, z, n_samples=6000, create_graph=False)
    assert abs(est.item() / exact.item() - 1) < 0.02
    # differentiable when create_graph=True
    (g,) = torch.autograd.grad(jacobian_reg(fz, z, n_samples=2), z)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_deq_jac_loss_in_training_only():
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    x = torch.randn(2, 5)
    deq = DEQ(DEQConfig(f_max_iter=30, jac_reg_samples=2))
    z, stats = deq(lambda z: torch.tanh(0.5 * lin(z) + x), torch.zeros(2, 5))
    assert stats.jac_loss is not None and stats.jac_loss.requires_grad and stats.jac_loss.item() > 0
    stats.jac_loss.backward()
    assert lin.weight.grad.abs().sum() > 0
    with torch.no_grad():
        _, stats = deq(lambda z: torch.tanh(0.5 * lin(z) + x), torch.zeros(2, 5))
    assert stats.jac_loss is None
    with pytest.raises(ValueError, match="jac_reg_samples"):
        DEQConfig(jac_reg_samples=-1)


def test_variational_dropout_mask_fixed_within_forward_redrawn_after_reset():
    torch.manual_seed(0)
    drop = VariationalDropout(0.5, shared_dims=(2, 3)).train()
    x = torch.ones(4, 8, 5, 5)
    a, b = drop(x), drop(x * 2)
    torch.testing.assert_close(b, 2 * a)
    assert (a[:, :, 0, 0, None, None] == a).all()  # one value per channel
    assert set(a.unique().tolist()) <= {0.0, 2.0}
    reset_dropout(drop)
    assert not torch.equal(drop(x), a)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_variational_dropout_gives_f_a_fixed_point():
    torch.manual_seed(0)
    lin, drop = nn.Linear(6, 6), VariationalDropout(0.3).train()
    x = torch.randn(3, 6)
    reset_dropout(drop)
    deq = DEQ(DEQConfig(f_max_iter=60, f_tol=1e-6))
    with torch.no_grad():
        z, stats = deq(lambda z: drop(torch.tanh(0.5 * lin(z) + x)), torch.zeros(3, 6))
    assert stats.all_converged


def test_mixed_init_half_zeros():
    torch.manual_seed(0)
    z = mixed_init(torch.empty(200, 100))
    frac = (z == 0).float().mean().item()
    assert 0.47 < frac < 0.53 and abs(z[z != 0].std().item() - 1) < 0.05
    parts = mixed_init((torch.empty(2, 3), torch.empty(2, 4, 4)))
    assert isinstance(parts, tuple) and parts[1].shape == (2, 4, 4)


def test_fp_correction_weights():
    preds = [torch.zeros(3), torch.full((3,), 0.5), torch.ones(3)]
    target = torch.ones(3)
    loss, values = fp_correction(nn.functional.mse_loss, preds, target, return_losses=True)
    assert values == [1.0, 0.25, 0.0]
    assert abs(loss.item() - (0.8**2 * 1.0 + 0.8 * 0.25)) < 1e-6
    with pytest.raises(ValueError, match="unknown weight"):
        fp_correction(nn.functional.mse_loss, preds, target, weight="nope")


def test_residual_penalty_is_the_relative_residual_and_trains_f_only():
    """residual_penalty(f, z) = mean_b ||f(z)_b - z_b|| / ||z_b|| over a tuple state, recomputed densely here;
    its gradient reaches f's weights and never z."""
    from deqzoo.core import residual_penalty

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6, dtype=torch.float64)
    a = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)

    def f(z):
        return torch.tanh(lin(z[0])), 0.5 * z[1] + z[0][:, :4].reshape(3, 2, 2)

    fz, r = residual_penalty(f, (a, b))
    flat_z = torch.cat([a.detach(), b.detach().flatten(1)], 1)
    flat_f = torch.cat([fz[0].detach(), fz[1].detach().flatten(1)], 1)
    expected = ((flat_f - flat_z).norm(dim=1) / flat_z.norm(dim=1)).mean()
    torch.testing.assert_close(r.detach(), expected)
    r.backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert a.grad is None and b.grad is None
    fz1, r1 = residual_penalty(torch.tanh, a)  # a plain tensor state
    torch.testing.assert_close(r1, ((torch.tanh(a) - a).norm(dim=1) / a.norm(dim=1)).mean().detach())


def test_weight_norm_checked_once_per_solve(monkeypatch):
    """In a DEQ's no-grad forward solve each normalized module's staleness check runs once, not per f call;
    outputs equal those of a check on every call, and a parameter change between solves is still seen."""
    import contextlib

    from deqzoo.core import DEQ, DEQConfig
    from deqzoo.core import deq as deq_module
    from deqzoo.core import norm as norm_module
    from deqzoo.core.norm import apply_norm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    apply_norm(net)
    x = torch.randn(3, 8)
    f = lambda z: torch.tanh(0.5 * net(z) + x)  # noqa: E731
    layer = DEQ(DEQConfig(f_solver="anderson", f_max_iter=40, f_tol=1e-6))
    calls = []
    original = norm_module._Norm.refresh_if_stale
    monkeypatch.setattr(norm_module._Norm, "refresh_if_stale",
                        lambda self, m: (calls.append(id(self)), original(self, m))[1])  # fmt: skip
    with torch.no_grad():
        z1, st = layer(f, torch.zeros(3, 8))
    assert st.nfe > 5 and len(calls) == 2, (st.nfe, len(calls))  # two normalized layers, once each
    monkeypatch.setattr(deq_module, "checked_once", contextlib.nullcontext)
    calls.clear()
    with torch.no_grad():
        z2, _ = layer(f, torch.zeros(3, 8))
    assert len(calls) == 2 * st.nfe  # the old behaviour: every call of f
    assert torch.equal(z1, z2)
    monkeypatch.undo()
    fn = norm_module._norms_of(net[0])[0]
    before = fn.n_resets
    with torch.no_grad():
        net[0].weight_v.mul_(2.0)  # a parameter change between solves (as an optimizer step)
        layer(f, torch.zeros(3, 8))
    assert fn.n_resets == before + 1


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_meta_skeleton_computes_nothing_and_the_loaded_weights_are_normalized_at_first_forward(kind):
    """transformers builds every model on the meta device, then loads: the normalized weight of the skeleton
    is a placeholder (nothing to compute), and the first forward after loading uses the loaded parameters."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    apply_norm(reference, kind)
    with torch.device("meta"):
        skeleton = nn.Linear(4, 3)
        apply_norm(skeleton, kind)
    assert skeleton.weight.is_meta and skeleton.weight.shape == (3, 4)
    skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(reference.state_dict())
    reference.eval(), skeleton.eval()  # no power-iteration step: both use the same (loaded) u, v
    x = torch.randn(5, 4)
    torch.testing.assert_close(skeleton(x), reference(x), rtol=0, atol=0)
    # and the formula itself: w = g · v / ||v|| per output row (an independent computation)
    if kind == "weight_norm":
        v, g = reference.weight_v.detach(), reference.weight_g.detach()
        torch.testing.assert_close(skeleton(x), x @ (g * v / v.norm(dim=1, keepdim=True)).T + reference.bias,
                                   rtol=1e-6, atol=1e-6)
