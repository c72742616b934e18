"""DEQ-Flow family: upstream parameter counts, input handling (odd sizes, grayscale, RGBA, uint8, mismatched
pairs), the explicit twin against torchvision's own RAFT loop, the equilibrium, training outputs and reuse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.models.optical_flow.raft import RAFT

import deqzoo
from benchmarks.deq_flow import enable_checkpointing
from deqzoo.models.deq_flow import (
    ARCHITECTURES,
    REUSE_MODES,
    DEQFlowConfig,
    DEQFlowForOpticalFlow,
    forward_interpolate,
    prepare_images,
    warp,
)
from deqzoo.models.deq_flow.modeling_deq_flow import DEFAULT_REUSE, _next_start, coords_grid, upsample_flow

ROOT = Path(__file__).resolve().parents[3]
COUNTS = json.loads(
    (ROOT / "conversion" / "fixtures" / "deq_flow" / "original_param_counts.json").read_text()
)

SMALL = {
    "encoder_layers": [8, 8, 12, 16],
    "feature_dim": 16,
    "context_dim": 12,
    "hidden_dim": 12,
    "corr_levels": 2,
    "corr_radius": 2,
    "motion_corr_layers": [16, 12],
    "motion_flow_layers": [8, 8],
    "motion_dim": 12,
    "flow_head_dim": 16,
    "mask_dim": 16,
}


def _model(**kw) -> DEQFlowForOpticalFlow:
    torch.manual_seed(0)
    model = DEQFlowForOpticalFlow(DEQFlowConfig(**{**SMALL, **kw})).eval()
    model.set_deq(on_nonconvergence="ignore")
    return model


@pytest.mark.parametrize("size", sorted(COUNTS["counts"]))
def test_presets_have_the_upstream_parameter_counts(size):
    """Counted by instantiating locuslab/deq-flow's DEQFlow (the fixture records commit and args)."""
    name = COUNTS["deqzoo_presets"][size]
    with torch.device("meta"):
        model = DEQFlowForOpticalFlow(DEQFlowConfig(**ARCHITECTURES[name]["config"]))
    assert sum(p.numel() for p in model.parameters()) == COUNTS["counts"][size]


def test_cpu_preset_and_its_raft_twin_have_equal_parameter_counts():
    deq, raft = deqzoo.create_model("deq-flow-cpu-synth"), deqzoo.create_model("deq-flow-cpu-raft-baseline")
    assert deq.config.implicit and not raft.config.implicit
    shapes = {k: v.shape for k, v in deq.state_dict().items()}
    assert shapes == {k: v.shape for k, v in raft.state_dict().items()}
    assert deq.num_parameters() == raft.num_parameters()


class _ZeroHiddenContext(nn.Module):
    """Context encoder for torchvision's RAFT whose hidden part is 0 (tanh(0) = 0: DEQ-Flow's zero start)."""

    def __init__(self, encoder: nn.Module, hidden: int):
        super().__init__()
        self.encoder, self.hidden = encoder, hidden

    def forward(self, x):
        ctx = self.encoder(x)
        return torch.cat([ctx.new_zeros(ctx.shape[0], self.hidden, *ctx.shape[2:]), ctx], dim=1)


