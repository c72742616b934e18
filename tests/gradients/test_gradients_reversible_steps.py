"""RevDEQ's gradient against the number of coupled steps N, on the embedded mdeq-tiny-mnist-reversible
checkpoint (its GroupNorm f is where rebuilt states lose precision fastest): b_mode="reversible" in float64
and float32 against autograd through the same coupled iteration in float64 (written here, independent of
deqzoo.core.reversible).

Bounds (docs/engine.md, "RevDEQ precision"): float64 within 1e-12 relative, float32 within 2e-6 relative
(float32 autograd through the same loop: 3.6e-7 to 4.7e-7), at every N. Before segments, the reversal
from z_N lost them at N >= 8 (float64 2.5e-9 at N = 8, 7.7e-2 at N = 16; float32 7.0e-2 at N = 8);
segment=0 (that reversal) is kept here to show the run-time check catching it and recomputing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import deqzoo
from deqzoo.core import BACKWARD_MODES
from deqzoo.core.backward import MODE_KWARGS
from deqzoo.core.stats import SolverStats

torch.set_num_threads(1)

BOUND = {torch.float64: 1e-12, torch.float32: 2e-6}


def coupled_reference(g, x_star, ctx):
    """Autograd through the paper's coupled loop, N = ctx.max_iter steps from z0 = y0."""
    beta = ctx.config.b_mode_kwargs.get("beta", 0.8)
    z = y = ctx.x0
    for _ in range(ctx.max_iter):
        y = (1 - beta) * y + beta * g(z)
        z = (1 - beta) * z + beta * g(y)
    zeros = torch.zeros(z.shape[0], dtype=z.dtype)
    ctx.stats = SolverStats(nfe=2 * ctx.max_iter + 1, abs_residual=zeros, rel_residual=zeros,
                            trace=torch.zeros(0), converged=torch.ones(z.shape[0], dtype=torch.bool),
                            solver="reference")
    return z


coupled_reference.needs_solve = False
coupled_reference.replaces_solve = True


@pytest.fixture(scope="module")
def checkpoint():
    return deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist-reversible")


@pytest.fixture(scope="module")
def reference_cache():
    return {}


def _gradient(base, mode: str, steps: int, dtype: torch.dtype, **options):
    model = copy.deepcopy(base).to(dtype).eval()
    model.set_deq(b_mode=mode, f_max_iter=steps, b_mode_kwargs={"beta": 0.8, **options})
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = model(pixel_values=x)
    weights = torch.sin(torch.arange(out.logits.numel(), dtype=dtype)).reshape(out.logits.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.logits * weights).sum(), params)
    return torch.cat([g.reshape(-1) for g in grads]).double(), out.deq_stats


@pytest.mark.parametrize("steps", [4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_reversible_gradient_error_is_bounded_in_the_number_of_steps(checkpoint, reference_cache, monkeypatch,
                                                                     steps, dtype):
    monkeypatch.setitem(BACKWARD_MODES, "_coupled_reference", coupled_reference)
    monkeypatch.setitem(MODE_KWARGS, "_coupled_reference", {"beta"})
    if steps not in reference_cache:
        reference_cache[steps] = _gradient(checkpoint, "_coupled_reference", steps, torch.float64)[0]
    want = reference_cache[steps]
    got, stats = _gradient(checkpoint, "reversible", steps, dtype)
    err = float((got - want).norm() / want.norm())
    report = stats.extra["reversible"]
    print(f"N={steps} {dtype}: relative error {err:.1e}, rebuild error {report['rebuild_error']:.1e}, "
          f"{report['recomputed_segments']}/{report['segments']} segments recomputed")
    assert err < BOUND[dtype]
    assert report["rebuild_error"] <= report["rebuild_tol"] or report["recomputed_segments"] > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_whole_reversal_is_caught_and_recomputed(checkpoint, reference_cache, monkeypatch, dtype):
    """segment=0 reverses all 16 steps from z_N (the paper's O(1)-memory method): its rebuilt z0 is far
    from the kept one (float64 ~1e3 relative here), the run-time check sees it and recomputes, and the
    gradient is within the same bound."""
    monkeypatch.setitem(BACKWARD_MODES, "_coupled_reference", coupled_reference)
    monkeypatch.setitem(MODE_KWARGS, "_coupled_reference", {"beta"})
    if 16 not in reference_cache:
        reference_cache[16] = _gradient(checkpoint, "_coupled_reference", 16, torch.float64)[0]
    got, stats = _gradient(checkpoint, "reversible", 16, dtype, segment=0)
    report = stats.extra["reversible"]
    assert report["segments"] == 1 and report["recomputed_segments"] == 1
    assert report["rebuild_error"] > 1e-3
    err = float((got - reference_cache[16]).norm() / reference_cache[16].norm())
    assert err < BOUND[dtype]
