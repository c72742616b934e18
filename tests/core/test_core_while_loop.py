"""The fixed-trip fixed-point solve as one ``torch.while_loop`` (issue #55 item 5): ``fixed_trip="while"``
compiled traces f once, not once per step, so Inductor compiles a budget of any size. Checked against the
eager masked solve (the same rule, `masked_rule`) on the synthetic batch with diverging, NaN and converged
rows: answers, per-sample NFE, flags and trace; the graph's size counted with a user backend (public
``torch.compile(backend=callable)``) at two budgets."""

from __future__ import annotations

import time

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig
from deqzoo.core.solvers import fixed_point

from .test_core_batch_independence import _flags, _problem


def _solve(f, z0, max_iter, **kw):
    return fixed_point(f, z0, max_iter=max_iter, tol=1e-5, **kw)


@pytest.mark.parametrize("return_f", [False, True], ids=["iterate", "stored"])
def test_while_loop_compiled_with_inductor_equals_eager(return_f):
    torch.manual_seed(0)
    f, z0 = _problem(torch.float32)
    with torch.no_grad():
        z, st = _solve(f, z0, 40, fixed_trip=True, check_every=0, return_f=return_f)
        t = time.perf_counter()
        zc, sc = torch.compile(_solve, fullgraph=True)(f, z0, 40, fixed_trip="while", return_f=return_f)
        print(f"inductor compile and run: {time.perf_counter() - t:.1f} s")
    assert len(set(st.nfe_per_sample.tolist())) >= 4  # rows stop at different steps: the masks matter
    torch.testing.assert_close(zc, z, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert sc.nfe_per_sample.tolist() == st.nfe_per_sample.tolist() and int(sc.nfe) == 40
    flags = [(int(sc.nfe_per_sample[i]), bool(sc.converged[i]), bool(sc.extra["nonfinite"][i]),
              bool(sc.extra["diverged"][i])) for i in range(8)]  # fmt: skip
    assert flags == [_flags(st, i) for i in range(8)]
    torch.testing.assert_close(sc.trace, st.trace, rtol=1e-5, atol=1e-6, equal_nan=True)


def _graph_ops(fn, *args) -> int:
    """Calls of torch.tanh in the graphs dynamo captures for fn(*args), the while_loop's body included."""
    count = 0

    def backend(gm: torch.fx.GraphModule, example_inputs):
        nonlocal count
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                count += sum(node.target is torch.tanh for node in module.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return count


def test_while_loop_traces_f_once_whatever_the_budget():
    lin = torch.nn.Linear(6, 6)
    x = torch.randn(3, 6)

    def f(z):
        return torch.tanh(0.5 * lin(z) + x)

    def run(max_iter, trip):
        return fixed_point(f, torch.zeros(3, 6), max_iter=max_iter, tol=1e-6, fixed_trip=trip)[0]

    # the first step runs before the loop (it sets the stored f), the rest is the loop's body: two copies
    assert _graph_ops(run, 5, "while") == _graph_ops(run, 50, "while") == 2
    assert _graph_ops(run, 5, True) == 5  # the unrolled fixed-trip loop: one copy of f per step


def test_while_loop_model_forward_and_refusals():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            kw = {"fixed_trip": "while"}
            self.deq = DEQ(DEQConfig(f_solver="fixed_point", f_max_iter=30, f_tol=1e-5, f_solver_kwargs=kw))

        def forward(self, x):
            return self.deq(lambda z: torch.tanh(0.5 * self.lin(z) + x), torch.zeros_like(x))

    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(4, 8) * torch.tensor([0.1, 1.0, 3.0, 10.0])[:, None]
    with torch.no_grad():
        z, st = model(x)  # eager: runs as fixed_trip=True
        zc, sc = torch.compile(model, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(zc, z, rtol=0, atol=1e-6)
    assert sc.nfe_per_sample.tolist() == st.nfe_per_sample.tolist()
    f, z0 = _problem(torch.float64)
    with pytest.raises(ValueError, match="fixed_trip must be"):
        fixed_point(f, z0, max_iter=5, tol=1e-5, fixed_trip="unrolled")
    from deqzoo.core.halting import Budget

    with pytest.raises(Exception, match="takes no halt rules"):  # compiled: dynamo's error carries ours
        torch.compile(_solve, fullgraph=True, backend="eager")(f, z0, 5, fixed_trip="while", halt=[Budget(3)])
