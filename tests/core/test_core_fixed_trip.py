"""The fixed-trip solve (issue #55 item 5): every row stays in f's batch for the whole budget, a stopped row
frozen by a mask, no host read per step, so `torch.compile(fullgraph=True)` traces a model's forward solve as
one graph (fullgraph raises on any graph break: that is the check). Its answers, per-sample NFE and flags
equal the compacted eager solve's: the synthetic batch with diverging, NaN and converged rows (equal to the
bit), and mdeq-tiny-mnist's forward compiled (within 1e-5)."""

from __future__ import annotations

import pytest
import torch

import deqzoo
from deqzoo.core import DEQ, DEQConfig, solve
from deqzoo.core.halting import AnswerStable, Budget

from .test_core_batch_independence import _flags, _problem


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("solver", ["fixed_point", "anderson"])
def test_fixed_trip_equals_compacted(solver, dtype):
    f, z0 = _problem(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    kw = dict(solver=solver, max_iter=60, tol=tol)
    z, st = solve(f, z0, **kw)
    zm, sm = solve(f, z0, fixed_trip=True, check_every=0, **kw)
    assert st.extra["compacted"] and not sm.extra["compacted"]
    assert sm.nfe == 60  # the whole budget, every row in f's batch
    assert len(set(st.nfe_per_sample.tolist())) >= 4  # rows stop at different steps (the masks matter)
    torch.testing.assert_close(zm, z, rtol=0, atol=0)
    for i in range(z0.shape[0]):
        assert _flags(sm, i) == _flags(st, i), i
    torch.testing.assert_close(sm.rel_residual, st.rel_residual, rtol=0, atol=0)
    torch.testing.assert_close(sm.trace[: len(st.trace)], st.trace, rtol=0, atol=0, equal_nan=True)


def test_fixed_trip_stop_rules_and_early_exit():
    """Stop rules freeze rows as in the compacted solve; eager, the loop ends at the first check (every
    `check_every` steps) that finds no row iterating."""
    f, z0 = _problem(torch.float64)
    f5, z5 = (lambda z, rows=None: f(z, rows if rows is not None else torch.arange(5))), z0[:5]
    f5.rowwise = True
    rules = lambda: [Budget(torch.tensor([3, 9, 4, 30, 7])), AnswerStable(lambda z: (4 * z).round(), k=3)]  # noqa: E731
    kw = dict(solver="anderson", max_iter=200, tol=1e-10)
    z, st = solve(f5, z5, halt=rules(), **kw)
    zm, sm = solve(f5, z5, halt=rules(), fixed_trip=True, check_every=4, **kw)
    torch.testing.assert_close(zm, z, rtol=0, atol=0)
    assert sm.nfe_per_sample.tolist() == st.nfe_per_sample.tolist()
    last = int(st.nfe_per_sample.max())
    assert sm.nfe == -(-last // 4) * 4 < 200  # ended at the first check after the last row stopped
    with pytest.raises(ValueError, match="check_every"):
        solve(f5, z5, fixed_trip=True, check_every=-1, **kw)


def _mdeq(solver: str):
    model = deqzoo.from_pretrained("mdeq-tiny-mnist").eval()
    # a budget of 6 and a loose tolerance: rows stop at different steps inside the budget (so the masks are
    # exercised), and tracing stays short (dynamo unrolls the fixed-trip loop, one f per step)
    model.set_deq(f_solver=solver, f_max_iter=6, f_tol=0.1, on_nonconvergence="ignore")
    return model


@pytest.mark.extended  # dynamo's capture of 6 MDEQ steps: ~1-2 min on 2 loaded cores (docs/engine.md)
@pytest.mark.parametrize("solver", ["fixed_point", "anderson"])
def test_compiled_model_forward_has_no_graph_break(solver):
    torch.manual_seed(0)
    model = _mdeq(solver)
    # images from blank to bright: their solves stop at different steps
    x = torch.rand(6, 1, 28, 28) * torch.tensor([0.0, 0.3, 1.0, 2.0, 4.0, 8.0])[:, None, None, None]
    with torch.no_grad():
        ref = model(pixel_values=x)
        # fullgraph=True: any graph break is an error. The "eager" backend runs the captured graph as is
        # (dynamo's capture decides graph breaks; inductor's codegen is timed separately, docs/engine.md)
        out = torch.compile(model, fullgraph=True, backend="eager")(pixel_values=x)
    steps = ref.deq_stats.nfe_per_sample
    assert len(set(steps.tolist())) >= 2, steps  # rows stopped at different steps
    assert out.deq_stats.nfe_per_sample.tolist() == steps.tolist()
    assert out.deq_stats.converged.tolist() == ref.deq_stats.converged.tolist()
    assert out.deq_stats.nfe == 6 and out.deq_stats.extra["fixed_trip"]
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.deq_stats.rel_residual, ref.deq_stats.rel_residual, rtol=1e-5, atol=1e-7)


def test_fixed_trip_through_deq_config():
    """`DEQConfig.f_solver_kwargs={"fixed_trip": True}` selects it in eager mode (the accelerator path)."""
    lin = torch.nn.Linear(5, 5, dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64)
    f = lambda z: torch.tanh(0.5 * lin(z) + x)  # noqa: E731
    cfg = DEQConfig(f_solver="anderson", f_max_iter=40, f_tol=1e-9)
    with torch.no_grad():
        z0 = torch.zeros(4, 5, dtype=torch.float64)
        z, st = DEQ(cfg)(f, z0)
        zm, sm = DEQ(cfg.update(f_solver_kwargs={"fixed_trip": True}))(f, z0)
    torch.testing.assert_close(zm, z, rtol=0, atol=0)
    assert sm.nfe_per_sample.tolist() == st.nfe_per_sample.tolist()


class _TinyDEQModel(torch.nn.Module):
    """A model whose forward solves a DEQ (a tuple state, as MDEQ's, and a row-subset f): small enough for
    dynamo to capture a 14-step solve in seconds."""

    def __init__(self, solver: str):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.deq = DEQ(DEQConfig(f_solver=solver, f_max_iter=14, f_tol=1e-4, on_nonconvergence="warn"))

    def forward(self, x):
        from deqzoo.core.halting import rowwise

        def f(zs, rows=None):
            xi = x if rows is None else x[rows]
            a = torch.tanh(0.3 * self.lin(zs[0]) + xi)
            return a, xi[:, :1].abs().clamp(max=0.7) * zs[1] + a.sum(1, keepdim=True)  # per-row rate

        zs, stats = self.deq(rowwise(f), (torch.zeros_like(x), x.new_zeros(x.shape[0], 1)))
        return zs[0] + zs[1], stats


@pytest.mark.parametrize("solver", ["fixed_point", "anderson"])
def test_compiled_solve_is_one_graph(solver):
    """fullgraph=True over a forward that solves: no graph break, the answer, per-sample NFE and stats equal
    eager's (the default suite's check; mdeq-tiny-mnist's own forward is the extended test above)."""
    torch.manual_seed(0)
    model = _TinyDEQModel(solver).eval()
    x = torch.randn(5, 6) * torch.tensor([0.0, 0.1, 1.0, 3.0, 10.0])[:, None]  # stops at different steps
    with torch.no_grad():
        ref, ref_stats = model(x)
        out, stats = torch.compile(model, fullgraph=True, backend="eager")(x)
    assert len(set(ref_stats.nfe_per_sample.tolist())) >= 2
    assert stats.nfe_per_sample.tolist() == ref_stats.nfe_per_sample.tolist()
    assert stats.extra["fixed_trip"] and stats.nfe == 14
    assert bool(stats.converged.all()) == ref_stats.all_converged
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.rel_residual, ref_stats.rel_residual, rtol=1e-5, atol=1e-8)
