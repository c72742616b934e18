"""The fused CPU kernels (numba) against the torch path of the same solvers, and their extra guarantees:
batch invariance, the caller's x0 untouched, the same inverse-Jacobian estimate, pooled workspaces."""

import pytest
import torch

from deqzoo.core import _kernels, workspace
from deqzoo.core.solvers import anderson, broyden

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")


def _both(monkeypatch, solver, f, x0, **kw):
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(_kernels, "ENABLED", fused)
        out[fused] = solver(f, x0, **kw)
    return out[True], out[False]


def _tanh_layer(d=48, b=5, norm=0.9, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=dtype))[0] * norm
    inj = torch.randn(b, d, generator=g, dtype=dtype)
    return (lambda z: torch.tanh(z @ W.T + inj)), torch.zeros(b, d, dtype=dtype)


@pytest.mark.parametrize("solver,kw", [(anderson, {}), (anderson, {"m": 3, "tau": 0.7}), (broyden, {})])
@pytest.mark.parametrize("norm", [0.9, 1.2])
def test_fused_and_torch_paths_agree(monkeypatch, solver, kw, norm):
    f, x0 = _tanh_layer(norm=norm)
    (z1, s1), (z2, s2) = _both(monkeypatch, solver, f, x0, max_iter=600, tol=1e-10, **kw)
    assert s1.converged.all() and s2.converged.all(), (s1.nfe, s2.nfe)
    # same method: same step count (a converged sample stops changing in the fused path, so iterates
    # agree to the tolerance, not bitwise)
    assert abs(s1.nfe - s2.nfe) <= 1, (s1.nfe, s2.nfe)
    torch.testing.assert_close(z1, z2, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(s1.abs_residual, (f(z1) - z1).norm(dim=1), rtol=1e-6, atol=1e-14)


def test_float32_broyden_steps_stored_as_int16_keep_the_step_count(monkeypatch):
    f, x0 = _tanh_layer(d=128, b=8, norm=1.5, dtype=torch.float32)
    (z1, s1), (z2, s2) = _both(monkeypatch, broyden, f, x0, max_iter=200, tol=1e-5)
    assert s1.converged.all() and s2.converged.all() and abs(s1.nfe - s2.nfe) <= 2, (s1.nfe, s2.nfe)


def test_broyden_float_step_storage_agrees(monkeypatch):
    """The kernel also stores float steps as they are (qmax = 0); same iterates as the int16 storage up to
    the rounding of the stored steps."""
    from deqzoo.core import solvers

    monkeypatch.setattr(_kernels, "ENABLED", True)
    f, x0 = _tanh_layer(d=64, b=4, norm=1.2, dtype=torch.float32)
    z_q, s_q = broyden(f, x0, max_iter=200, tol=1e-5)
    monkeypatch.setitem(solvers._BROYDEN_STORAGE, torch.float32, torch.float32)
    z_f, s_f = broyden(f, x0, max_iter=200, tol=1e-5)
    assert s_q.converged.all() and s_f.converged.all() and abs(s_q.nfe - s_f.nfe) <= 1
    torch.testing.assert_close(z_q, z_f, rtol=1e-4, atol=1e-4)


def test_batch_invariance(monkeypatch):
    """Each sample stops at its own tolerance and is then frozen: its result and its residual do not depend
    on the other samples of the batch."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    g = torch.Generator().manual_seed(1)
    W = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))[0] * 0.95
    scales = torch.logspace(-1, 0.5, 6, dtype=torch.float64)[:, None]  # samples converge at different steps
    inj = torch.randn(6, 48, generator=g, dtype=torch.float64) * scales
    x0 = torch.zeros(6, 48, dtype=torch.float64)
    for solver in (anderson, broyden):
        z, st = solver(lambda z: torch.tanh(z @ W.T + inj), x0, max_iter=300, tol=1e-9)
        assert st.converged.all()
        for i in range(6):
            zi, si = solver(
                lambda z, i=i: torch.tanh(z @ W.T + inj[i : i + 1]), x0[i : i + 1], max_iter=300, tol=1e-9
            )
            torch.testing.assert_close(zi, z[i : i + 1], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(si.abs_residual, st.abs_residual[i : i + 1], rtol=1e-6, atol=1e-15)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_broyden_samples_swept_in_pairs_match_their_own_solves(monkeypatch, dtype, tol):
    """The kernel sweeps two samples' stored steps side by side; a sample paired with another that holds a
    different number of steps (samples 1 and 4 restart at every step: their residual never changes, so
    every secant denominator is 0) still gets exactly its own solve."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    g = torch.Generator().manual_seed(2)
    W = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))[0].to(dtype) * 1.2
    inj = torch.randn(6, 40, generator=g, dtype=torch.float64).to(dtype)
    stuck = torch.zeros(6, 1, dtype=torch.bool)
    stuck[[1, 4]] = True

    def f(z, rows=slice(None)):
        return torch.where(stuck[rows], z + 1.0, torch.tanh(z @ W.T + inj[rows]))

    x0 = torch.zeros(6, 40, dtype=dtype)
    z, st = broyden(f, x0, max_iter=60, tol=tol)
    assert st.converged.tolist() == [True, False, True, True, False, True]
    for i in range(6):
        zi, si = broyden(lambda z, i=i: f(z, slice(i, i + 1)), x0[i : i + 1], max_iter=60, tol=tol)
        torch.testing.assert_close(zi, z[i : i + 1], rtol=10 * tol, atol=10 * tol)
        assert si.converged.item() == st.converged[i].item()


