"""The stored final step (issue #55): ``solve(final="stored")`` / ``DEQConfig(f_final_step="stored")`` returns
f of each sample's accepted iterate as the solver already computed it (TorchDEQ's return rule), with no
further call of f. Checked against independent references: f applied once, outside the solver, to the point
the default solve returns (bitwise: the synthetic f's per-row arithmetic does not depend on its batch), and
the existing measured final step ``final=1`` (which calls f again at that point); on a batch with diverging,
NaN-producing and already-converged rows, float64 and float32, compacted and fixed-trip; the f calls counted
by a wrapper around f."""

from __future__ import annotations

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig, solve
from deqzoo.core.halting import rowwise

from .test_core_batch_independence import _alone, _flags, _problem


def _counted(f):
    """f (row-subset form) that counts the rows it evaluates."""
    seen = {"rows": 0, "calls": 0}

    def g(z, rows=None):
        seen["rows"] += z.shape[0]
        seen["calls"] += 1
        return f(z, rows)

    return rowwise(g), seen


def _reference(f, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return f(z, None)


@pytest.mark.parametrize("fixed_trip", [False, True], ids=["compacted", "fixed_trip"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("solver", ["fixed_point", "anderson"])
def test_stored_is_f_of_the_default_answer_at_no_call(solver, dtype, fixed_trip):
    f, z0 = _problem(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    kw = dict(solver=solver, max_iter=60, tol=tol, fixed_trip=fixed_trip, check_every=0)
    g0, seen0 = _counted(f)
    z, st = solve(g0, z0, **kw)
    g1, seen1 = _counted(f)
    zs, ss = solve(g1, z0, final="stored", **kw)
    assert len(set(st.nfe_per_sample.tolist())) >= 4  # rows stop at different steps
    assert [_flags(st, i) for i in range(8)] == [_flags(ss, i) for i in range(8)]
    # the odd rows are what they are meant to be: diverging (flagged, or at the budget), NaN, converged at z0
    assert not st.converged[5] and st.extra["nonfinite"][6] and int(st.nfe_per_sample[7]) == 1
    # the point returned: f of the default answer, computed here outside the solver
    torch.testing.assert_close(zs, _reference(f, z), rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(zs[:5], z[:5])  # it is a different point from the iterate
    # no call of f more than the default solve made; the statistics are the iterate's (as TorchDEQ's)
    assert seen1 == seen0
    assert ss.nfe == st.nfe and ss.nfe_per_sample.tolist() == st.nfe_per_sample.tolist()
    torch.testing.assert_close(ss.rel_residual, st.rel_residual, rtol=0, atol=0)
    assert ss.extra["returned"] == "f(best iterate)"
    # the measured final step reaches the same point by calling f again
    z1, s1 = solve(f, z0, final=1, **kw)
    torch.testing.assert_close(zs, z1, rtol=0, atol=0, equal_nan=True)
    assert s1.nfe > ss.nfe


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("solver", ["fixed_point", "anderson"])
def test_stored_is_batch_independent(solver, dtype):
    """Each sample's stored point, count and flags are those of its own solve alone."""
    f, z0 = _problem(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    kw = dict(solver=solver, max_iter=60, tol=tol, final="stored")
    z, st = solve(f, z0, **kw)
    for i in range(z0.shape[0]):
        zi, si = solve(_alone(f, i), z0[i : i + 1], **kw)
        torch.testing.assert_close(zi[0], z[i], rtol=0, atol=0, equal_nan=True)
        assert _flags(si, 0) == _flags(st, i), i


def test_deq_config_stored():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=torch.float64)

    def f(z):
        return torch.tanh(0.5 * lin(z) + x)

    z0 = torch.zeros(4, 6, dtype=torch.float64)
    base = DEQConfig(f_solver="anderson", f_max_iter=40, f_tol=1e-4)
    cfg = base.update(f_final_step="stored")
    assert DEQConfig.from_json(cfg.to_json()) == cfg
    with torch.no_grad():
        z, st = DEQ(base)(f, z0)
        zs, ss = DEQ(cfg)(f, z0)
        torch.testing.assert_close(zs, f(z), rtol=0, atol=1e-12)
    assert ss.nfe == st.nfe
    # with autograd: the backward mode starts from the stored point (IFT returns f of it, with its graph)
    zg, _ = DEQ(cfg)(f, z0)
    zg.sum().backward()
    assert lin.weight.grad is not None
    torch.testing.assert_close(zg.detach(), f(zs), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"f_final_step='stored' needs a solver .*got 'broyden'"):
        DEQConfig(f_solver="broyden", f_final_step="stored")
    with pytest.raises(ValueError, match="f_final_step"):
        DEQConfig(f_final_step="last")
    with pytest.raises(ValueError, match="solve: final='stored' needs a solver"):
        solve(f, z0, solver="broyden", final="stored")
    for bad in ("last", -1, 1.5):
        with pytest.raises(ValueError, match="solve: final must be"):
            solve(f, z0, final=bad)
    assert torch.equal(solve(f, z0, final=0)[0], solve(f, z0)[0])  # 0: off, as before


def test_ift_adjoint_with_stored_step_is_closer_to_the_exact_adjoint_at_no_call():
    """``b_solver_kwargs={"return_f": True}``: the adjoint solve returns Jᵀy_k + g, one more step of the
    adjoint map from its answer y_k, already computed. Here ||J||₂ <= 0.5, so that step at least halves the
    adjoint's error (2-norm, per sample) against a dense solve, the reference, with the same number of
    vector-Jacobian products."""
    torch.manual_seed(0)
    d = 12
    W = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]
    x = torch.randn(3, d, dtype=torch.float64, requires_grad=True)
    z0 = torch.zeros(3, d, dtype=torch.float64)

    def f(z):
        return torch.tanh(0.5 * z @ W.T + x)

    forward = DEQConfig(f_solver="anderson", f_max_iter=80, f_tol=1e-13)
    with torch.no_grad():
        zs = DEQ(forward)(f, z0)[0]
    s = 1 - torch.tanh(0.5 * zs @ W.T + x.detach()).square()  # f's derivative: diag(s) (0.5 W | I)
    eye = torch.eye(d, dtype=torch.float64)
    exact = torch.stack([  # y = (I - J)ᵀ⁻¹ dL/dz with J = diag(s) 0.5 W, dL/dz = 3 z² (loss Σ z³)
        torch.linalg.solve((eye - s[i, :, None] * 0.5 * W).T, 3 * zs[i].square()) for i in range(3)])
    errors, nfes = {}, {}
    for key, kw in (("iterate", {}), ("stored", {"return_f": True})):
        cfg = forward.update(b_solver="fixed_point", b_max_iter=6, b_tol=1e-13, b_solver_kwargs=kw)
        x.grad = None
        z, st = DEQ(cfg)(f, z0)
        z.pow(3).sum().backward()
        y = x.grad / s  # dL/dx = diag(s) y: the adjoint the backward solved
        errors[key], nfes[key] = torch.linalg.vector_norm(y - exact, dim=1), st.extra["backward"].nfe
    assert nfes["stored"] == nfes["iterate"] == 6  # the budget binds: an unconverged adjoint
    assert bool((errors["iterate"] > 1e-6).all())
    assert bool((errors["stored"] <= 0.5 * errors["iterate"]).all()), errors
