"""Gradient trust: every backward mode on every registered family (tiny float64 models) against autograd
through the same unrolled forward computation, in train() and eval() mode, through frozen blocks, and to
second order.

References are written here, independent of deqzoo.core.backward / reversible: plain autograd through the
coupled RevDEQ loop (for b_mode="reversible") and through a long plain fixed-point loop (for the implicit
modes: its gradient converges to the implicit gradient as the loop converges).

Bounds:
- reversible: 1e-10 relative (exact up to rounding, float64).
- ift: 1e-7 relative at f_tol = b_tol = 1e-12 (its backward tolerance, plus the reference loop's own
  distance to the fixed point).
- phantom (UPG, k=5, tau=0.5) and jacobian_free: approximations of the implicit gradient; their cosine
  similarity with it is printed and asserted >= the value measured per family, rounded down (COSINE_BOUNDS).
- DEQ-Flow is in the reversible tests only (see IMPLICIT_BUILDERS in conftest.py for why).
"""

from __future__ import annotations

import pytest
import torch

from deqzoo.core import BACKWARD_MODES, DEQConfig
from deqzoo.core.backward import MODE_KWARGS
from deqzoo.core.stats import SolverStats

torch.set_num_threads(1)

STEPS, BETA = 4, 0.8
LOOP = 300  # plain fixed-point steps of the implicit modes' reference
TIGHT = {"f_solver": "anderson", "f_max_iter": 200, "f_tol": 1e-12, "b_solver": "anderson",
         "b_max_iter": 200, "b_tol": 1e-12, "on_nonconvergence": "raise", "b_mode_kwargs": {},
         "f_solver_kwargs": {}, "b_solver_kwargs": {}}
# cosine similarity with the implicit gradient: the lowest measured over train/eval on these tiny models
# (mdeq 0.874 / 0.718, deq_transformer 0.742 / 0.554, ignn 0.9996 / 0.987, implicit2 0.994 / 0.921 for
# phantom / jacobian_free), rounded down: a regression guard; neither mode promises more than a descent
# direction (cosine > 0) for a contractive f. implicit2's jacobian_free bound covers the spread over seeds,
# not one draw: seeds 0-4 gave 0.854-0.944 with the parameters drawn in __init__ and 0.893-0.912 once
# _init_weights draws them (same distributions, another order; seed 0 went from 0.921 to 0.897)
COSINE_BOUNDS = {
    "phantom": {"mdeq": 0.85, "deq_transformer": 0.7, "ignn": 0.99, "implicit2": 0.99},
    "jacobian_free": {"mdeq": 0.7, "deq_transformer": 0.5, "ignn": 0.98, "implicit2": 0.85},
}


def _stats(x: torch.Tensor, nfe: int) -> SolverStats:
    b = x.shape[0]
    zeros = torch.zeros(b, dtype=x.dtype)
    return SolverStats(nfe=nfe, abs_residual=zeros, rel_residual=zeros, trace=torch.zeros(0),
                       converged=torch.ones(b, dtype=torch.bool), solver="reference")


def coupled_reference(g, x_star, ctx):
    """Autograd through the paper's coupled loop (what b_mode='reversible' must differentiate exactly)."""
    beta = ctx.config.b_mode_kwargs.get("beta", 0.8)
    z = y = ctx.x0
    for _ in range(ctx.max_iter):
        y = (1 - beta) * y + beta * g(z)
        z = (1 - beta) * z + beta * g(y)
    ctx.stats = _stats(z, 2 * ctx.max_iter + 1)
    return z


coupled_reference.needs_solve = False
coupled_reference.replaces_solve = True


def loop_reference(g, x_star, ctx):
    """Autograd through ctx.max_iter plain steps z <- f(z) from z0 (converges to the implicit gradient)."""
    z = ctx.x0
    for _ in range(ctx.max_iter):
        z = g(z)
    with torch.no_grad():
        res = float((g(z) - z).norm() / g(z).norm())
    assert res < 1e-11, f"the reference loop did not converge: relative residual {res:.1e}"
    ctx.stats = _stats(z, ctx.max_iter)
    return z


loop_reference.needs_solve = False


@pytest.fixture
def references(monkeypatch):
    monkeypatch.setitem(BACKWARD_MODES, "_coupled_reference", coupled_reference)
    monkeypatch.setitem(MODE_KWARGS, "_coupled_reference", {"beta"})
    monkeypatch.setitem(BACKWARD_MODES, "_loop_reference", loop_reference)
    monkeypatch.setitem(MODE_KWARGS, "_loop_reference", set())


def _differentiate(model, inputs, loss_fn, train: bool, wrt_inputs: bool, seed: int = 0):
    """Gradients of the loss w.r.t. the trainable parameters (and the float inputs): a flat vector."""
    model.train(train)
    inputs = {k: (v.detach().clone().requires_grad_(wrt_inputs)
                  if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    torch.manual_seed(seed)  # the same dropout masks / random draws in both runs
    loss = loss_fn(model, inputs)
    wrt = [p for p in model.parameters() if p.requires_grad]
    wrt += [v for v in inputs.values() if torch.is_tensor(v) and v.requires_grad]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(w)).reshape(-1) for g, w in zip(grads, wrt)])


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def _set(model, **deq):
    model.set_deq(**deq)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_reversible_equals_autograd_through_the_coupled_loop(family, references, train):
    name, build = family
    model, inputs, loss_fn = build()
    rev = {"f_max_iter": STEPS, "b_mode_kwargs": {"beta": BETA}, "on_nonconvergence": "ignore",
           "f_solver_kwargs": {}, "b_solver_kwargs": {}}
    _set(model, b_mode="reversible", **rev)
    got = _differentiate(model, inputs, loss_fn, train, wrt_inputs=name != "deq_transformer")
    _set(model, b_mode="_coupled_reference", **rev)
    want = _differentiate(model, inputs, loss_fn, train, wrt_inputs=name != "deq_transformer")
    err = _rel(got, want)
    print(f"{name} {'train' if train else 'eval'}: reversible vs coupled autograd, relative error {err:.1e}")
    assert err < 1e-10


