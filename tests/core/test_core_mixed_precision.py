"""DEQConfig.f_dtype: f under bfloat16 autocast while the solver state, its history and statistics stay in
float32; gradients through every backward mode; mdeq-tiny-mnist's held-out accuracy against float32."""

from __future__ import annotations

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig

torch.set_num_threads(1)


def _problem(seed=0, d=32, b=4):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(d, d, generator=g) / d**0.5 * 0.6)
    x = torch.randn(b, d, generator=g, requires_grad=True)
    return w, x


def test_f_runs_in_bfloat16_and_the_state_stays_float32():
    w, x = _problem()
    seen = []

    def f(z):
        seen.append((z.dtype, (z @ w).dtype))  # what the solver hands f, and what f's matmul computes in
        return torch.tanh(z @ w + x)

    deq = DEQ(DEQConfig(f_solver="anderson", f_max_iter=30, f_tol=1e-2, f_dtype="bfloat16"))
    with torch.no_grad():
        z, stats = deq(f, torch.zeros(4, 32))
    assert z.dtype == torch.float32 and stats.rel_residual.dtype == torch.float32
    assert set(seen) == {(torch.float32, torch.bfloat16)}
    with torch.no_grad():
        z32, _ = DEQ(DEQConfig(f_solver="anderson", f_max_iter=30, f_tol=1e-6))(
            lambda z: torch.tanh(z @ w + x), torch.zeros(4, 32))
    # the bf16 fixed point differs from float32's by bf16 rounding (eps 7.8e-3), not more
    assert float((z - z32).norm() / z32.norm()) < 2e-2
    assert bool(stats.converged.all())


@pytest.mark.parametrize("mode,kwargs", [("ift", {}), ("phantom", {"k": 5}), ("reversible", {"beta": 0.8}),
                                         ("unrolled", {})])
def test_gradients_under_bfloat16_f_follow_float32(mode, kwargs):
    """The gradient of each backward mode with a bf16 f against the same mode in float32: the direction
    (cosine) and size agree to bf16 precision."""
    w, x = _problem(1)
    grads = []
    for f_dtype in (None, "bfloat16"):
        cfg = DEQConfig(f_solver="anderson", f_max_iter=12, f_tol=1e-3, b_mode=mode, b_mode_kwargs=kwargs,
                        b_max_iter=30, b_tol=1e-3, f_dtype=f_dtype)
        z, _ = DEQ(cfg)(lambda z: torch.tanh(z @ w + x), torch.zeros(4, 32))
        assert z.dtype == torch.float32
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(z.pow(2).sum(), [w, x])]))
    ref, low = grads
    cos = float(ref @ low / (ref.norm() * low.norm()))
    print(f"{mode}: cosine {cos:.5f}, relative difference {float((low - ref).norm() / ref.norm()):.1e}")
    assert cos > 0.999 and float((low - ref).norm() / ref.norm()) < 5e-2


def test_f_dtype_is_validated():
    with pytest.raises(ValueError, match="f_dtype"):
        DEQConfig(f_dtype="int8")
    assert DEQConfig.from_json(DEQConfig(f_dtype="bfloat16").to_json()).f_dtype == "bfloat16"


def test_mdeq_tiny_mnist_accuracy_in_bfloat16_within_0_2_points_of_float32():
    """The card's evaluation (examples.mdeq.mnist.evaluate) on the first 500 held-out images: bf16 f within
    0.2 points (one image) of float32. The full 1,000 images give 0.978 for both."""
    import deqzoo
    from examples.mdeq import mnist

    acc = {}
    for f_dtype in (None, "bfloat16"):
        model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", deq={"f_dtype": f_dtype},
                                       on_nonconvergence="ignore")
        acc[f_dtype] = mnist.evaluate(model, limit=500, progress=False)["accuracy"]
    print(f"accuracy on 500 held-out images: float32 {acc[None]:.4f}, bf16 f {acc['bfloat16']:.4f}")
    assert abs(acc["bfloat16"] - acc[None]) <= 0.002 + 1e-9
