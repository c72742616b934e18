"""The point a solve returns and what it says about it (issue 35, items 1 and 2).

* Every solver reports the residual of the point it returns: ``stats.abs_residual`` / ``rel_residual`` equal
  |f(z) - z| (/ |f(z)|) recomputed independently at the returned z, in float64, on hard linear maps
  (non-normal, ill-conditioned), float32 and float64, on the fused and the torch path, whether the solve
  converged or ran out of budget.
* f receives contiguous tensors: the parts of a tuple state are column blocks of one flat matrix; handed to
  f as strided views they would be copied inside every convolution of f.
"""

import numpy as np
import pytest
import torch

from deqzoo.core import DEQ, DEQConfig, solve

SOLVERS = ["fixed_point", "anderson", "broyden", "gmres"]
D = 48


@pytest.fixture
def path():
    """One implementation per solver (torch); a fixture so each test names what it runs."""
    return "torch"


def _map(kind: str, dtype: torch.dtype, seed: int = 0):
    """f(z) = z A + b with A non-normal (a strong strictly-upper part, spectral radius 0.9) or ill-conditioned
    (I - A has singular values from 1 down to 1e-4: eigenvalues of A up to 0.9999)."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((D, D)))[0]
    if kind == "non_normal":
        T = np.diag(rng.uniform(0, 0.9, D)) + 1.5 * np.triu(rng.standard_normal((D, D)), 1) / np.sqrt(D)
        A = Q @ T @ Q.T
    else:
        A = Q @ np.diag(1 - np.logspace(-4, 0, D)) @ Q.T
    b = rng.standard_normal((3, D))
    A_t, b_t = torch.tensor(A, dtype=dtype), torch.tensor(b, dtype=dtype)
    return lambda z: z @ A_t + b_t


def _true(f, z):
    fz = f(z)
    a = torch.linalg.vector_norm((fz - z).double(), dim=1)
    return a, a / (torch.linalg.vector_norm(fz.double(), dim=1) + 1e-12)


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("budget", ["converges", "runs_out"])
@pytest.mark.parametrize("kind", ["non_normal", "ill_conditioned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", SOLVERS)
def test_reported_residual_is_the_returned_points(path, solver, dtype, kind, budget, final):
    """With ``final=True`` the returned point may be f(best iterate) (`final_step`): its own residual too."""
    f = _map(kind, dtype)
    tol = {torch.float32: 1e-4, torch.float64: 1e-9}[dtype]
    max_iter = 400 if budget == "converges" else 7
    z0 = torch.zeros(3, D, dtype=dtype)
    z, st = solve(f, z0, solver=solver, max_iter=max_iter, tol=tol, final=final)
    abs_true, rel_true = _true(f, z)
    # the reported residual was measured from f's own float output at that point: equal to rounding of
    # the state's dtype relative to |f(z)| (the difference f(z) - z loses digits as it shrinks)
    eps = torch.finfo(dtype).eps
    scale = torch.linalg.vector_norm(f(z).double(), dim=1)
    slack = 64 * eps * scale
    assert (st.abs_residual.double() - abs_true).abs().le(slack).all(), (st.abs_residual, abs_true)
    assert (st.rel_residual.double() - rel_true).abs().le(slack / scale).all(), (st.rel_residual, rel_true)
    # and the flag agrees with the recomputed value (away from tol's rounding edge)
    edge = (rel_true - tol).abs() <= 64 * eps
    assert st.converged[~edge].tolist() == (rel_true < tol)[~edge].tolist(), st.summary()
    if budget == "runs_out":
        assert not st.converged.all()  # the case is hard: 7 evaluations do not reach it
    if final:
        z_plain, st_plain = solve(f, z0, solver=solver, max_iter=max_iter, tol=tol)
        # the one measuring evaluation, made when some sample's answer is the last iterate f saw
        assert st.nfe == st_plain.nfe + ("final_step" in st.extra)
        assert (st.residual.double() <= st_plain.residual.double()).all()  # never worse, per sample


@pytest.mark.parametrize("solver", ["fixed_point", "anderson", "broyden"])
def test_final_step_takes_f_of_the_answer_where_it_is_better(path, solver):
    """On a contraction f(z*) is closer to the fixed point than z*: the final step returns it (its residual
    |f(f(z)) - f(z)| <= L |f(z) - z|, L = 0.5 here), measured, and it passes a tolerance z itself misses."""
    gen = torch.Generator().manual_seed(3)
    A = 0.5 * torch.linalg.qr(torch.randn(D, D, dtype=torch.float64, generator=gen))[0]
    b = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    f = lambda z: z @ A + b  # noqa: E731
    z0 = torch.zeros(3, D, dtype=torch.float64)
    z_plain, st_plain = solve(f, z0, solver=solver, max_iter=6, tol=1e-12)
    z, st = solve(f, z0, solver=solver, max_iter=6, tol=1e-12, final=True)
    assert st.extra["final_step"].all()
    torch.testing.assert_close(z, f(z_plain))
    assert (st.rel_residual <= 0.51 * st_plain.rel_residual).all(), (st.rel_residual, st_plain.rel_residual)
    tol = float(st.rel_residual.max()) * 1.01
    assert not solve(f, z0, solver=solver, max_iter=6, tol=tol)[1].converged.all()
    assert solve(f, z0, solver=solver, max_iter=6, tol=tol, final=True)[1].converged.all()


def _tuple_map(dtype: torch.dtype):
    """A two-tensor state, (B, 2, 5, 5) and (B, 3, 4): f convolves the first and mixes both."""
    g = torch.Generator().manual_seed(0)
    w = 0.1 * torch.randn(2, 2, 3, 3, generator=g, dtype=dtype)
    m = 0.1 * torch.randn(12, 12, generator=g, dtype=dtype)
    x1 = torch.randn(4, 2, 5, 5, generator=g, dtype=dtype)
    x2 = torch.randn(4, 3, 4, generator=g, dtype=dtype)
    seen: list[bool] = []

    def f(z):
        a, c = z
        seen.extend([a.is_contiguous(), c.is_contiguous()])
        a2 = torch.tanh(torch.nn.functional.conv2d(a, w, padding=1) + x1 + c.sum((1, 2))[:, None, None, None])
        c2 = torch.tanh((c.reshape(4, 12) @ m).reshape(4, 3, 4) + x2 + 0.1 * a.mean((1, 2, 3))[:, None, None])
        return a2, c2

    z0 = (torch.zeros(4, 2, 5, 5, dtype=dtype), torch.zeros(4, 3, 4, dtype=dtype))
    return f, z0, seen, (w, m)


@pytest.mark.parametrize("solver", SOLVERS)
def test_f_receives_contiguous_state_tensors(path, solver):
    f, z0, seen, _ = _tuple_map(torch.float64)
    z, st = solve(f, z0, solver=solver, max_iter=60, tol=1e-8)
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} state tensors reached f as strided views"
    assert all(t.is_contiguous() for t in z)
    if solver != "gmres":  # GMRES solves affine maps; this one is not
        assert st.converged.all(), st.summary()


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("b_mode", ["ift", "jacobian_free"])
def test_deq_hands_f_contiguous_tensors_and_keeps_its_gradient(b_mode, final):
    """Through the DEQ module (forward solve and backward): f sees contiguous tensors; the IFT gradient
    equals autograd through an unrolled solve to the same fixed point (the contiguous copy is
    differentiable)."""
    f, z0, seen, (w, m) = _tuple_map(torch.float64)
    w.requires_grad_(True)
    m.requires_grad_(True)
    deq = DEQ(DEQConfig(f_solver="anderson", f_max_iter=80, f_tol=1e-12, b_mode=b_mode, b_max_iter=80,
                        b_tol=1e-12, f_final_step=final))  # fmt: skip
    z, st = deq(f, z0)
    (z[0].square().sum() + z[1].sum()).backward()
    assert seen and all(seen)
    if b_mode != "ift":
        return
    grads = [w.grad.clone(), m.grad.clone()]
    w.grad = m.grad = None
    zz = z0
    for _ in range(200):  # unrolled: a contraction, converges far below the tolerance
        zz = f(zz)
    (zz[0].square().sum() + zz[1].sum()).backward()
    torch.testing.assert_close(grads[0], w.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grads[1], m.grad, rtol=1e-6, atol=1e-9)
