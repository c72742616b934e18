"""Engine features Implicit² trains with: fixed-point reuse, NPG with T terms, spectral-norm projection."""

import math

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig, FixedPointCache, SpectralProjector, neumann_backward


def _problem(dtype=torch.float64, n=6, b=3, non_normal=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, n, generator=g, dtype=dtype)
    if non_normal:  # a strongly non-normal contraction: large off-diagonal coupling, small spectral radius
        w = torch.triu(w, 1) * 3 + torch.eye(n, dtype=dtype) * 0.3
    w = w / torch.linalg.matrix_norm(w, ord=2) * 0.9
    u = torch.randn(n, n, generator=g, dtype=dtype)
    x = torch.randn(b, n, generator=g, dtype=dtype)
    return torch.nn.Parameter(w), torch.nn.Parameter(u), x


def _f(w, u, x):
    return lambda z: torch.tanh(z @ w.t() + x @ u.t())


def _solve_tight(f, z0, iters=3000):
    with torch.no_grad():
        z = z0
        for _ in range(iters):
            z = f(z)
    return z


@pytest.mark.parametrize("terms", [0, 1, 2, 5])
def test_npg_terms_match_dense_neumann_series(terms):
    """Gradients of NPG with T terms = (∂f/∂θ)ᵀ Σ_{i≤T} (Jᵀ)^i g, J the dense Jacobian at z* (float64)."""
    w, u, x = _problem()
    f = _f(w, u, x)
    cfg = DEQConfig(f_solver="fixed_point", f_max_iter=3000, f_tol=1e-13, **neumann_backward(terms))
    z, _ = DEQ(cfg)(f, torch.zeros_like(x))
    gout = torch.randn_like(z, generator=torch.Generator().manual_seed(1))
    (z * gout).sum().backward()
    got_w, got_u = w.grad.clone(), u.grad.clone()

    z_star = _solve_tight(f, torch.zeros_like(x))
    zf = z_star.detach().requires_grad_()
    fz = f(zf)
    # per-sample dense Jacobians (f acts row-wise)
    v = torch.zeros_like(gout)
    for i in range(x.shape[0]):
        xi = x[i]
        jac = torch.autograd.functional.jacobian(lambda zi, xi=xi: torch.tanh(zi @ w.t() + xi @ u.t()),
        z_star[i])
        term, acc = gout[i], gout[i].clone()
        for _ in range(terms):
            term = jac.t() @ term
            acc = acc + term
        v[i] = acc
    ref_w, ref_u = torch.autograd.grad(fz, (w, u), v)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got_u, ref_u, rtol=1e-8, atol=1e-10)


def test_npg_infinite_terms_is_ift_and_matches_unrolled_autograd():
    w, u, x = _problem()
    f = _f(w, u, x)
    assert neumann_backward(math.inf)["b_mode"] == "ift"
    cfg = DEQConfig(
        f_solver="fixed_point",
        f_max_iter=3000,
        f_tol=1e-13,
        b_solver="fixed_point",
        b_max_iter=3000,
        b_tol=1e-13,
        **neumann_backward(math.inf),
    )
    z, _ = DEQ(cfg)(f, torch.zeros_like(x))
    gout = torch.randn_like(z, generator=torch.Generator().manual_seed(1))
    (z * gout).sum().backward()
    got = w.grad.clone()
    w.grad = None
    zz = torch.zeros_like(x)
    for _ in range(400):  # autograd through a long unrolled solve (contraction 0.9: 0.9^400 ~ 5e-19)
        zz = f(zz)
    (zz * gout).sum().backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-7, atol=1e-9)


