"""Backward modes against autograd through long unrolled solves (float64), phantom-gradient accuracy,
fixed-point correction states, training memory, DEQConfig validation and failure reporting."""

import warnings

import pytest
import torch
from torch import nn

from deqzoo.core import DEQ, DEQConfig, DEQConvergenceError, apply_norm, reset_norm

D = torch.float64


def _unrolled_reference(f, z0, steps=300):
    z = z0
    for _ in range(steps):
        z = f(z)
    return z


def _layer(d=6, seed=0, scale=0.5):
    torch.manual_seed(seed)
    W = nn.Parameter(torch.randn(d, d, dtype=D) * scale / d**0.5)
    U = nn.Parameter(torch.randn(d, d, dtype=D) / d**0.5)
    x = torch.randn(3, d, dtype=D, requires_grad=True)
    r = torch.randn(3, d, dtype=D)
    return W, U, x, r


def _grads(loss, params):
    return torch.autograd.grad(loss, params)


def _rel_err(a, b):
    return max(float((p - q).norm() / q.norm()) for p, q in zip(a, b))


@pytest.mark.parametrize("b_solver", ["anderson", "gmres", "broyden", "fixed_point"])
def test_ift_matches_unrolled_autograd_single_tensor(b_solver):
    W, U, x, r = _layer()
    f = lambda z: torch.tanh(z @ W.T + x @ U.T)  # noqa: E731
    ref = _grads((_unrolled_reference(f, torch.zeros(3, 6, dtype=D)) * r).sum(), (W, U, x))
    deq = DEQ(
        DEQConfig(
            f_solver="anderson",
            f_max_iter=100,
            f_tol=1e-13,
            b_mode="ift",
            b_solver=b_solver,
            b_max_iter=300,
            b_tol=1e-13,
        )
    )
    z, stats = deq(f, torch.zeros(3, 6, dtype=D))
    got = _grads((z * r).sum(), (W, U, x))
    assert stats.converged.all()
    assert _rel_err(got, ref) < 1e-6
    assert stats.extra["backward"].converged.all()


def test_ift_matches_unrolled_autograd_tuple_state():
    torch.manual_seed(1)
    W1 = nn.Parameter(0.3 * torch.randn(4, 4, dtype=D))
    W2 = nn.Parameter(0.3 * torch.randn(2, 3, 3, dtype=D))
    M = nn.Parameter(0.2 * torch.randn(4, 18, dtype=D))
    x1 = torch.randn(5, 4, dtype=D, requires_grad=True)
    x2 = torch.randn(5, 2, 3, 3, dtype=D, requires_grad=True)

    def f(zs):
        a, b = zs
        na = torch.tanh(a @ W1.T + b.flatten(1) @ M.T + x1)
        nb = torch.tanh(torch.einsum("cij,bcjk->bcik", W2, b) + 0.3 * a.mean(1)[:, None, None, None] + x2)
        return na, nb

    z0 = (torch.zeros(5, 4, dtype=D), torch.zeros(5, 2, 3, 3, dtype=D))
    ra, rb = torch.randn(5, 4, dtype=D), torch.randn(5, 2, 3, 3, dtype=D)
    za, zb = _unrolled_reference(f, z0)
    params = (W1, W2, M, x1, x2)
    ref = _grads((za * ra).sum() + (zb * rb).sum(), params)
    deq = DEQ(DEQConfig(f_max_iter=100, f_tol=1e-13, b_solver="gmres", b_max_iter=200, b_tol=1e-13))
    (za, zb), stats = deq(f, z0)
    assert isinstance((za, zb), tuple) and zb.shape == (5, 2, 3, 3)
    got = _grads((za * ra).sum() + (zb * rb).sum(), params)
    assert _rel_err(got, ref) < 1e-6


def _geng_setting(d=32, seed=0):
    """One layer z = tanh(W (z + x)) with spectral normalization and random weights (Geng et al., 2021)."""
    torch.manual_seed(seed)
    lin = nn.Linear(d, d, bias=False).double()
    nn.init.normal_(lin.weight)
    apply_norm(lin, "spectral_norm", learn_scale=False, target_norm=1.0)
    x = torch.randn(8, d, dtype=D)
    r = torch.randn(8, d, dtype=D)
    return lin, x, r


