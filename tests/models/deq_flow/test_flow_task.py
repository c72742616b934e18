"""The flow task's data: deterministic, exact ground truth (checked by warping), disjoint held-out images,
the motorcycle stereo pair; predict and demo write colour PNGs. (The synthetic video's test moved with it to
tests/examples/test_deq_flow_video.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from examples.deq_flow import flow
from examples.tasks import TASKS


def _warp_error(image1, image2, f, valid):
    back = flow.warp(image2[None], f[None])[0]
    err = (back - image1).abs().mean(0)
    return float(err[valid].mean()), float(err[~valid].mean()) if bool((~valid).any()) else float("nan")


def test_pairs_are_deterministic_and_splits_differ():
    a, b = flow.synthetic_pair(7), flow.synthetic_pair(7)
    assert torch.equal(a.image1, b.image1) and torch.equal(a.flow, b.flow) and torch.equal(a.valid, b.valid)
    c = flow.synthetic_pair(7, split="held-out")
    assert not torch.equal(a.image1, c.image1)
    assert not set(flow.TRAIN_IMAGES) & set(flow.HELD_OUT_IMAGES)
    with pytest.raises(ValueError, match="split"):
        flow.synthetic_pair(0, split="test")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ground_truth_flow_is_exact(seed):
    """Warping frame 2 back by the ground truth reproduces frame 1 on valid pixels (to bilinear resampling),
    while the zero flow and the invalid (occluded) pixels do not."""
    p = flow.synthetic_pair(seed, (64, 64), "held-out", photometric=False)
    assert float(p.flow.abs().max()) > 1.0 and 0.3 < float(p.valid.float().mean()) < 1.0
    valid_err, occluded_err = _warp_error(p.image1, p.image2, p.flow, p.valid)
    zero_err, _ = _warp_error(p.image1, p.image2, torch.zeros_like(p.flow), p.valid)
    assert valid_err < 0.35 * zero_err, (valid_err, zero_err)
    assert valid_err < 0.5 * occluded_err, (valid_err, occluded_err)


def test_deformation_inverse_to_rounding():
    rng = np.random.default_rng(0)
    field = flow._smooth_field(rng, 64, 64, amplitude=2.0)
    fwd, back = flow._deformed(flow._affine(1.05, 0.05, (3.0, -2.0), (31.5, 31.5)), field)
    pts = torch.rand(200, 2, dtype=torch.float64) * 63
    assert float((fwd(back(pts)) - pts).abs().max()) < 1e-7


def test_motorcycle_is_disparity():
    m = flow.motorcycle_pair(0.25)
    assert m.image1.shape == (3, 125, 185) and bool((m.flow[1] == 0).all())
    assert bool((m.flow[0][m.valid] < 0).all()) and 0.85 < float(m.valid.float().mean()) < 1.0
    err, _ = _warp_error(m.image1, m.image2, m.flow, m.valid)
    zero, _ = _warp_error(m.image1, m.image2, torch.zeros_like(m.flow), m.valid)
    assert err < 0.5 * zero


def test_classical_baselines_and_epe():
    p = flow.synthetic_pair(0, split="held-out")
    gt = p.flow
    assert flow.epe(gt, gt, p.valid) == 0.0
    zero = flow.epe(flow.classical_flow("zero", p.image1, p.image2), gt, p.valid)
    dis = flow.epe(flow.classical_flow("dis", p.image1, p.image2), gt, p.valid)
    assert dis < zero
    with pytest.raises(ValueError, match="unknown classical"):
        flow.classical_flow("lucas", p.image1, p.image2)


def test_max_shift_reaches_the_batches_and_the_held_out_set():
    """`max_shift` (train.py / curves.py --max-shift) draws the same pairs as `synthetic_pair` with it, with
    larger motion than the default's tenth of the side."""
    big = flow.synthetic_batch(range(3), (64, 64), "train", max_shift=16)
    for i in range(3):
        p = flow.synthetic_pair(i, (64, 64), "train", max_shift=16)
        assert torch.equal(big[2][i], p.flow) and torch.equal(big[0][i], p.image1)
    held = flow.held_out_set(3, max_shift=16)
    assert torch.equal(held[2], flow.synthetic_batch(range(3), (64, 64), "held-out", max_shift=16)[2])
    default = flow.held_out_set(3)
    assert torch.equal(default[2], flow.synthetic_batch(range(3), (64, 64), "held-out")[2])
    speed = lambda f, v: float(f.norm(dim=1)[v].mean())  # noqa: E731
    assert speed(held[2], held[3]) > 1.5 * speed(default[2], default[3])


def test_task_is_registered():
    assert TASKS["flow"] == "examples.deq_flow.flow"
