"""b_mode="reversible" (RevDEQ): gradients against autograd through the same coupled iteration written out
here (independent of deqzoo.core.reversible), statistics, validation, and training memory against steps."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from deqzoo.core import DEQ, DEQConfig

torch.set_num_threads(1)


def coupled_unrolled(f, z0, steps: int, beta: float):
    """The paper's coupled iteration with plain autograd: the reference the reversible backward must equal."""
    z = y = z0
    for _ in range(steps):
        y = (1 - beta) * y + beta * f(z)
        z = (1 - beta) * z + beta * f(y)
    return z


def nonnormal_problem(dtype, d=24, b=5, seed=0):
    """f(z) = tanh(W z + U x) with W non-normal (strictly upper-triangular part dominant) and ill-conditioned
    (singular values spread over 1e4), spectral norm 0.95."""
    g = torch.Generator().manual_seed(seed)
    q1, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -4, d, dtype=torch.float64)
    w = torch.triu(torch.randn(d, d, generator=g, dtype=torch.float64), 1) * 3 + q1 @ torch.diag(s) @ q1.T
    w = 0.95 * w / torch.linalg.matrix_norm(w, 2)
    w = torch.nn.Parameter(w.to(dtype))
    u = torch.nn.Parameter(torch.randn(d, 3, generator=g, dtype=torch.float64).to(dtype))
    x = torch.randn(b, 3, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return w, u, x


def _grads(w, u, x, z0_scale, steps, beta, reversible: bool):
    inj = x @ u.T  # a non-leaf injection with its own graph
    z0 = z0_scale * torch.tanh(inj)  # an initial state that carries a graph too
    f = lambda z: torch.tanh(z @ w.T + inj)  # noqa: E731
    if reversible:
        deq = DEQ(DEQConfig(b_mode="reversible", f_max_iter=steps, b_mode_kwargs={"beta": beta}))
        z, stats = deq(f, z0)
    else:
        z, stats = coupled_unrolled(f, z0, steps, beta), None
    v = torch.linspace(-1, 1, z.numel(), dtype=z.dtype).reshape(z.shape)
    loss = (z * v).sum() + (z**2).sum()
    return z.detach(), torch.autograd.grad(loss, [w, u, x]), stats


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("steps,beta", [(1, 0.8), (4, 0.5), (8, 0.8), (8, 1.5), (16, 0.8)])
def test_reversible_gradients_equal_unrolled_autograd_float64(steps, beta):
    w, u, x = nonnormal_problem(torch.float64)
    z_rev, g_rev, stats = _grads(w, u, x, 0.5, steps, beta, True)
    z_ref, g_ref, _ = _grads(w, u, x, 0.5, steps, beta, False)
    torch.testing.assert_close(z_rev, z_ref, rtol=0, atol=1e-14)
    for a, b in zip(g_rev, g_ref):
        assert _rel(a, b) < 1e-10
    assert stats.nfe == 2 * steps + 1 and stats.solver == "reversible"


def test_reversible_with_a_normalisation_at_a_zero_start():
    """f normalises W z (as MDEQ's GroupNorm does) and starts at z0 = 0, where the normalisation's Jacobian
    is unbounded: a rebuilt z0 (zero plus rounding) would give a different f; the reversal ends on the saved
    z0 instead, so the gradient still equals autograd."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64) * 0.3)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)

    def f(z):
        return torch.relu(torch.nn.functional.layer_norm(z @ w.T, (16,)) + x)

    z0 = torch.zeros(3, 16, dtype=torch.float64)
    z, _ = DEQ(DEQConfig(b_mode="reversible", f_max_iter=6))(f, z0)
    got = torch.autograd.grad(z.pow(2).sum(), [w, x])
    want = torch.autograd.grad(coupled_unrolled(f, z0, 6, 0.8).pow(2).sum(), [w, x])
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-10


def test_reversible_float32_gradients_within_documented_bound():
    """float32, 8 steps at beta 0.8: rebuilt states lose up to 5^8 ulps, the gradient stays within 1e-4."""
    w, u, x = nonnormal_problem(torch.float64)
    _, g_ref, _ = _grads(w, u, x, 0.5, 8, 0.8, False)
    w32, u32, x32 = (t.detach().float().requires_grad_() for t in (w, u, x))
    _, g32, _ = _grads(w32, u32, x32, 0.5, 8, 0.8, True)
    for a, b in zip(g32, g_ref):
        assert _rel(a.double(), b) < 1e-4


def test_reversible_statistics_and_inference_forward():
    w, u, x = nonnormal_problem(torch.float64)
    inj = (x @ u.T).detach()
    f = lambda z: torch.tanh(z @ w.T + inj)  # noqa: E731
    deq = DEQ(DEQConfig(b_mode="reversible", f_max_iter=12, f_tol=1e-6, b_mode_kwargs={"beta": 0.8}))
    z0 = torch.zeros_like(inj)
    with torch.no_grad():
        z, stats = deq(f, z0)
        ref = coupled_unrolled(f, z0, 12, 0.8)
        fz = f(ref)
    z_grad, stats_grad = deq(f, z0)
    torch.testing.assert_close(z, ref, rtol=0, atol=1e-15)  # inference runs the same N-step map
    torch.testing.assert_close(z_grad.detach(), ref, rtol=0, atol=1e-15)
    abs_r = torch.linalg.vector_norm(fz - ref, dim=1)
    torch.testing.assert_close(stats.abs_residual, abs_r)
    torch.testing.assert_close(stats.rel_residual, abs_r / torch.linalg.vector_norm(fz, dim=1), rtol=1e-9,
                               atol=0)
    assert stats.nfe == 25 and stats.trace.shape == (12,)
    assert torch.equal(stats.converged, stats.rel_residual < 1e-6)
    assert float(stats.trace[-1]) == pytest.approx(float(stats.rel_residual.max()))


def test_reversible_multi_tensor_state_and_frozen_parameters():
    """A tuple state; a frozen parameter gets no gradient, the input still does (equal to autograd)."""
    torch.manual_seed(0)
    a = torch.nn.Linear(6, 6).double().requires_grad_(False)
    b = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)

    def f(zs):
        z1, z2 = zs
        return torch.tanh(0.5 * a(z1) + x), torch.tanh(0.5 * b(z2) + z1[:, :4])

    z0 = (torch.zeros(3, 6, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64))
    deq = DEQ(DEQConfig(b_mode="reversible", f_max_iter=6, b_mode_kwargs={"beta": 0.7}))
    zs, _ = deq(f, z0)
    grads = torch.autograd.grad(sum(t.pow(2).sum() for t in zs), [x, b.weight])
    packed = lambda z: torch.cat([t.reshape(3, -1) for t in z], 1)  # noqa: E731
    unpack = lambda p: (p[:, :6], p[:, 6:])  # noqa: E731
    ref = coupled_unrolled(lambda p: packed(f(unpack(p))), packed(z0), 6, 0.7)
    ref_grads = torch.autograd.grad(sum(t.pow(2).sum() for t in unpack(ref)), [x, b.weight])
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 1e-10
    assert a.weight.grad is None


def test_reversible_validation_and_double_backward_error():
    for beta in (1.0, 0.0, 2.0, -0.5, True, "0.8"):
        with pytest.raises(ValueError, match="beta"):
            DEQConfig(b_mode="reversible", b_mode_kwargs={"beta": beta})
    with pytest.raises(ValueError, match="does not accept"):
        DEQConfig(b_mode="reversible", b_mode_kwargs={"k": 3})
    for segment in (-1, 2.0, "2", True):
        with pytest.raises(ValueError, match=r"b_mode_kwargs\['segment'\]"):
            DEQConfig(b_mode="reversible", b_mode_kwargs={"segment": segment})
    for tol in (0, -1e-3, math.nan, "1e-4"):
        with pytest.raises(ValueError, match=r"b_mode_kwargs\['rebuild_tol'\]"):
            DEQConfig(b_mode="reversible", b_mode_kwargs={"rebuild_tol": tol})
    w, u, x = nonnormal_problem(torch.float64)
    deq = DEQ(DEQConfig(b_mode="reversible", f_max_iter=3))
    z, _ = deq(lambda z: torch.tanh(z @ w.T + x @ u.T), torch.zeros(5, 24, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="double backward"):  # asked for at the first backward
        torch.autograd.grad(z.sum(), [w], create_graph=True)
    with pytest.raises(ValueError, match="max_iter=0"):
        deq.solve_with(deq.config, lambda z: z * 0.5, torch.zeros(2, 3), max_iter=0)


def test_reversible_tensor_used_beside_its_own_source():
    """f uses a weight v directly and an offset made from v outside f (as Implicit²'s first layer does):
    each path counts once, as in autograd."""
    torch.manual_seed(0)
    v = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64) * 0.3)
    x = torch.randn(2, 4, dtype=torch.float64)
    grads = []
    for reversible in (True, False):
        offset = x @ v.T  # made from v, outside f
        f = lambda z, offset=offset: torch.tanh(z @ v.T + offset)  # noqa: E731
        z0 = torch.zeros(2, 4, dtype=torch.float64)
        if reversible:
            z, _ = DEQ(DEQConfig(b_mode="reversible", f_max_iter=5))(f, z0)
        else:
            z = coupled_unrolled(f, z0, 5, 0.8)
        grads.append(torch.autograd.grad(z.pow(2).sum(), v)[0])
    assert _rel(grads[0], grads[1]) < 1e-10


def peak_bytes(fn) -> int:
    """Peak of the bytes the CPU allocator holds while fn runs (torch profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def training_peak(mode: str, steps: int, **options) -> int:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 32) / 32**0.5 * 0.5)
    x = torch.randn(2048, 32)  # state 256 KiB: the states, not the weights, dominate memory
    kwargs = {"beta": 0.8, **options} if mode == "reversible" else {}
    deq = DEQ(DEQConfig(f_solver="fixed_point", b_mode=mode, f_max_iter=steps, f_tol=1e-30,
                        b_mode_kwargs=kwargs))

    def step():
        z, _ = deq(lambda z: torch.tanh(z @ w.T + x), torch.zeros(2048, 32))
        z.pow(2).sum().backward()

    return peak_bytes(step)


def test_reversible_training_memory_against_the_number_of_steps():
    """Peak allocator bytes of a forward + backward: with segment=0 (only z0 kept, the paper's method) the
    same at 4 and 32 steps (within 1%); with the default float32 segment (2) it grows by the kept states
    only (one (z, y) pair per 2 steps: 28 states from 4 to 32 steps; for this one-layer f as much as
    unrolled autograd keeps, for a deep f such as MDEQ's far less); unrolled autograd through the same
    number of plain steps (reference) grows with them."""
    state = 2048 * 32 * 4
    flat = {"segment": 0, "rebuild_tol": math.inf}
    rev4, rev32 = training_peak("reversible", 4, **flat), training_peak("reversible", 32, **flat)
    seg4, seg32 = training_peak("reversible", 4), training_peak("reversible", 32)
    unr4, unr32 = training_peak("unrolled", 4), training_peak("unrolled", 32)
    print(f"peak MiB: reversible (segment 0) 4 steps {rev4 / 2**20:.2f}, 32 steps {rev32 / 2**20:.2f}; "
          f"default segment 4 {seg4 / 2**20:.2f}, 32 {seg32 / 2**20:.2f}; "
          f"unrolled 4 {unr4 / 2**20:.2f}, 32 {unr32 / 2**20:.2f}")
    assert abs(rev32 - rev4) < 0.01 * rev4
    assert 27 * state <= seg32 - seg4 <= 28 * state + 0.01 * seg4
    assert unr32 - unr4 > 27 * state  # at least one state per extra step
