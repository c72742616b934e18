"""DEQ(..., defer_graphs=True): the output and the fixed-point-correction states come back as DeferredState
objects whose graphs, built one at a time, give the same values and gradients as the eager forward's."""

from __future__ import annotations

import pytest
import torch

from deqzoo.core import DEQ, DeferredState, DEQConfig, backward_in_stages


def _problem():
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(6, 6).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    return lin, x, lambda z: (torch.tanh(lin(z[0]) + x), 0.5 * z[1] + 0.1 * z[0].sum(1, keepdim=True))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(f_solver="fixed_point", b_mode="phantom", b_mode_kwargs={"k": 2, "tau": 0.7}, n_states=3),
        dict(f_solver="anderson", b_mode="ift", state_indices=[2, 4], correction_k=2, correction_tau=0.5),
        dict(f_solver="fixed_point", b_mode="jacobian_free", n_states=2, f_tol=1e-2),  # stops early
    ],
)
def test_deferred_states_match_the_eager_graphs(cfg):
    lin, x, f = _problem()
    deq = DEQ(DEQConfig(f_max_iter=12, **{"f_tol": 1e-10, **cfg}))
    z0 = (torch.zeros(3, 6, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64))
    weights = [0.3, 0.7, 1.0]

    def loss_of(states):
        return sum(w * (s[0].pow(2).sum() + s[1].sum()) for w, s in zip(weights, states))

    z, stats = deq(f, z0)
    loss_of(stats.states).backward()
    eager = [t.grad.clone() for t in (lin.weight, lin.bias, x)]
    values = [tuple(t.detach() for t in s) for s in stats.states]
    for t in (lin.weight, lin.bias, x):
        t.grad = None

    out, dstats = deq(f, z0, defer_graphs=True)
    assert isinstance(out, DeferredState) and all(isinstance(s, DeferredState) for s in dstats.states)
    assert dstats.nfe == stats.nfe and len(dstats.states) == len(stats.states)
    for got, want in zip(out.value(), z):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-14)
    for w, state, value in zip(weights, dstats.states, values):
        s = state()  # one graph at a time, freed after its backward
        for got, want in zip(s, value):
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-14)
        (w * (s[0].pow(2).sum() + s[1].sum())).backward()
    for got, want in zip((lin.weight.grad, lin.bias.grad, x.grad), eager):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(x.grad.abs().max()) > 0


def test_defer_graphs_refuses_the_unrolled_mode_and_is_inert_without_autograd():
    lin, x, f = _problem()
    z0 = (torch.zeros(3, 6, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64))
    deq = DEQ(DEQConfig(f_max_iter=5, b_mode="unrolled", b_mode_kwargs={}))
    with pytest.raises(ValueError, match="defer_graphs=True needs a forward solve"):
        deq(f, z0, defer_graphs=True)
    with torch.no_grad():  # inference: nothing to defer, the plain fixed point
        z, _ = DEQ(DEQConfig(f_max_iter=5))(f, z0, defer_graphs=True)
    assert isinstance(z, tuple) and not z[0].requires_grad
    with pytest.raises(ValueError, match="defer_graphs=True needs a forward solve"):  # max_iter=0: no solve
        DEQ(DEQConfig(f_max_iter=5)).solve_with(DEQConfig(f_max_iter=5), f, z0, max_iter=0, defer_graphs=True)


def test_backward_in_stages_equals_the_one_shot_backward_float64():
    """A shared encoder, two correction states (phantom steps from kept iterates of an ill-conditioned,
    non-normal map) and a term that reuses a weight transform built once outside the leaves (the
    retain_graph path): staged gradients equal those of the summed loss's backward."""
    torch.manual_seed(3)
    enc = torch.nn.Linear(5, 6).double()
    q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    shear = torch.eye(6, dtype=torch.float64) + 4 * torch.triu(torch.randn(6, 6, dtype=torch.float64), 1)
    a = torch.nn.Parameter(0.9 * q @ torch.diag(torch.logspace(0, -3, 6, dtype=torch.float64)) @ shear / 5)
    x = torch.randn(4, 5, dtype=torch.float64)

    def losses(u):
        w = a * 1.0  # built once per call, shared by every term
        f = lambda z: torch.tanh(z @ w.T + u)  # noqa: E731
        with torch.no_grad():
            z = torch.zeros_like(u)
            kept = []
            for _ in range(8):
                z = f(z)
                kept.append(z)
        return [lambda s=s, k=k: (k + 1) * f(f(kept[s])).pow(2).mean() for k, s in enumerate((3, 7))]

    h = enc(x)
    sum(term() for term in losses(h)).backward()
    want = [p.grad.clone() for p in (a, *enc.parameters())]
    for p in (a, *enc.parameters()):
        p.grad = None
    h = enc(x)
    leaf = h.detach().requires_grad_()
    total = backward_in_stages([h], [leaf], losses(leaf))
    for got, ref in zip((a.grad, *(p.grad for p in enc.parameters())), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    assert total is not None and not total.requires_grad
    assert backward_in_stages([h], [leaf.detach().requires_grad_()], []) is None
