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


def _non_normal_layer(d=48, b=7, dtype=torch.float64, seed=3):
    """tanh(W z + x) with W = 0.95·Q + a strictly upper-triangular part: ||W|| 3.5, spectral radius 1.6,
    cond(W) 100-165 (far from normal: the fixed-point map alone diverges)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=dtype))[0]
    W = 0.95 * Q + torch.triu(torch.randn(d, d, generator=g, dtype=dtype), 1) * 2.0 / d**0.5
    inj = torch.randn(b, d, generator=g, dtype=dtype)
    return (lambda z: torch.tanh(z @ W.T + inj)), torch.zeros(b, d, dtype=dtype)


@pytest.mark.parametrize("problem", ["non-contractive", "non-normal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_path_before_the_kernels_compile_takes_the_same_steps(monkeypatch, dtype, problem):
    """Until the kernels are compiled (a fresh install, or a GPU state, whose solve never waits for them),
    the torch path solves Anderson's mixing systems as batched torch ops (`hyper.least_squares_alpha`)
    instead of the kernel's per-sample loop: the same iterates, on maps where the mixing decides
    convergence (an orthogonal one scaled past 1, and a non-normal ill-conditioned one)."""
    monkeypatch.setattr(_kernels, "ENABLED", False)
    if problem == "non-normal":
        f, x0 = _non_normal_layer(dtype=dtype)
    else:
        f, x0 = _tanh_layer(norm=1.3, b=7, dtype=dtype, seed=2)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    z1, s1 = anderson(f, x0, max_iter=600, tol=tol, m=5)
    assert _kernels.host(_kernels.mixing_weights) is _kernels.mixing_weights  # this run: compiled
    monkeypatch.setattr(_kernels, "host", lambda fn: getattr(fn, "py_func", fn))  # as before compiling
    z2, s2 = anderson(f, x0, max_iter=600, tol=tol, m=5)
    assert s1.converged.all() and s2.converged.all(), (s1.nfe, s2.nfe)
    assert abs(s1.nfe - s2.nfe) <= 1, (s1.nfe, s2.nfe)
    torch.testing.assert_close(z1, z2, rtol=10 * tol, atol=10 * tol)


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
    """Both paths build Broyden's inverse estimate in the same product form: the same matrix, compared on
    random vectors. The problem is non-contractive (norm 1.2), so ~30 rank-one updates amplify rounding
    differences of the two summation orders: agreement to 1e-4 relative, far below the estimate's change
    between steps."""
    f, x0 = _tanh_layer(d=24, b=1, norm=1.2)
    (_, s1), (_, s2) = _both(monkeypatch, broyden, f, x0, max_iter=100, tol=1e-10, return_inverse=True)
    assert s1.nfe == s2.nfe
    v = torch.randn(1, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, b = s1.extra["inverse_jacobian"], s2.extra["inverse_jacobian"]
    torch.testing.assert_close(a.matvec(v), b.matvec(v), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(a.rmatvec(v), b.rmatvec(v), rtol=1e-4, atol=1e-7)


def test_keep_steps_match(monkeypatch):
    f, x0 = _tanh_layer(norm=0.9)
    (_, s1), (_, s2) = _both(monkeypatch, anderson, f, x0, max_iter=40, tol=1e-12, keep_steps=[2, 5])
    for k in (2, 5):
        torch.testing.assert_close(s1.extra["kept"][k], s2.extra["kept"][k], rtol=1e-10, atol=1e-10)


def test_workspace_keeps_one_oversized_entry_while_its_shape_repeats(monkeypatch):
    """A solve whose history exceeds the whole limit reuses it on the next solve of that shape (the buffers
    are the same arrays, not fresh ones); another oversized entry replaces it; limit 0 pools nothing."""
    monkeypatch.setattr(_kernels, "ENABLED", True)
    workspace.clear()
    f, x0 = _tanh_layer(d=64, b=4, norm=0.9)
    try:
        workspace.set_limit(1e-3)  # ~1 KiB: every history here is larger
        broyden(f, x0, max_iter=100, tol=1e-10)
        held = workspace.take(("broyden", 4, 64, 100, torch.float64))
        assert held is not None and workspace.pooled_bytes() == 0
        workspace.give(("broyden", 4, 64, 100, torch.float64), held, sum(a.nbytes for a in held[0]))
        S = held[0][0]
        broyden(f, x0, max_iter=100, tol=1e-10)  # reuses S (same array object, same capacity)
        again = workspace.take(("broyden", 4, 64, 100, torch.float64))
        assert again[0][0] is S
        workspace.give(("broyden", 4, 64, 100, torch.float64), again, S.nbytes)
        anderson(f, x0, max_iter=100, tol=1e-10)  # another oversized history replaces it
        assert workspace.take(("broyden", 4, 64, 100, torch.float64)) is None
        assert workspace.take(("anderson", 4, 64, 6, torch.float64)) is not None
        workspace.set_limit(0)
        anderson(f, x0, max_iter=100, tol=1e-10)
        assert workspace.pooled_bytes() == 0
    finally:
        workspace.set_limit(None)
        workspace.clear()


def test_workspace_pools_lends_exclusively_and_respects_the_limit(monkeypatch):
    workspace.clear()
    assert workspace.take("k") is None
    workspace.give("k", "first", nbytes=100)
    workspace.give("k", "second", nbytes=100)  # a nested solve's copy: the key is pooled already, dropped
    assert workspace.pooled_bytes() == 100
    workspace.give("k", "larger", nbytes=150)  # ...unless it is larger (more history capacity)
    assert workspace.pooled_bytes() == 150 and workspace.take("k") == "larger"
    workspace.give("k", "first", nbytes=100)
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


def test_mixing_weights_solve_every_sample_and_flag_failed_ones():
    """The batched Cholesky (samples innermost) against numpy's solver, one sample at a time, and against
    the same system in torch ops (`least_squares_alpha`, HyperAnderson's differentiable coding: the same
    weights, NaN where the kernel flags a failure)."""
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
    _kernels.mixing_weights(H, go, go.size, n, lam, W, ok)
    assert ok.tolist() == [True, False, True, False, True, True]
    np.testing.assert_allclose(W[:, 4], np.full(n, 1 / n))
    for k, b in enumerate(go):
        if ok[k] and b != 5:
            reg = lam * H[b].diagonal().max()
            a = np.linalg.solve(H[b] + reg * np.eye(n), np.ones(n))
            np.testing.assert_allclose(W[:, k], a / a.sum(), rtol=1e-9)
    from deqzoo.core.hyper import least_squares_alpha

    alpha = least_squares_alpha(torch.from_numpy(H[go]), lam).numpy()
    assert (np.isfinite(alpha).all(1) == ok).all(), alpha
    np.testing.assert_allclose(alpha[ok], W[:, ok].T, rtol=1e-9)


def test_track_bookkeeping_flags_freezing_and_trace_entry():
    """The per-step bookkeeping both paths share: best residuals, freezing, stepping samples, the trace
    entry (frozen samples count with their best), convergence, non-finite and divergence flags."""
    np = pytest.importorskip("numpy")
    best = np.array([[1.0, 2.0, 5.0], [1e-6, 1e-2, 0.5]])  # best absolute residuals, best relative ones
    active = np.array([0, 1, 1])  # sample 0 is frozen
    improved, go = np.zeros(3, bool), np.zeros(3, np.int64)
    f_sq = np.array([1.0, 100.0, 100.0])
    g_sq = np.array([7.0, 0.0001**2 * 100, 6.0**2])  # sample 1: rel 1e-4 (better, below tol 1e-3)
    flags, t, n_go = _kernels.track(g_sq, f_sq, best, active, improved, go, True, 1e-3, 1e6)
    assert improved.tolist() == [False, True, False] and active.tolist() == [0, 0, 1]
    assert n_go == 1 and go[0] == 2 and flags == 0
    assert t == pytest.approx(0.6)  # sample 2's step residual 6 / 10, above the frozen ones' best
    np.testing.assert_allclose(best[:, 1], [1e-3, 1e-4])  # |g| = 1e-3, |g| / |f| = 1e-4
    g_sq[2] = 1e-8 * 100  # sample 2 converges too: every best residual below tol
    flags, t, n_go = _kernels.track(g_sq, f_sq, best, active, improved, go, True, 1e-3, 1e6)
    assert flags == _kernels.CONVERGED and n_go == 0 and t == pytest.approx(1e-4)
    active[:] = 1
    best[:] = [[1.0, 2.0, 5.0], [0.5, 0.5, 0.5]]
    g_sq[:] = [1.0, 1.0, 1e4]  # abs mode: |g| = 100 > 10 x (largest best absolute 5): divergence
    flags, t, _ = _kernels.track(g_sq, f_sq, best, active, improved, go, False, 1e-3, 10.0)
    assert flags == _kernels.DIVERGED and t == 100.0
    g_sq[0] = np.nan  # a non-finite residual: flagged (and no divergence test), NaN in the trace
    flags, t, _ = _kernels.track(g_sq, f_sq, best, active, improved, go, False, 1e-3, 10.0)
    assert flags == _kernels.NONFINITE and np.isnan(t)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("solver", [anderson, broyden])
def test_solvers_check_what_f_returns_on_every_call(monkeypatch, solver, fused):
    """Called directly (not through `solve`, which checks f's output itself), both paths check every output
    of f: a misshapen output is an error naming both shapes, also after good ones, and so is another dtype;
    strided, grad-requiring or negated-view outputs are read as their values."""
    monkeypatch.setattr(_kernels, "ENABLED", fused)
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
    with pytest.raises(TypeError, match="f returned dtype torch.float64, expected torch.float32"):
        solver(lambda z: (0.5 * z + 1).double(), x0, max_iter=5, tol=1e-6)
    one = torch.ones(4, 8, requires_grad=True)

    def negated_view(z):  # the imaginary part of a conjugate: a tensor with the negative bit set
        return torch.complex(torch.zeros_like(z), -(0.5 * z + 1)).conj().imag

    for f in (
        lambda z: (0.5 * z + 1).t().contiguous().t(),
        lambda z: 0.5 * z + one,
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