def test_explicit_twin_equals_torchvisions_raft_loop_on_the_same_blocks():
    """Independent reference: torchvision's RAFT.forward over our modules, 12 updates."""
    model = _model(implicit=False, num_flow_updates=12, context_norm="batch")
    ref = RAFT(
        feature_encoder=model.feature_encoder,
        context_encoder=_ZeroHiddenContext(model.context_encoder, model.config.hidden_dim),
        corr_block=model.corr_block,
        update_block=model.update_block,
        mask_predictor=model.mask_predictor,
    ).eval()
    torch.manual_seed(1)
    a, b = torch.rand(2, 3, 64, 96), torch.rand(2, 3, 64, 96)
    with torch.no_grad():
        ours = model(a, b).flow
        theirs = ref(2 * a - 1, 2 * b - 1, num_flow_updates=12)[-1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert float(ours.abs().max()) > 1e-3  # a non-trivial flow


def _contractive(model: DEQFlowForOpticalFlow) -> DEQFlowForOpticalFlow:
    """Random weights have no equilibrium (Δflow never vanishes, so the flow drifts); with a zero flow head
    the flow stays at its start and a damped GRU candidate makes h contract (trained models learn
    Δflow -> 0)."""
    with torch.no_grad():
        ub = model.update_block
        ub.flow_head.conv2.weight.zero_()
        ub.flow_head.conv2.bias.zero_()
        for gru in (ub.recurrent_block.convgru1, ub.recurrent_block.convgru2):
            gru.convq.weight.mul_(0.3)
    return model


def test_deq_output_is_the_fixed_point_of_the_update_operator():
    model = _contractive(_model(deq={"f_solver": "anderson", "f_max_iter": 200, "f_tol": 1e-6}))
    torch.manual_seed(2)
    a, b = torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        out = model(a, b)
        assert bool(out.deq_stats.converged.all())
        features = model.features(a, b)
        coords0 = torch.stack(torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="xy"))[None]
        h, flow = model.update_fn(features.context, coords0, features.pyramid)(out.fixed_point)
    rel = torch.linalg.vector_norm(
        torch.cat([(h - out.hidden_state).flatten(), (flow - out.flow_low).flatten()])
    )
    assert float(rel) / float(torch.linalg.vector_norm(torch.cat([h.flatten(), flow.flatten()]))) < 1e-5


@pytest.mark.parametrize("size", [(61, 83), (64, 64), (33, 47)])
def test_odd_sizes_are_padded_and_cropped_back(size):
    model = _model()
    torch.manual_seed(3)
    a, b = torch.rand(1, 3, *size), torch.rand(1, 3, *size)
    with torch.no_grad():
        out = model(a, b)
        pa, pb, pad = prepare_images(a, b, model.config.min_image_size)
        assert pa.shape[-1] % 8 == 0 and pa.shape[-2] % 8 == 0
        padded = model(pa, pb).flow  # the same padded pair: the crop is exactly the unpadded output
    assert out.flow.shape == (1, 2, *size)
    left, _, top, _ = pad
    torch.testing.assert_close(out.flow, padded[..., top : top + size[0], left : left + size[1]])


def test_grayscale_rgba_uint8_and_unbatched_inputs():
    model = _model()
    torch.manual_seed(4)
    g1, g2 = torch.rand(1, 1, 40, 48), torch.rand(1, 1, 40, 48)
    rgb1, rgb2 = g1.repeat(1, 3, 1, 1), g2.repeat(1, 3, 1, 1)
    with torch.no_grad():
        ref = model(rgb1, rgb2).flow
        torch.testing.assert_close(model(g1, g2).flow, ref)
        rgba = [torch.cat([x, torch.rand(1, 1, 40, 48)], 1) for x in (rgb1, rgb2)]
        torch.testing.assert_close(model(*rgba).flow, ref)  # alpha is dropped
        torch.testing.assert_close(model(rgb1[0], rgb2[0]).flow, ref)  # (C, H, W)
        q1, q2 = (rgb1 * 255).round().to(torch.uint8), (rgb2 * 255).round().to(torch.uint8)
        torch.testing.assert_close(model(q1, q2).flow, model(q1.float() / 255, q2.float() / 255).flow)


