"""torch.compile of f_θ inside the engine (DEQ.compile_f / model.compile_deq): one compiled graph per f call,
no graph break per solver step, no recompilation for a new batch of the same shape, same answers as eager."""

from __future__ import annotations

import pytest
import torch

import deqzoo

dynamo = pytest.importorskip("torch._dynamo")


def _model():
    torch.manual_seed(0)
    model = deqzoo.create_model("mdeq-tiny-mnist").eval()  # weight-normalised convolutions: the norm hook
    model.set_deq(f_solver="anderson", f_max_iter=12, f_tol=1e-5, on_nonconvergence="ignore")
    return model


def test_compiled_f_has_no_graph_break_and_matches_eager():
    eager, compiled = _model(), _model().compile_deq()
    x1, x2 = torch.rand(2, 1, 28, 28), torch.rand(2, 1, 28, 28)
    dynamo.reset()
    dynamo.utils.counters.clear()
    with torch.no_grad():
        out = compiled(pixel_values=x1)
        graphs_after_first = dynamo.utils.counters["stats"]["unique_graphs"]
        out2 = compiled(pixel_values=x2)  # new values, same shapes: the compiled f is reused
        ref, ref2 = eager(pixel_values=x1), eager(pixel_values=x2)
    assert dict(dynamo.utils.counters["graph_break"]) == {}
    assert graphs_after_first >= 1
    assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs_after_first
    assert out.deq_stats.nfe == ref.deq_stats.nfe > 2  # the solver stepped through the compiled f
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2.logits, ref2.logits, rtol=1e-4, atol=1e-4)
    compiled.compile_deq(False)
    assert compiled.mdeq.deq.compile_options is None
