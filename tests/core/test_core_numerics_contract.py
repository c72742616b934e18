"""The numeric contract of every solver (issue 35, item 5): converged only when the returned point's true
residual is below tol (on unsolvable and singular maps), non-finite / zero / negative tolerances and budgets
refused with a clear error before any work, and a huge budget that allocates nothing by itself."""

import importlib
import math

import pytest
import torch

from deqzoo.core import DEQConfig, solve
from deqzoo.core.solvers import gmres

SOLVERS = ["fixed_point", "anderson", "broyden", "gmres"]


@pytest.fixture
def path():
    """One implementation per solver (torch); a fixture so each test names what it runs."""
    return "torch"


def _true_residual(f, z, stop_mode="rel"):
    fz = f(z)
    a = torch.linalg.vector_norm((fz - z).double(), dim=1)
    return a / (torch.linalg.vector_norm(fz.double(), dim=1) + 1e-12) if stop_mode == "rel" else a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", SOLVERS)
def test_unsolvable_map_is_never_reported_converged(path, solver, dtype):
    """f(z) = z + 1 has no fixed point: |f(z) - z| = |1| everywhere. Before, gmres fitted rounding noise and
    jumped to |z| ~ 1e7, where the relative residual is ~1e-7, and said converged."""
    f = lambda z: z + 1  # noqa: E731
    z, st = solve(f, torch.zeros(3, 8, dtype=dtype), solver=solver, max_iter=60, tol=1e-4)
    assert not st.converged.any(), st.summary()
    true = _true_residual(f, z)
    torch.testing.assert_close(st.rel_residual.double(), true, rtol=1e-5, atol=0)
    assert float(z.abs().max()) < 1e3  # no excursion towards 1/eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("solver", SOLVERS)
def test_singular_solvable_map_converges_with_its_true_residual(path, solver, dtype):
    """f(z) = z M + c with M = diag(1, 0.5, ...) and c[0] = 0: I - M is singular, the system is consistent.
    A converged flag must agree with the residual recomputed at the returned point."""
    M = torch.diag(torch.tensor([1.0] + [0.5] * 15, dtype=dtype))
    c = torch.randn(3, 16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    c[:, 0] = 0
    f = lambda z: z @ M + c  # noqa: E731
    z0 = torch.randn(3, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    z, st = solve(f, z0, solver=solver, max_iter=200, tol=tol)
    true = _true_residual(f, z)
    assert st.converged.tolist() == (true < tol).tolist(), (st.summary(), true)
    assert st.converged.all(), st.summary()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.0, -1e-3, True, "1e-4"])
def test_bad_tolerance_refused(bad):
    f = lambda z: 0.5 * z + 1  # noqa: E731
    for solver in SOLVERS:
        with pytest.raises(ValueError, match="tol must be a finite number > 0"):
            solve(f, torch.zeros(2, 3), solver=solver, tol=bad)
    for key in ("f_tol", "b_tol"):
        with pytest.raises(ValueError, match=f"DEQConfig.{key} must be a finite number > 0"):
            DEQConfig(**{key: bad})
    with pytest.raises(ValueError, match="f_tol"):
        DEQConfig.from_json('{"f_tol": Infinity}')


@pytest.mark.parametrize("bad", [0, -5, 1e12, 2.5, math.inf, math.nan, True, "30"])
def test_bad_budget_refused(bad):
    f = lambda z: 0.5 * z + 1  # noqa: E731
    for solver in SOLVERS:
        with pytest.raises(ValueError, match="max_iter must be an integer >= 1"):
            solve(f, torch.zeros(2, 3), solver=solver, max_iter=bad)
    with pytest.raises(ValueError, match="f_max_iter"):
        DEQConfig(f_max_iter=bad)


@pytest.mark.parametrize("solver", SOLVERS)
def test_huge_budget_allocates_nothing_by_itself(path, solver):
    """max_iter = 10**12 on a contraction: the solve stops at its own convergence, as with a budget of 200
    (same NFE, same result)."""
    A = 0.5 * torch.eye(64, dtype=torch.float64)
    f = lambda z: z @ A + 1  # noqa: E731
    z1, s1 = solve(f, torch.zeros(4, 64, dtype=torch.float64), solver=solver, max_iter=10**12, tol=1e-9)
    z2, s2 = solve(f, torch.zeros(4, 64, dtype=torch.float64), solver=solver, max_iter=200, tol=1e-9)
    assert s1.converged.all() and s1.nfe == s2.nfe
    torch.testing.assert_close(z1, z2)


def test_gmres_stops_at_its_documented_basis_cap(monkeypatch):
    """On an unsolvable map a huge budget ends at the Krylov cap (memory cap · D), not after 1e12 steps."""
    gmres_module = importlib.import_module("deqzoo.core.solvers.gmres")  # the attribute is the function

    monkeypatch.setattr(gmres_module, "MAX_BASIS", 40)
    z, st = gmres(lambda z: z + 1, torch.zeros(2, 8), max_iter=10**12, tol=1e-4)
    assert st.nfe <= 40 + 2 and not st.converged.any()