def test_npg_terms_rejects_bad_values():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises((ValueError, TypeError)):
            neumann_backward(bad)
    assert neumann_backward(0)["b_mode"] == "jacobian_free"
    assert DEQConfig(**neumann_backward(3)).b_mode_kwargs == {"k": 4, "tau": 1.0, "variant": "npg"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reuse_gives_the_same_fixed_point_and_gradients_with_fewer_fe(dtype):
    w, u, x = _problem(dtype=dtype)
    f = _f(w, u, x)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=2000, f_tol=tol, **neumann_backward(1)))
    cache = FixedPointCache()
    z_first, s_first = deq(f, cache.initial("k", torch.zeros_like(x), key_input=x))
    cache.store("k", z_first, key_input=x)
    assert cache.misses == 1 and len(cache) == 1

    def grads(z0):
        w.grad = u.grad = None
        z, stats = deq(f, z0)
        z.sum().backward()
        return z.detach(), w.grad.clone(), u.grad.clone(), stats

    z_re, gw_re, gu_re, s_re = grads(cache.initial("k", torch.zeros_like(x), key_input=x))
    z_no, gw_no, gu_no, s_no = grads(torch.zeros_like(x))
    assert cache.hits == 1
    assert s_re.nfe <= 2 < s_no.nfe
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(z_re, z_no, rtol=rtol, atol=rtol)
    torch.testing.assert_close(gw_re, gw_no, rtol=rtol, atol=rtol)
    torch.testing.assert_close(gu_re, gu_no, rtol=rtol, atol=rtol)


def test_cache_falls_back_for_another_batch_shape_or_nonfinite_state():
    cache = FixedPointCache()
    x = torch.randn(4, 3)
    cache.store("k", torch.ones(4, 5), key_input=x)
    default = torch.zeros(4, 5)
    assert cache.initial("k", default, key_input=x + 1e-3) is default  # other inputs
    assert cache.initial("k", torch.zeros(2, 5), key_input=x).shape == (2, 5)  # other shape: the default
    assert cache.initial("other", default, key_input=x) is default
    hit = cache.initial("k", default, key_input=x)
    assert torch.equal(hit, torch.ones(4, 5))
    hit.zero_()  # the caller may modify what it got without corrupting the cache
    assert torch.equal(cache.initial("k", default, key_input=x), torch.ones(4, 5))
    cache.store("k", torch.full((4, 5), float("nan")), key_input=x)
    assert "k" not in cache
    with pytest.raises(TypeError, match="tensor"):
        cache.store("k", [1.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spectral_projection_rescales_only_when_above_the_bound(dtype):
    g = torch.Generator().manual_seed(0)
    # ill-conditioned, with its top two singular values 1% apart (slow power iteration)
    q1, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -6, 64, dtype=torch.float64) * 5.0
    s[1] = s[0] * 0.99
    big = torch.nn.Parameter((q1 @ torch.diag(s) @ q2.t()).to(dtype))
    small = torch.nn.Parameter((q1 @ torch.diag(s / 10) @ q2.t()).to(dtype))  # σ = 0.5
    small_before = small.detach().clone()
    proj = SpectralProjector([big, small], max_norm=0.97)
    sigmas = proj.step()
    assert proj.last_scaled == 1
    assert sigmas[0] == pytest.approx(5.0, rel=1e-3) and sigmas[1] == pytest.approx(0.5, rel=1e-3)
    true = float(torch.linalg.matrix_norm(big.detach().double(), ord=2))
    assert 0.97 * (1 - 3e-3) <= true <= 0.97 * (1 + 1e-4)
    assert torch.equal(small.detach(), small_before)
    # an optimizer-like update pushes it out again; the warm-started projector pulls it back
    with torch.no_grad():
        big.mul_(1.5)
    proj.step()
    true = float(torch.linalg.matrix_norm(big.detach().double(), ord=2))
    assert true <= 0.97 * (1 + 1e-4)


def test_spectral_projector_validates_its_inputs():
    with pytest.raises(ValueError, match="2-D"):
        SpectralProjector([torch.zeros(3)])
    with pytest.raises(ValueError, match="max_norm"):
        SpectralProjector([torch.zeros(3, 3)], max_norm=0)


@pytest.mark.parametrize("terms", [1, math.inf])
def test_training_steps_do_not_keep_old_graphs_alive(terms):
    """The adjoint hook must not tie f(z*) into a cycle the collector cannot see (it leaked every step's
    graph)."""
    import gc
    import weakref

    w, u, x = _problem(dtype=torch.float32)
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=200, f_tol=1e-6, **neumann_backward(terms)))
    refs = []
    for _ in range(3):
        z, stats = deq(_f(w, u, x), torch.zeros_like(x))
        z.sum().backward()
        refs.append(weakref.ref(stats))
        fx = stats.extra.get("backward")  # noqa: F841 - only the weak reference below matters
        pair_ref = weakref.ref(z)
        del z, stats, fx
        gc.collect()
        assert pair_ref() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_step_reuse_is_the_original_one_step_forward_with_its_gradient(dtype):
    """FixedPointCache(hit_max_iter=0): on a hit no solve runs; the output is f(z_cached) and the gradient
    is the original's OnestepBackward, (∂f/∂θ)ᵀ (I + Jᵀ) g at z_cached (written out by hand here)."""
    w, u, x = _problem(dtype=dtype)
    f = _f(w, u, x)
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=500, f_tol=1e-3, **neumann_backward(1)))
    cache = FixedPointCache(hit_max_iter=0)
    z_miss, s_miss = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x)
    assert s_miss.nfe > 1 and cache.misses == 1  # the first step solves to the tolerance
    with torch.no_grad():
        w.mul_(0.97)  # an optimizer step moved the weights: the cached state is no longer the fixed point
    zc = cache.initial("k", torch.zeros_like(x), key_input=x).detach()
    gout = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)

    z_hit, s_hit = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x)
    (z_hit * gout).sum().backward()
    got = (w.grad.clone(), u.grad.clone())

    zl = zc.clone().requires_grad_()
    fz = f(zl)
    v = gout + torch.autograd.grad(fz, zl, gout, retain_graph=True)[0]  # (I + Jᵀ) g
    ref = torch.autograd.grad(fz, (w, u), v)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(z_hit.detach(), fz.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert s_hit.nfe == 0 and s_hit.solver == "no_solve"
    # the reported residual is the cached state's, from the same f call, not enforced against f_tol
    res = (fz - zc).norm(dim=1) / fz.norm(dim=1)
    torch.testing.assert_close(s_hit.rel_residual, res.detach().to(dtype), rtol=tol, atol=tol)
    # the cache now holds f(z_cached): repeated hits iterate f, so with fixed weights they reach z*
    assert torch.allclose(cache.initial("k", x, key_input=x), fz.detach())
    residuals = []
    for _ in range(40):
        with torch.no_grad():
            _, s = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x)
        residuals.append(float(s.rel_residual.max()))
        assert s.nfe == 1  # without autograd the one f step is the call's own evaluation
    assert residuals[-1] < 1e-3 * residuals[0] and residuals[-1] < (1e-5 if dtype == torch.float32 else 1e-9)