def _mode_grad(lin, x, r, **cfg):
    reset_norm(lin)
    deq = DEQ(
        DEQConfig(
            f_solver="broyden",
            f_max_iter=200,
            f_tol=1e-12,
            b_solver="gmres",
            b_max_iter=200,
            b_tol=1e-12,
            **cfg,
        )
    )
    z, _ = deq(lambda z: torch.tanh(lin(z + x)), torch.zeros_like(x))
    (g,) = torch.autograd.grad((z * r).sum(), [lin.weight_orig])
    return g.flatten()


@pytest.mark.parametrize("variant", ["upg", "npg"])
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_phantom_gradient_cosine_rises_with_k(variant, tau):
    lin, x, r = _geng_setting()
    exact = _mode_grad(lin, x, r, b_mode="ift")
    cos = []
    for k in (1, 2, 5, 10, 20):
        g = _mode_grad(lin, x, r, b_mode="phantom", b_mode_kwargs={"k": k, "tau": tau, "variant": variant})
        cos.append(float(torch.nn.functional.cosine_similarity(g, exact, dim=0)))
    assert all(b >= a - 1e-6 for a, b in zip(cos, cos[1:])), cos  # rises until it saturates at ~1
    assert cos[-1] > 0.99 and cos[0] < cos[-1], cos


def test_jacobian_free_and_shine_approximate_the_exact_gradient():
    lin, x, r = _geng_setting(seed=3)
    exact = _mode_grad(lin, x, r, b_mode="ift")
    cos = lambda g: float(torch.nn.functional.cosine_similarity(g, exact, dim=0))  # noqa: E731
    jfb = cos(_mode_grad(lin, x, r, b_mode="jacobian_free"))
    shine = cos(_mode_grad(lin, x, r, b_mode="shine"))
    refined = cos(_mode_grad(lin, x, r, b_mode="shine", b_mode_kwargs={"refine": 30}))
    assert 0.5 < jfb < shine < refined and shine > 0.9 and refined > 0.9999, (jfb, shine, refined)
    with pytest.raises(ValueError, match="broyden"):
        DEQConfig(f_solver="anderson", b_mode="shine")


def test_unrolled_mode_is_autograd_through_the_iteration_with_and_without_checkpointing():
    W, U, x, r = _layer()
    f = lambda z: torch.tanh(z @ W.T + x @ U.T)  # noqa: E731
    ref = _grads((_unrolled_reference(f, torch.zeros(3, 6, dtype=D), steps=7) * r).sum(), (W, U, x))
    for ckpt in (0, 3):
        deq = DEQ(DEQConfig(f_max_iter=7, f_tol=1e-15, b_mode="unrolled", b_mode_kwargs={"checkpoint": ckpt}))
        z, stats = deq(f, torch.zeros(3, 6, dtype=D))
        assert stats.nfe == 7 and stats.solver == "unrolled"
        got = _grads((z * r).sum(), (W, U, x))
        assert _rel_err(got, ref) < 1e-12


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while fn runs: the training-memory footprint."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_ift_training_memory_does_not_grow_with_iterations_unrolled_does():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64)

    def step(mode, iters):
        deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=iters, f_tol=1e-30, b_mode=mode))
        holder = {}

        def run():
            holder["z"], holder["stats"] = deq(lambda z: torch.tanh(0.9 * lin(z) + x), torch.zeros(16, 64))

        nbytes = _saved_bytes(run)
        holder["z"].sum().backward()
        assert holder["stats"].nfe == iters
        return nbytes

    ift5, ift50 = step("ift", 5), step("ift", 50)
    assert ift50 <= 1.05 * ift5
    unr5, unr50 = step("unrolled", 5), step("unrolled", 50)
    assert unr50 > 5 * unr5 and unr5 > ift5