def test_bad_inputs_raise_errors_naming_the_shapes():
    model = _model()
    with pytest.raises(ValueError, match=r"\(1, 3, 40, 48\) and \(1, 3, 40, 56\)"):
        model(torch.rand(1, 3, 40, 48), torch.rand(1, 3, 40, 56))
    with pytest.raises(ValueError, match=r"2 channels.*\(1, 2, 40, 48\)"):
        model(torch.rand(1, 2, 40, 48), torch.rand(1, 2, 40, 48))
    with pytest.raises(ValueError, match=r"pair 1: image1 has shape \(3, 40, 48\) but image2 has shape"):
        model([torch.rand(3, 40, 48)] * 2, [torch.rand(3, 40, 48), torch.rand(3, 48, 48)])
    with pytest.raises(ValueError, match=r"share one size.*\(40, 48\).*\(48, 48\)"):
        model([torch.rand(3, 40, 48), torch.rand(3, 48, 48)], [torch.rand(3, 40, 48), torch.rand(3, 48, 48)])
    with pytest.raises(ValueError, match="too small"):
        model(torch.rand(1, 3, 9, 9), torch.rand(1, 3, 9, 9))
    with pytest.raises(ValueError, match="NaN"):
        model(torch.full((1, 3, 40, 48), float("nan")), torch.rand(1, 3, 40, 48))
    with pytest.raises(ValueError, match=r"flow_gt must have shape \(1, 2, 40, 48\)"):
        model(torch.rand(1, 3, 40, 48), torch.rand(1, 3, 40, 48), flow_gt=torch.zeros(1, 2, 40, 40))
    # a list of same-size pairs is a batch
    pairs = [torch.rand(3, 40, 48) for _ in range(4)]
    with torch.no_grad():
        out = model(pairs[:2], pairs[2:])
        ref = model(torch.stack(pairs[:2]), torch.stack(pairs[2:]))
    torch.testing.assert_close(out.flow, ref.flow)


def test_training_returns_correction_states_and_gradients_reach_every_parameter():
    model = _model(deq={"n_states": 3, "f_max_iter": 9}).train()
    torch.manual_seed(5)
    a, b, gt = torch.rand(2, 3, 40, 48), torch.rand(2, 3, 40, 48), torch.randn(2, 2, 40, 48)
    out = model(a, b, flow_gt=gt)
    assert len(out.flow_predictions) == 3 and out.flow_predictions[-1].shape == (2, 2, 40, 48)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    # the context norm's affine terms exist only with batch/group norm; everything else learns
    assert missing == [], missing
    raft = _model(implicit=False, num_flow_updates=4).train()
    out = raft(a, b, flow_gt=gt)
    assert len(out.flow_predictions) == 4 and out.deq_stats is None


def test_reuse_starts_from_the_previous_fixed_point():
    model = _contractive(_model(deq={"f_solver": "anderson", "f_max_iter": 60, "f_tol": 1e-4}))
    torch.manual_seed(6)
    a, b = torch.rand(1, 3, 48, 64), torch.rand(1, 3, 48, 64)
    with torch.no_grad():
        cold = model(a, b)
        warm = model(a, b, initial_state=cold.fixed_point)
    assert warm.deq_stats.nfe < cold.deq_stats.nfe / 2
    torch.testing.assert_close(warm.flow, cold.flow, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="initial_state hidden_state must have shape"):
        model(a, b, initial_state=(torch.zeros(1, 3, 6, 8), torch.zeros(1, 2, 6, 8)))
    frames = torch.rand(4, 3, 48, 64)
    cold = model.estimate_sequence(frames, reuse=False)
    for mode in (True, *REUSE_MODES):
        flows, stats = model.estimate_sequence(frames, reuse=mode)
        assert len(flows) == 3 and flows[0].shape == (2, 48, 64) and all(s.nfe >= 1 for s in stats)
        assert stats[0].nfe == cold[1][0].nfe  # the first pair has nothing to reuse
    with pytest.raises(ValueError, match="reuse must be True, False, 'none' or one of"):
        model.estimate_sequence(frames, reuse="previous")