@pytest.fixture(scope="module")
def implicit_gradients():
    """{(family, train): (ift gradient, loop-reference gradient, {mode: gradient})}, computed once."""
    return {}


def _implicit(name, build, train, cache):
    key = (name, train)
    if key not in cache:
        model, inputs, loss_fn = build()
        wrt_inputs = name != "deq_transformer"
        _set(model, b_mode="ift", **TIGHT)
        ift = _differentiate(model, inputs, loss_fn, train, wrt_inputs)
        _set(model, b_mode="_loop_reference", **{**TIGHT, "f_max_iter": LOOP})
        ref = _differentiate(model, inputs, loss_fn, train, wrt_inputs)
        approx = {}
        for mode, kw in (("phantom", {"k": 5, "tau": 0.5}), ("jacobian_free", {})):
            _set(model, b_mode=mode, **{**TIGHT, "b_mode_kwargs": kw})
            approx[mode] = _differentiate(model, inputs, loss_fn, train, wrt_inputs)
        cache[key] = ift, ref, approx
    return cache[key]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_ift_and_approximate_modes_against_the_implicit_gradient(converging_family, references, train,
                                                                 implicit_gradients):
    name, build = converging_family
    ift, ref, approx = _implicit(name, build, train, implicit_gradients)
    err = _rel(ift, ref)
    cos = {mode: _cos(g, ref) for mode, g in approx.items()}
    print(f"{name} {'train' if train else 'eval'}: ift relative error {err:.1e}; cosine phantom "
          f"{cos['phantom']:.4f}, jacobian_free {cos['jacobian_free']:.4f}")
    assert err < 1e-7
    for mode, c in cos.items():
        assert c >= COSINE_BOUNDS[mode][name], (mode, name, c)


def test_frozen_block_reversible(family, references):
    _frozen_block(*family, "reversible")


def test_frozen_block_ift(converging_family, references):
    _frozen_block(*converging_family, "ift")


def _frozen_block(name, build, mode):
    """Every parameter frozen (requires_grad=False), the input requiring grad (DEQ-Transformer: its token
    embedding trainable, the rest frozen): the gradient equals the reference, no parameter collects one."""
    model, inputs, loss_fn = build()
    for pname, p in model.named_parameters():
        p.requires_grad_(name == "deq_transformer" and "word_emb" in pname)
    assert any(p.requires_grad for p in model.parameters()) == (name == "deq_transformer")
    if mode == "reversible":
        cfg = {"f_max_iter": STEPS, "b_mode_kwargs": {"beta": BETA}, "on_nonconvergence": "ignore"}
        _set(model, b_mode="reversible", **cfg)
        got = _differentiate(model, inputs, loss_fn, False, wrt_inputs=True)
        _set(model, b_mode="_coupled_reference", **cfg)
        bound = 1e-10
    else:
        _set(model, b_mode="ift", **TIGHT)
        got = _differentiate(model, inputs, loss_fn, False, wrt_inputs=True)
        _set(model, b_mode="_loop_reference", **{**TIGHT, "f_max_iter": LOOP})
        bound = 1e-7
    want = _differentiate(model, inputs, loss_fn, False, wrt_inputs=True)
    assert want.numel() > 0 and float(want.norm()) > 0
    assert _rel(got, want) < bound
    assert all(p.grad is None for p in model.parameters())


def test_double_backward(references):
    """Hessian-vector products: unrolled autograd supports them (checked against a central difference of
    gradients); ift, phantom NPG and reversible raise a clear error instead of a silently wrong product."""
    from deqzoo.core import DEQ

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.float64) * 0.2)
    x = torch.randn(3, 6, dtype=torch.float64)

    def grad_of(wt, mode, create_graph):
        deq = DEQ(DEQConfig(**{**TIGHT, "b_mode": mode, "f_max_iter": 60 if mode == "unrolled" else 200,
                               "on_nonconvergence": "ignore"}))
        z, _ = deq(lambda z: torch.tanh(z @ wt.T + x), torch.zeros(3, 6, dtype=torch.float64))
        return torch.autograd.grad(z.pow(2).sum(), wt, create_graph=create_graph)[0]

    v = torch.randn(6, 6, dtype=torch.float64)
    hvp = torch.autograd.grad((grad_of(w, "unrolled", True) * v).sum(), w)[0]
    eps = 1e-5
    fd = (grad_of((w + eps * v).detach().requires_grad_(), "unrolled", False)
          - grad_of((w - eps * v).detach().requires_grad_(), "unrolled", False)) / (2 * eps)
    assert _rel(hvp, fd) < 1e-7
    for mode in ("ift", "reversible"):
        with pytest.raises(RuntimeError, match="double backward"):
            (grad_of(w, mode, True) * v).sum().backward()