def test_caller_x0_is_never_written_and_result_is_fresh(monkeypatch):
    monkeypatch.setattr(_kernels, "ENABLED", True)
    f, _ = _tanh_layer(norm=0.9)
    x0 = torch.randn(5, 48, dtype=torch.float64)
    x0_copy = x0.clone()
    for solver in (anderson, broyden):
        z, _ = solver(f, x0, max_iter=50, tol=1e-8)
        assert torch.equal(x0, x0_copy) and z.data_ptr() != x0.data_ptr()
        z2, _ = solver(f, x0, max_iter=50, tol=1e-8)  # the next solve reuses the pooled buffers...
        assert z.data_ptr() != z2.data_ptr()  # ...but never the returned tensors
        torch.testing.assert_close(z, z2)


def test_same_inverse_jacobian_estimate_in_both_paths(monkeypatch):
    """The fused path stores Broyden's steps (product form), the torch path rank-one pairs: the same
    matrix, compared on random vectors. (One sample: in a batch the fused path stops updating a sample's
    estimate once it converges, the torch path goes on until the whole batch has.)"""
    f, x0 = _tanh_layer(d=24, b=1, norm=1.2)
    (_, s1), (_, s2) = _both(monkeypatch, broyden, f, x0, max_iter=100, tol=1e-10, return_inverse=True)
    assert s1.nfe == s2.nfe
    v = torch.randn(1, 24, dtype=torch.float64)
    a, b = s1.extra["inverse_jacobian"], s2.extra["inverse_jacobian"]
    torch.testing.assert_close(a.matvec(v), b.matvec(v), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(a.rmatvec(v), b.rmatvec(v), rtol=1e-6, atol=1e-8)


def test_keep_steps_match(monkeypatch):
    f, x0 = _tanh_layer(norm=0.9)
    (_, s1), (_, s2) = _both(monkeypatch, anderson, f, x0, max_iter=40, tol=1e-12, keep_steps=[2, 5])
    for k in (2, 5):
        torch.testing.assert_close(s1.extra["kept"][k], s2.extra["kept"][k], rtol=1e-10, atol=1e-10)


def test_workspace_pools_lends_exclusively_and_respects_the_limit(monkeypatch):
    workspace.clear()
    assert workspace.take("k") is None
    workspace.give("k", "first", nbytes=100)
    workspace.give("k", "second", nbytes=100)  # a nested solve's copy: the key is pooled already, dropped
    assert workspace.pooled_bytes() == 100
    assert workspace.take("k") == "first" and workspace.take("k") is None  # on loan: not lent twice
    assert workspace.pooled_bytes() == 0
    try:
        workspace.set_limit(1e-4)  # 104 bytes
        monkeypatch.setenv("DEQZOO_WORKSPACE_MB", "0")
        workspace.give("k", "first", nbytes=100)  # the variable is not read per call: still pooled
        workspace.give("j", "second", nbytes=100)  # 200 > 104: dropped
        assert workspace.pooled_bytes() == 100 and workspace.take("j") is None
        workspace.set_limit(None)  # re-read: 0 MiB, so nothing more fits
        workspace.give("j", "second", nbytes=1)
        assert workspace.take("j") is None and workspace.take("k") == "first"
    finally:
        monkeypatch.delenv("DEQZOO_WORKSPACE_MB")
        workspace.set_limit(None)
        workspace.clear()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_abs_bits_max_matches_numpy_and_propagates_nan(dtype):
    """Broyden's kernel scales a stored step by its largest |entry|, taken as an integer max over
    `_abs_bits` (vectorises, unlike numba's float max): that max must order like |x| with NaN above inf."""
    np = pytest.importorskip("numpy")
    numba = pytest.importorskip("numba")

    @numba.njit
    def absmax(v):
        m = _kernels._abs_bits(v[0])
        for i in range(1, v.shape[0]):
            m = max(m, _kernels._abs_bits(v[i]))
        return _kernels._from_bits(m)

    rng = np.random.default_rng(0)
    v = rng.standard_normal(515).astype(dtype)  # odd length: the vector loop's remainder counts too
    v[514] = -7.5
    assert absmax(v) == float(np.abs(v).max()) == 7.5
    v[3] = -np.inf
    assert absmax(v) == np.inf
    v[100] = np.nan  # above inf: a non-finite step must not get a finite scale
    assert np.isnan(absmax(v))
    assert absmax(np.zeros(8, dtype)) == 0.0


def test_mixing_weights_solve_every_sample_and_flag_failed_ones():
    """The batched Cholesky (samples innermost) against numpy's solver, one sample at a time."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    B, n, lam = 8, 5, 1e-5
    R = rng.standard_normal((B, n, 32))
    H = R @ R.transpose(0, 2, 1)
    H[2] = -np.eye(n)  # a negative pivot
    H[4, 0, 0] = np.nan
    H[5] = 0.0  # a constant f: zero residuals; every combination is as good, the weights stay finite
    go = np.array([0, 2, 3, 4, 5, 7])
    W, ok = np.empty((n, go.size)), np.zeros(go.size, bool)
    _kernels._mixing_weights(H, go, go.size, n, lam, W, ok)
    assert ok.tolist() == [True, False, True, False, True, True]
    np.testing.assert_allclose(W[:, 4], np.full(n, 1 / n))
    for k, b in enumerate(go):
        if ok[k] and b != 5:
            reg = lam * H[b].diagonal().max()
            a = np.linalg.solve(H[b] + reg * np.eye(n), np.ones(n))
            np.testing.assert_allclose(W[:, k], a / a.sum(), rtol=1e-9)


def test_step_status_flags_and_trace_entry():
    """The kernels' end-of-step bookkeeping: trace entry, convergence, non-finite and divergence flags."""
    np = pytest.importorskip("numpy")
    best = np.array([[1.0, 2.0], [1e-6, 1e-7]])  # best absolute residuals, best relative ones
    step_r, step_abs, trace = np.array([0.5, 0.25]), np.array([1.0, 3.0]), np.zeros(3)
    # rel mode: every best relative residual is below tol; 3 <= 10 x (largest best absolute 2)
    assert _kernels._finish(step_r, step_abs, best, True, 1e-5, 10.0, trace, 1) == _kernels.CONVERGED
    assert trace.tolist() == [0.0, 0.5, 0.0]
    step_abs[1] = 30.0  # abs mode: not converged, and 30 > 10 x 2 is divergence
    assert _kernels._finish(step_r, step_abs, best, False, 1e-5, 10.0, trace, 2) == _kernels.DIVERGED
    step_r[0] = np.nan  # a non-finite residual: flagged (and no divergence test), NaN in the trace
    flags = _kernels._finish(step_r, step_abs, best, True, 1e-5, 10.0, trace, 0)
    assert flags == _kernels.CONVERGED | _kernels.NONFINITE and np.isnan(trace[0])


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_fused_path_checks_what_f_returns(monkeypatch, solver):
    """Called directly (not through `solve`, which checks f's output itself), the fused path never reads past
    its buffers: a misshapen output is an error naming both shapes, and so is a misshapen output after good
    ones; strided, grad-requiring, other-dtype or negated-view outputs are read as their values."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    x0 = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"f returned shape \(5, 8\), expected \(4, 8\)"):
        solver(lambda z: torch.zeros(5, 8), x0, max_iter=5, tol=1e-6)
    calls = []

    def shrinks(z):  # fine twice, then one sample short
        calls.append(1)
        return 0.5 * z + 1 if len(calls) < 3 else torch.zeros(3, 8)

    with pytest.raises(ValueError, match=r"f returned shape \(3, 8\), expected \(4, 8\)"):
        solver(shrinks, x0, max_iter=50, tol=1e-6)
    with pytest.raises(TypeError, match="f returned tuple, expected a tensor of shape"):
        solver(lambda z: (z,), x0, max_iter=5, tol=1e-6)
    one = torch.ones(4, 8, requires_grad=True)

    def negated_view(z):  # the imaginary part of a conjugate: a tensor with the negative bit set
        return torch.complex(torch.zeros_like(z), -(0.5 * z + 1)).conj().imag

    for f in (
        lambda z: (0.5 * z + 1).t().contiguous().t(),
        lambda z: 0.5 * z + one,
        lambda z: (0.5 * z + 1).double(),
        negated_view,
    ):
        z, stats = solver(f, x0, max_iter=50, tol=1e-6)
        assert stats.converged.all() and not z.requires_grad
        torch.testing.assert_close(z, torch.full((4, 8), 2.0))


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_nested_solves_of_one_shape_never_share_pooled_buffers(monkeypatch, solver):
    """f itself runs a solve of the same shape and settings (the same pooled buffers, if they were shared)."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    g = torch.Generator().manual_seed(3)
    W = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))[0] * 0.9
    inj = torch.randn(5, 16, generator=g, dtype=torch.float64)
    x0 = torch.zeros(5, 16, dtype=torch.float64)

    def f_direct(z):
        return torch.tanh(z @ W.T + inj)

    def f_nested(z):  # the pre-activation as the fixed point of y = (y + z Wᵀ + inj) / 2
        pre = z @ W.T + inj
        y, st = solver(lambda y: 0.5 * (y + pre), x0, max_iter=200, tol=1e-13)
        assert st.converged.all()
        return torch.tanh(y)

    workspace.clear()
    z_direct, _ = solver(f_direct, x0, max_iter=200, tol=1e-10)
    pooled = workspace.pooled_bytes()
    z_nested, _ = solver(f_nested, x0, max_iter=200, tol=1e-10)
    torch.testing.assert_close(z_nested, z_direct, rtol=1e-8, atol=1e-8)
    assert pooled > 0 and workspace.pooled_bytes() == pooled  # the solve's buffers are pooled once


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_float32_norms_fall_back_to_float64_past_overflow(monkeypatch, solver):
    """The kernels sum float32 squares in float32; where that overflows (|f|² ~ 7e39 here, float32 stops at
    3.4e38) they sum again in float64, so a finite state never reads as non-finite."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    c = torch.full((2, 8), 3e19)
    z, st = solver(lambda z: 0.5 * z + c, torch.zeros(2, 8), max_iter=50, tol=1e-5)
    assert not st.nonfinite and st.converged.all()
    torch.testing.assert_close(z, 2 * c, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        st.abs_residual.double(), (0.5 * z + c - z).double().norm(dim=1), rtol=1e-5, atol=0
    )


def test_run_header_holds_the_buffers_and_entries_are_the_compiled_steps():
    """The header a step reads its buffers through: shapes and addresses of the run's own arrays (a strided
    buffer is refused); an entry point is compiled once per argument types and computes what the dispatcher
    computes (a direct call of the same step on a copy of the state)."""
    import numpy as np

    b, d, m = 3, 8, 4
    X, loc, active = np.zeros((2, b, d), np.float32), np.zeros(b, np.int64), np.ones(b, np.bool_)
    best, trace = np.full((2, b), np.inf), np.zeros(10)
    S, Q, count = np.zeros((b, m, d), np.int16), np.zeros((3, b, m)), np.zeros(b, np.int64)
    h = _kernels.header(X, loc, active, best, trace, (S, Q, count))
    assert list(h[:4]) == [b, d, 10, m] and h[4] == X.ctypes.data and h[10] == S.ctypes.data
    with pytest.raises(ValueError, match="run buffer at header slot 11 is not C-contiguous"):
        _kernels.header(X, loc, active, best, trace, (S, np.zeros((b, 3, m)).transpose(1, 0, 2), count))

    best_x = np.zeros((b, d), np.float32)
    h[_kernels.H_BEST_X] = best_x.ctypes.data
    args = (np.float32(0), np.int16(0), 32767.0, True, 1e-6, 1e6)
    step = _kernels.entry_point(_kernels.broyden_entry, (0, 0, 0, *args))
    assert step is _kernels.entry_point(_kernels.broyden_entry, (1, 2, 3, *args))  # compiled once
    fx = np.random.default_rng(0).standard_normal((b, d)).astype(np.float32)
    copies = [a.copy() for a in (X, S, Q, count, active, best_x, loc, best, trace)]
    for k in range(3):  # the same three steps, through the header and directly on the copies
        flags = step(k, fx.ctypes.data, _kernels.address(h), *args)
        X2, S2, Q2, c2, a2, bx2, l2, b2, t2 = copies
        flags2 = _kernels.broyden_step(k, fx, X2, S2, 32767.0, Q2, c2, a2, bx2, l2, b2, t2, True, 1e-6, 1e6)
        assert flags == flags2
        np.testing.assert_array_equal(X, X2)
        np.testing.assert_array_equal(S, S2)
        np.testing.assert_array_equal(best, b2)
        fx = fx * 0.5 + 0.1