def test_reuse_true_is_the_checkpoints_own_sequence_reuse(tmp_path):
    """`reuse=True` (estimate_sequence's default, and `deqzoo predict` on a folder) does what the config's
    sequence_reuse says: "warp" by default; "none" for a checkpoint that reuse makes worse, which then solves
    every pair from zero exactly as `reuse=False`, while an explicit mode still reuses. The key survives
    save/load and a bad value is refused naming it. Reference: the same calls with the mode spelled out."""
    from deqzoo.configuration_utils import ConfigError

    # random weights (not made contractive): the flow moves, so where a solve starts shows in its output
    model = _model(deq={"f_solver": "fixed_point", "f_max_iter": 3, "f_tol": 1e-30})
    torch.manual_seed(10)
    frames = torch.rand(4, 3, 48, 64)

    def run(m, reuse):
        with torch.no_grad():
            flows, stats = m.estimate_sequence(frames, reuse=reuse)
        return torch.stack(flows), [s.nfe for s in stats]

    def same(x, y):
        torch.testing.assert_close(x[0], y[0], rtol=0, atol=0)
        assert x[1] == y[1]

    assert model.config.sequence_reuse == DEFAULT_REUSE == "warp"
    same(run(model, True), run(model, "warp"))
    model.save_pretrained(tmp_path / "none")
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    (tmp_path / "none" / "config.json").write_text(json.dumps({**config, "sequence_reuse": "none"}))
    loaded = deqzoo.from_pretrained(tmp_path / "none").eval()
    loaded.set_deq(on_nonconvergence="ignore")
    assert loaded.config.sequence_reuse == "none"
    same(run(loaded, True), run(model, False))
    same(run(loaded, "warp"), run(model, "warp"))  # an explicit mode still reuses
    warped, cold = run(model, "warp"), run(model, False)
    assert float((warped[0] - cold[0]).abs().max()) > 1e-6  # so "none" is not "warp" under another name
    same(run(loaded, "none"), cold)
    with pytest.raises(ConfigError, match="key 'sequence_reuse' must be one of"):
        DEQFlowConfig(sequence_reuse="previous")


@pytest.mark.parametrize("implicit", [True, False])
def test_num_flow_updates_is_this_calls_budget(implicit):
    """Independent reference: the same model with the budget set in its config (f_max_iter for the DEQ, whose
    tolerance 1e-30 never stops it early; num_flow_updates for the explicit twin)."""
    deq = {"f_solver": "fixed_point", "f_max_iter": 9, "f_tol": 1e-30}
    model = _contractive(_model(implicit=implicit, num_flow_updates=9, deq=deq))
    torch.manual_seed(8)
    a, b = torch.rand(2, 3, 48, 64), torch.rand(2, 3, 48, 64)
    with torch.no_grad():
        ours = model(a, b, num_flow_updates=3)
        full = model(a, b)
        reference = _contractive(_model(implicit=implicit, num_flow_updates=3, deq={**deq, "f_max_iter": 3}))
        ref = reference(a, b)
    torch.testing.assert_close(ours.flow, ref.flow, rtol=0, atol=0)
    torch.testing.assert_close(ours.hidden_state, ref.hidden_state, rtol=0, atol=0)
    assert float((ours.hidden_state - full.hidden_state).abs().max()) > 1e-4  # 3 steps are not 9
    if implicit:
        assert ours.deq_stats.nfe == 3 and full.deq_stats.nfe == 9
    for bad in (0, -2, True, 2.5, "3"):
        with pytest.raises(ValueError, match=re.escape(f"an integer >= 1 or None, got {bad!r}")):
            model(a, b, num_flow_updates=bad)


def test_estimate_sequence_budget_applies_after_the_first_pair():
    """Reference: the pairs run one by one, each started from `_next_start` of the previous fixed point."""
    model = _contractive(_model(deq={"f_solver": "fixed_point", "f_max_iter": 7, "f_tol": 1e-30}))
    torch.manual_seed(9)
    frames = torch.rand(4, 3, 48, 64)
    with torch.no_grad():
        for reuse in (False, "warp"):
            flows, stats = model.estimate_sequence(frames, reuse=reuse, num_flow_updates=2)
            assert [s.nfe for s in stats] == [7, 2, 2]
            state = None
            for t in range(3):
                out = model(frames[t], frames[t + 1], initial_state=state, num_flow_updates=2 if t else None)
                torch.testing.assert_close(flows[t], out.flow[0], rtol=0, atol=0)
                state = None if reuse is False else _next_start(out.fixed_point, "warp")
        with pytest.raises(ValueError, match="num_flow_updates must be an integer >= 1 or None, got 0"):
            model.estimate_sequence(frames, num_flow_updates=0)


