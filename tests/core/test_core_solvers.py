"""Solvers against closed-form solutions of linear fixed-point problems, stats, bad input, failure modes."""

import math

import pytest
import torch

from deqzoo.core import SOLVERS, solve
from deqzoo.core.solvers import broyden


@pytest.fixture(autouse=True)
def solver_path():
    """One implementation per solver (torch); a fixture so each test names what it runs."""
    return "torch"


def _linear_problem(rho: float, d: int = 16, b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    A = A * (rho / torch.linalg.eigvals(A).abs().max())
    bias = torch.randn(b, d, generator=g, dtype=torch.float64)
    exact = torch.linalg.solve(torch.eye(d, dtype=torch.float64) - A, bias.T).T
    return (lambda z: z @ A.T + bias), exact


@pytest.mark.parametrize(
    "solver,kwargs,max_iter",
    [
        ("fixed_point", {}, 2000),
        ("fixed_point", {"tau": 0.7}, 2000),
        ("anderson", {}, 300),
        ("anderson", {"m": 3, "tau": 0.8}, 400),
        ("broyden", {}, 100),
        ("broyden", {"m": 8}, 300),
        ("gmres", {}, 40),
    ],
)
def test_contractive_linear_matches_closed_form(solver, kwargs, max_iter):
    f, exact = _linear_problem(0.9)
    z, stats = solve(f, torch.zeros_like(exact), solver=solver, max_iter=max_iter, tol=1e-6, **kwargs)
    assert stats.converged.all() and stats.rel_residual.max() < 1e-6
    torch.testing.assert_close(z, exact, rtol=1e-4, atol=1e-4)
    # reported residuals are the true residuals of the returned iterate
    fz = f(z)
    torch.testing.assert_close(stats.abs_residual, (fz - z).norm(dim=1), rtol=1e-6, atol=1e-12)
    assert stats.nfe <= max_iter and stats.trace.numel() >= 1 and stats.solver == solver


@pytest.mark.parametrize("solver,kwargs", [("anderson", {"m": 20}), ("broyden", {}), ("gmres", {})])
def test_noncontractive_linear(solver, kwargs):
    f, exact = _linear_problem(1.5)
    z, stats = solve(f, torch.zeros_like(exact), solver=solver, max_iter=100, tol=1e-6, **kwargs)
    assert stats.converged.all(), stats.summary()
    torch.testing.assert_close(z, exact, rtol=1e-4, atol=1e-4)
    # whereas plain iteration diverges and stops with the flag set, keeping its best iterate
    z_fp, st = solve(
        f, torch.zeros_like(exact), solver="fixed_point", max_iter=500, tol=1e-6, stop_mode="abs"
    )
    assert st.diverged and not st.converged.any() and st.nfe < 500
    assert torch.isfinite(z_fp).all()


def test_per_sample_stats_and_best_iterate():
    f, exact = _linear_problem(0.9, b=4)
    z, stats = solve(f, torch.zeros_like(exact), solver="anderson", max_iter=5, tol=1e-12)
    assert stats.abs_residual.shape == (4,) and stats.converged.shape == (4,) and not stats.converged.any()
    assert stats.nfe == 5 and stats.trace.shape == (5,)
    # stats at the returned iterate, per sample, and it is the best seen: no larger than the last trace entry
    torch.testing.assert_close(stats.rel_residual, (f(z) - z).norm(dim=1) / f(z).norm(dim=1))
    assert stats.residual.max() <= stats.trace.min() + 1e-12


def test_tuple_multiresolution_state():
    torch.manual_seed(0)
    shapes = [(2, 4, 8, 8), (2, 8, 4, 4), (2, 16)]
    W = [0.3 * torch.randn(math.prod(s[1:]), 64 * 4 + 32 * 4 + 16, dtype=torch.float64) / 20 for s in shapes]
    u = [torch.randn(s, dtype=torch.float64) for s in shapes]

    def f(zs):
        flat = torch.cat([z.flatten(1) for z in zs], 1)
        return tuple(torch.tanh(flat @ w.T).reshape(s) + ui for w, s, ui in zip(W, shapes, u))

    z0 = tuple(torch.zeros(s, dtype=torch.float64) for s in shapes)
    for solver in ("anderson", "broyden", "fixed_point"):
        z, stats = solve(f, z0, solver=solver, max_iter=200, tol=1e-8)
        assert isinstance(z, tuple) and [t.shape for t in z] == [torch.Size(s) for s in shapes]
        assert stats.converged.all()
        for a, b in zip(f(z), z):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bad_inputs_give_clear_errors():
    z0 = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*\(2, 3\)"):
        solve(lambda z: torch.zeros(2, 4), z0)
    with pytest.raises(TypeError, match="float64.*float32"):
        solve(lambda z: z.double(), z0)
    with pytest.raises(TypeError, match="tuple of 2.*a tensor"):
        solve(lambda z: (z, z), z0)
    with pytest.raises(TypeError, match="1 tensors.*has 2"):
        solve(lambda zs: (zs[0],), (z0, torch.zeros(2, 5)))
    with pytest.raises(ValueError, match="non-finite.*sample.*1"):
        solve(lambda z: z, torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="unknown solver 'nope'.*anderson"):
        solve(lambda z: z, z0, solver="nope")
    with pytest.raises(ValueError, match="tau"):
        solve(lambda z: z, z0, solver="anderson", tau=1.5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        solve(lambda z: z, z0, solver="broyden", bogus=1)


@pytest.mark.parametrize("solver", ["fixed_point", "anderson", "broyden"])
def test_constant_and_singular_maps_finish(solver):
    c = torch.randn(3, 5)
    z, stats = solve(lambda z: c.clone(), torch.zeros(3, 5), solver=solver, max_iter=20, tol=1e-6)
    torch.testing.assert_close(z, c)
    assert stats.converged.all()
    # a map whose residuals repeat exactly (rank-deficient Gram matrix) and the identity (zero residual)
    z, stats = solve(lambda z: z + 1.0, torch.zeros(3, 5), solver=solver, max_iter=10, tol=1e-6)
    assert torch.isfinite(z).all() and stats.nfe == 10
    z, stats = solve(lambda z: z.clone(), torch.ones(3, 5), solver=solver, max_iter=10, tol=1e-6)
    assert stats.converged.all()


@pytest.mark.parametrize("solver", ["fixed_point", "anderson", "broyden"])
def test_nonfinite_mid_solve_returns_best_finite_iterate(solver):
    calls = 0

    def f(z):
        nonlocal calls
        calls += 1
        out = 0.9 * torch.tanh(z) + 1.0
        if calls >= 4:
            out[1, 0] = float("nan")
        return out

    z, stats = solve(f, torch.zeros(2, 3), solver=solver, max_iter=50, tol=1e-8)
    # the NaN stops its own sample at its 4th evaluation, with its best finite iterate; the other sample
    # goes on and converges as it would alone
    assert stats.nonfinite and stats.extra["nonfinite"].tolist() == [False, True] and torch.isfinite(z).all()
    assert stats.nfe_per_sample[1] == 4 and stats.converged.tolist() == [True, False]
    z_alone, s_alone = solve(lambda z: 0.9 * torch.tanh(z) + 1.0, torch.zeros(1, 3), solver=solver,
                             max_iter=50, tol=1e-8)  # fmt: skip
    torch.testing.assert_close(z[:1], z_alone, rtol=1e-6, atol=1e-7)
    assert stats.nfe_per_sample[0] == s_alone.nfe


def test_broyden_inverse_estimate_and_limited_memory():
    f, exact = _linear_problem(0.5, d=8, b=2)
    z, stats = broyden(f, torch.zeros_like(exact), max_iter=60, tol=1e-12, return_inverse=True)
    inv = stats.extra["inverse_jacobian"]
    assert stats.converged.all() and inv.rank > 0
    # B y and yᵀ B are the same linear map: u · (B v) == (uᵀ B) · v
    u, v = torch.randn(2, 2, 8, dtype=torch.float64)
    torch.testing.assert_close((u * inv.matvec(v)).sum(1), (inv.rmatvec(u) * v).sum(1))
    g = torch.randn(2, 8, dtype=torch.float64)
    g0 = g.clone()
    inv.rmatvec(g), inv.matvec(g)
    assert torch.equal(g, g0)  # the argument is never modified in place
    assert "inverse_jacobian" not in broyden(f, torch.zeros_like(exact), max_iter=60, tol=1e-8)[1].extra
    z_lm, st_lm = broyden(f, torch.zeros_like(exact), max_iter=60, tol=1e-8, m=3, return_inverse=True)
    assert st_lm.converged.all() and 0 < st_lm.extra["inverse_jacobian"].rank <= 3


def test_register_user_solver():
    assert "fixed_point" in SOLVERS and "gmres" in SOLVERS


def test_stats_index_per_sample_like_a_batch():
    """stats[i] keeps the i-th sample's residuals with a batch dimension of one (what pipelines un-batch)."""
    A = 0.5 * torch.eye(3, dtype=torch.float64)
    b = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    _, stats = solve(
        lambda z: z @ A + b,
        torch.zeros(4, 3, dtype=torch.float64),
        solver="fixed_point",
        max_iter=60,
        tol=1e-8,
    )
    one = stats[2]
    assert one.rel_residual.shape == (1,) and one.rel_residual[0] == stats.rel_residual[2]
    assert bool(one.converged[0]) == bool(stats.converged[2]) and one.nfe == stats.nfe
    assert torch.equal(stats[-1].abs_residual, stats.abs_residual[3:])
    with pytest.raises(IndexError, match="out of range"):
        stats[4]