def test_reuse_budget_on_hits_and_bad_settings():
    w, u, x = _problem()
    f = _f(w, u, x)
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=500, f_tol=1e-12, **neumann_backward(1)))
    cache = FixedPointCache(hit_max_iter=2)
    _, first = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x)
    with torch.no_grad():
        w.mul_(0.9)
    _, hit = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x)
    _, miss = cache.solve(deq, "k", f, torch.zeros_like(x), key_input=x + 1)  # other inputs: full budget
    assert first.nfe > 2 and hit.nfe == 2 and miss.nfe > 2
    assert float(hit.rel_residual.max()) > 1e-12  # the budget, not the tolerance, ended the hit's solve
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="hit_max_iter"):
            FixedPointCache(hit_max_iter=bad)
        with pytest.raises(ValueError, match="max_iter"):
            deq.solve_with(deq.config, f, torch.zeros_like(x), max_iter=bad)
    z0 = torch.zeros_like(x)
    for mode in ({"b_mode": "unrolled"}, {"b_mode": "phantom", "b_mode_kwargs": {"variant": "upg"}},
                 {"b_mode": "shine"}):
        other = DEQ(DEQConfig(f_solver="broyden", f_max_iter=50, **mode))
        with pytest.raises(ValueError, match=f"b_mode='{mode['b_mode']}'"):
            other.solve_with(other.config, f, z0, max_iter=0)
    correction = DEQ(DEQConfig(f_max_iter=50, n_states=2))
    with pytest.raises(ValueError, match="n_states=2"):
        correction.solve_with(correction.config, f, z0, max_iter=0)