def _griddata_forward_interpolate(flow: torch.Tensor) -> torch.Tensor:
    """RAFT's forward_interpolate (utils.py of princeton-vl/RAFT and locuslab/deq-flow), written again on
    scipy's griddata as the independent reference."""
    interpolate = pytest.importorskip("scipy.interpolate")
    import numpy as np

    dx, dy = flow.double().numpy()
    h, w = dx.shape
    x0, y0 = np.meshgrid(np.arange(w), np.arange(h))
    x1, y1 = (x0 + dx).ravel(), (y0 + dy).ravel()
    keep = (x1 > 0) & (x1 < w) & (y1 > 0) & (y1 < h)
    out = [
        interpolate.griddata((x1[keep], y1[keep]), d.ravel()[keep], (x0, y0), method="nearest", fill_value=0)
        for d in (dx, dy)
    ]
    return torch.from_numpy(np.stack(out)).to(flow.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_convex_upsampling_against_a_per_pixel_weighted_sum(dtype):
    """Each fine pixel (8i + a, 8j + b) is the softmax(mask[:, 64k + 8a + b, i, j]) combination over k of
    8 × the coarse flow at the k-th cell of (i, j)'s zero-padded 3×3 neighbourhood (row-major)."""
    gen = torch.Generator().manual_seed(5)
    f, (h, w) = 8, (3, 4)
    flow = torch.randn(2, 2, h, w, generator=gen, dtype=torch.float64)
    mask = torch.randn(2, 9 * f * f, h, w, generator=gen, dtype=torch.float64) * 3
    padded = torch.nn.functional.pad(f * flow, (1, 1, 1, 1))
    expected = torch.empty(2, 2, f * h, f * w, dtype=torch.float64)
    for i, j, a, b in ((i, j, a, b) for i in range(h) for j in range(w) for a in range(f) for b in range(f)):
        weights = torch.softmax(mask[:, [f * f * k + f * a + b for k in range(9)], i, j], dim=1)  # (2, 9)
        cells = torch.stack([padded[:, :, i + dy, j + dx] for dy in range(3) for dx in range(3)], -1)
        expected[:, :, f * i + a, f * j + b] = (cells * weights[:, None]).sum(-1)
    got = upsample_flow(flow.to(dtype), mask.to(dtype))
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    # without a mask: bilinear, corners kept, in full-resolution pixels
    plain = upsample_flow(flow, None)
    torch.testing.assert_close(plain[..., [0, -1], :][..., [0, -1]], f * flow[..., [0, -1], :][..., [0, -1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_interpolate_matches_rafts_griddata(dtype):
    gen = torch.Generator().manual_seed(3)
    flow = (torch.rand(2, 2, 9, 13, generator=gen, dtype=torch.float64) - 0.5) * 8  # fractional, some leave
    flow[1, :, 3:6, 4:9] += torch.tensor([2.7, -1.3], dtype=torch.float64)[:, None, None]  # a moving block
    flow = flow.to(dtype)
    got = forward_interpolate(flow)
    assert got.dtype == dtype and got.shape == flow.shape
    for b in range(2):
        torch.testing.assert_close(got[b], _griddata_forward_interpolate(flow[b]), rtol=0, atol=0)
    torch.testing.assert_close(forward_interpolate(flow[0]), got[0], rtol=0, atol=0)  # (2, H, W) too


def test_forward_interpolate_constant_flow_and_edges():
    constant = torch.zeros(1, 2, 6, 10)
    constant[:, 0], constant[:, 1] = 2.0, -1.0
    # every pixel moves by (2, -1): the landed points carry the constant, so the splat is the same constant
    assert torch.equal(forward_interpolate(constant), constant)
    # a pattern moving right: its flow is found where it lands (columns 2-5 land on 4.25-7.25), not where it
    # started; the background left of it stays, the background right of it moves on by 2.5 px
    block = torch.zeros(1, 2, 8, 16)
    block[:, 0, :, 2:6] = 2.25
    block[:, 0, :, 6:] = 2.5
    moved = forward_interpolate(block)[0, 0]
    assert torch.equal(moved[:, 3:8], torch.full((8, 5), 2.25))
    assert torch.equal(moved[:, :3], torch.zeros(8, 3))  # uncovered: the nearest landed point is background
    assert torch.equal(moved[:, 8:], torch.full((8, 8), 2.5))
    # everything leaves the frame: no point lands inside, the start is zero (RAFT's fill value)
    assert torch.equal(forward_interpolate(torch.full((1, 2, 4, 4), 9.0)), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\(B, 2, H, W\) or \(2, H, W\) flow, got \(1, 3, 4, 4\)"):
        forward_interpolate(torch.zeros(1, 3, 4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_warp_against_closed_forms(dtype):
    """Backward warp out(x) = image(x + flow(x)): integer flows index the image (border-clamped), and a
    sub-pixel flow reproduces an affine image exactly (bilinear interpolation is exact on affine maps)."""
    torch.manual_seed(0)
    image = torch.randn(2, 3, 7, 9, dtype=dtype)
    flow = torch.randint(-3, 4, (2, 2, 7, 9)).to(dtype)
    ys, xs = torch.meshgrid(torch.arange(7), torch.arange(9), indexing="ij")
    src_x = (xs + flow[:, 0].long()).clamp(0, 8)
    src_y = (ys + flow[:, 1].long()).clamp(0, 6)
    expected = torch.stack([image[b][:, src_y[b], src_x[b]] for b in range(2)])
    atol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(warp(image, flow), expected, rtol=0, atol=atol)
    affine = (0.7 * xs - 1.3 * ys + 2.0).to(dtype)[None, None]
    sub = torch.empty(1, 2, 7, 9, dtype=dtype).uniform_(-0.9, 0.9)  # stays inside from the interior
    inner = (slice(1, -1), slice(1, -1))
    want = 0.7 * (xs + sub[0, 0]) - 1.3 * (ys + sub[0, 1]) + 2.0
    torch.testing.assert_close(warp(affine, sub)[0, 0][inner], want[inner], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"flow of shape \(2, 2, 7, 9\) for this image, got \(2, 2, 7, 8\)"):
        warp(image, flow[..., :8])


def test_warp_reuse_moves_the_state_by_a_fraction_of_a_cell():
    """A pattern moving 0.4 cells per frame at 1/8 resolution: nearest-neighbour splatting (the original's
    forward_interpolate) leaves the hidden state where it was, the "warp" start moves it with the content
    (h(x - 0.4) of an affine h, exactly, away from the border), and a constant flow stays constant."""
    hidden = (0.5 * torch.arange(10.0)).expand(1, 4, 6, 10).clone() + torch.arange(4.0)[None, :, None, None]
    flow = torch.zeros(1, 2, 6, 10)
    flow[:, 0] = 0.4
    h_fi, f_fi = _next_start((hidden, flow), "forward_interpolate")
    assert torch.equal(h_fi, hidden) and torch.equal(f_fi, flow)
    h_w, f_w = _next_start((hidden, flow), "warp")
    torch.testing.assert_close(h_w[..., 1:], hidden[..., 1:] - 0.5 * 0.4, rtol=0, atol=1e-5)
    torch.testing.assert_close(f_w, flow, rtol=0, atol=1e-6)


def test_weight_norm_save_load_round_trip(tmp_path):
    model = _model(weight_norm=True)
    torch.manual_seed(7)
    a, b = torch.rand(1, 3, 40, 48), torch.rand(1, 3, 40, 48)
    with torch.no_grad():
        ref = model(a, b).flow
    model.save_pretrained(tmp_path)
    again = deqzoo.from_pretrained(tmp_path, deq={"on_nonconvergence": "ignore"}).eval()
    assert type(again) is DEQFlowForOpticalFlow
    assert any(k.endswith("weight_g") for k in again.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(a, b).flow, ref)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="corr_levels"):
        DEQFlowConfig(corr_levels=0)
    with pytest.raises(ValueError, match="feature_norm"):
        DEQFlowConfig(feature_norm="layer")
    with pytest.raises(ValueError, match="encoder_layers"):
        DEQFlowConfig(encoder_layers=[64, 64])
    with pytest.raises(ValueError, match="jac_loss_weight"):
        DEQFlowConfig(jac_loss_weight=-1.0)


@pytest.mark.parametrize("implicit", [True, False])
def test_encoder_checkpointing_gives_the_same_loss_and_gradients(implicit):
    """transformers' activation checkpointing of the encoders (batch norm in the context encoder, so a
    recomputation that drew different statistics would show) changes memory, not the numbers."""
    model = _model(implicit=implicit, num_flow_updates=3, context_norm="batch", deq={"n_states": 2}).train()
    torch.manual_seed(8)
    a, b, gt = torch.rand(2, 3, 40, 48), torch.rand(2, 3, 40, 48), torch.randn(2, 2, 40, 48)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(a, b, flow_gt=gt)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_loss, ref = loss_and_grads()
    model.load_state_dict(state)  # batch norm running statistics as before the reference step
    assert not model.is_gradient_checkpointing
    enable_checkpointing(model)
    assert model.is_gradient_checkpointing
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], msg=name)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert not model.is_gradient_checkpointing


def test_jacobian_regularizer_joins_the_training_loss():
    model = _model(deq={"jac_reg_samples": 1}, jac_loss_weight=0.5).train()
    torch.manual_seed(9)
    a, b, gt = torch.rand(1, 3, 40, 48), torch.rand(1, 3, 40, 48), torch.randn(1, 2, 40, 48)
    torch.manual_seed(10)
    out = model(a, b, flow_gt=gt)
    torch.manual_seed(10)
    model.config.jac_loss_weight = 0.0
    plain = model(a, b, flow_gt=gt)
    jac = out.deq_stats.jac_loss
    assert jac is not None and float(jac.detach()) > 0
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * jac)


def test_residual_loss_is_the_relative_equilibrium_residual_at_the_output():
    """residual_loss = ||f(z) - z|| / ||z|| at the returned state z, recomputed here from the update
    operator, and part of the training loss; none in inference."""
    model = _model(residual_loss_weight=3.0, deq={"f_max_iter": 5}).train()
    torch.manual_seed(11)
    a, b, gt = torch.rand(2, 3, 40, 48), torch.rand(2, 3, 40, 48), torch.randn(2, 2, 40, 48)
    out = model(a, b, flow_gt=gt)
    model.config.residual_loss_weight = 0.0
    plain = model(a, b, flow_gt=gt)
    h, flow = out.fixed_point
    with torch.no_grad():
        features = model.features(a, b)
        coords0 = coords_grid(2, *features.context.shape[-2:])
        f = model.update_fn(features.context, coords0, features.pyramid)
        fh, fflow = f((h, flow))
        num = ((fh - h).flatten(1).pow(2).sum(1) + (fflow - flow).flatten(1).pow(2).sum(1)).sqrt()
        den = (h.flatten(1).pow(2).sum(1) + flow.flatten(1).pow(2).sum(1)).sqrt()
        expected = (num / den).mean()
    torch.testing.assert_close(out.residual_loss.detach(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss.detach(), plain.loss.detach() + 3.0 * expected, rtol=1e-4, atol=1e-5)
    assert plain.residual_loss is None
    model.config.flow_residual_weight = 2.0  # the flow's drift per step, in full-resolution pixels
    drift = model(a, b, flow_gt=gt)
    expected_drift = 8 * (fflow - flow).abs().mean()
    torch.testing.assert_close(
        drift.loss.detach(), plain.loss.detach() + 2.0 * expected_drift, rtol=1e-4, atol=1e-5
    )
    with torch.no_grad():
        assert model(a, b).residual_loss is None  # inference: no extra f call


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "case",
    [
        # the checkpoint's recipe: 3 correction states, weight norm (shared by every term), the drift term
        dict(deq={"n_states": 3}, flow_residual_weight=2.0, residual_loss_weight=0.5, ckpt=False),
        # encoder checkpointing; a solve that stops early (its later states start from its output); GMA's
        # shared attention; the Jacobian regularizer (built in the solve)
        dict(deq={"n_states": 3, "f_tol": 0.3, "jac_reg_samples": 1}, jac_loss_weight=0.1, gma=True,
             ckpt=True),
        # IFT backward at the output, explicit state indices, damped correction steps
        dict(deq={"n_states": 0, "state_indices": [2, 5, 9], "b_mode": "ift", "b_max_iter": 20,
                  "correction_k": 2, "correction_tau": 0.6}, ckpt=False),
    ],
)
def test_two_stage_backward_gradients_equal_the_one_shot_backward(case):
    """deqzoo.models.deq_flow.two_stage_backward (encoders once, one supervised state's graph at a time, then
    the encoders' backward with the collected leaf gradients) gives the gradients of
    model(...).loss.backward() to 1e-6 in float64, on every parameter, and the same loss."""
    from deqzoo.models.deq_flow import two_stage_backward

    case = dict(case)
    ckpt, deq = case.pop("ckpt"), case.pop("deq")
    base = {"f_solver": "fixed_point", "f_max_iter": 9, "f_tol": 1e-12, "b_mode": "phantom",
            "b_mode_kwargs": {"k": 1, "tau": 1.0}} if deq.get("b_mode") != "ift" else {
            "f_solver": "anderson", "f_max_iter": 9, "f_tol": 1e-12, "b_mode_kwargs": {}}
    model = _model(weight_norm=True, deq={**base, **deq}, **case).double().train()
    if ckpt:
        enable_checkpointing(model)
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.rand(2, 3, 40, 56, generator=gen, dtype=torch.float64) for _ in range(2))
    gt = torch.randn(2, 2, 40, 56, generator=gen, dtype=torch.float64) * 2
    valid = (torch.rand(2, 40, 56, generator=gen) > 0.2).double()

    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    one = model(a, b, flow_gt=gt, valid=valid)
    one.loss.backward()
    ref = _grads(model)

    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    two = two_stage_backward(model, a, b, gt, valid)
    got = _grads(model)
    n_terms = len(model.config.deq_config.state_steps(9)) + bool(case.get("flow_residual_weight")) + bool(
        case.get("jac_loss_weight"))
    assert len(two.loss_terms) == n_terms
    if deq.get("f_tol", 0) > 0.1:  # the solve stopped early: its later states start from its output
        assert two.deq_stats.nfe < 3
    assert two.flow_predictions is None and not two.flow.requires_grad
    torch.testing.assert_close(two.flow, one.flow.detach(), rtol=0, atol=1e-12)  # same output values
    torch.testing.assert_close(two.loss, one.loss.detach(), rtol=1e-10, atol=1e-12)
    assert ref.keys() == got.keys() and len(ref) > 20
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-9, msg=name)
    assert float(ref["feature_encoder.convnormrelu.0.weight"].abs().max()) > 0  # through the encoders too


def test_defer_loss_refuses_the_explicit_twin():
    raft = _model(implicit=False, num_flow_updates=2).train()
    a = torch.rand(1, 3, 32, 32)
    with pytest.raises(ValueError, match="defer_loss needs the DEQ"):
        raft(a, a, flow_gt=torch.zeros(1, 2, 32, 32), defer_loss=True)