def test_fixed_point_correction_states():
    W, U, x, r = _layer(d=5)
    f = lambda z: torch.tanh(z @ W.T + x @ U.T)  # noqa: E731
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=12, f_tol=1e-15, n_states=3))
    z, stats = deq(f, torch.zeros(3, 5, dtype=D))
    assert len(stats.states) == 3 and torch.equal(stats.states[-1], z)
    assert all(s.requires_grad for s in stats.states)
    # state at iteration 4: the 4th iterate from zeros, plus one phantom step
    it = torch.zeros(3, 5, dtype=D)
    with torch.no_grad():
        for _ in range(3):
            it = f(it)
        torch.testing.assert_close(stats.states[0], f(it))
    sum(((s - 1) ** 2).sum() for s in stats.states).backward()
    assert W.grad is not None and torch.isfinite(W.grad).all()
    # explicit indices with the unrolled mode keep the unrolled iterates themselves
    deq = DEQ(DEQConfig(f_max_iter=6, f_tol=1e-15, b_mode="unrolled", state_indices=[2, 6]))
    z, stats = deq(f, torch.zeros(3, 5, dtype=D))
    torch.testing.assert_close(stats.states[0], f(f(torch.zeros(3, 5, dtype=D))))
    assert torch.equal(stats.states[1], z)
    with torch.no_grad():
        _, stats = deq(f, torch.zeros(3, 5, dtype=D))
    assert stats.states is None


def test_randomized_f_max_iter_in_training_only():
    W, U, x, r = _layer(d=5)
    f = lambda z: torch.tanh(z @ W.T + x @ U.T)  # noqa: E731
    deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=20, f_max_iter_min=3, f_tol=1e-30))
    torch.manual_seed(0)
    nfes = {deq(f, torch.zeros(3, 5, dtype=D))[1].nfe for _ in range(12)}
    assert len(nfes) > 3 and min(nfes) >= 3 and max(nfes) <= 20
    with torch.no_grad():
        assert deq(f, torch.zeros(3, 5, dtype=D))[1].nfe == 20
    with pytest.raises(ValueError, match="f_max_iter_min"):
        DEQConfig(f_max_iter=5, f_max_iter_min=6)


def test_on_nonconvergence_ignore_warn_raise():
    f = lambda z: torch.tanh(2.0 * z + 1)  # noqa: E731
    z0 = torch.zeros(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=2, f_tol=1e-9))(f, z0)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=2, f_tol=1e-9, on_nonconvergence="warn"))(f, z0)
    with pytest.raises(DEQConvergenceError) as info:
        DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=2, f_tol=1e-9, on_nonconvergence="raise"))(f, z0)
    assert info.value.stats.nfe == 2 and not info.value.stats.converged.any()


def test_config_validation_and_json_round_trip():
    cfg = DEQConfig(
        f_solver="broyden",
        f_solver_kwargs={"m": 10},
        b_mode="phantom",
        b_mode_kwargs={"k": 7, "tau": 0.5, "variant": "npg"},
        n_states=2,
        jac_reg_samples=1,
    )
    assert DEQConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match=r"not registered.*'anderson'.*'broyden'"):
        DEQConfig(f_solver="newton")
    with pytest.raises(ValueError, match=r"b_mode='adjoint'.*'ift'.*'phantom'"):
        DEQConfig(b_mode="adjoint")
    for bad in (
        {"f_tol": 0},
        {"b_tol": -1e-3},
        {"f_max_iter": 0},
        {"b_max_iter": 0},
        {"f_solver_kwargs": {"tau": 1.5}},
        {"f_solver_kwargs": {"tau": 0.0}},
        {"b_mode": "phantom", "b_mode_kwargs": {"tau": 2}},
        {"correction_tau": 0},
    ):
        with pytest.raises(ValueError):
            DEQConfig(**bad)
    with pytest.raises(ValueError, match=r"\['mem'\].*accepts.*'m'"):
        DEQConfig(f_solver_kwargs={"mem": 3})
    with pytest.raises(ValueError, match=r"\['k'\].*'ift'"):
        DEQConfig(b_mode_kwargs={"k": 3})
    with pytest.raises(ValueError, match="Unknown DEQConfig key"):
        DEQConfig.from_dict({"f_iters": 3})


def test_deq_bad_input_errors():
    deq = DEQ(DEQConfig())
    with pytest.raises(ValueError, match="non-finite"):
        deq(lambda z: z, torch.full((2, 3), float("inf")))
    with pytest.raises(ValueError, match=r"shape \(2, 2\).*\(2, 3\)"):
        deq(lambda z: z[:, :2], torch.zeros(2, 3))
    with pytest.raises(TypeError, match="tensor"):
        deq(lambda z: z, [1.0, 2.0])
