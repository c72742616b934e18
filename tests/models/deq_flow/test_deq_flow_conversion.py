"""Converted original DEQ-Flow checkpoints reproduce the original implementations' flows.

Fixtures (conversion/fixtures/deq_flow/, described in fixtures.json) were produced once by running the
upstream code (locuslab/deq-flow v1.0 and v2.0, TorchDEQ deq-zoo) outside the repository: an original-format
state dict of a narrowed model and the original's flow after exactly 6 fixed-point steps of f from zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import deqzoo
from conversion import converter_module

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "conversion" / "fixtures" / "deq_flow"
META = json.loads((FIX / "fixtures.json").read_text())
L, T = converter_module("deq_flow_locuslab"), converter_module("deq_flow_torchdeq")
CASES = {"v2": L, "v1": L, "torchdeq": T}


def _convert(version: str, tmp_path: Path, **options):
    out = CASES[version].convert(
        FIX / META[version]["checkpoint"],
        tmp_path / version,
        implicit=False,
        num_flow_updates=META["steps"],
        **options,
    )
    model = deqzoo.from_pretrained(out).eval()
    return model, load_file(FIX / META[version]["io"])


@pytest.mark.parametrize("version", sorted(CASES))
def test_converted_flow_matches_the_original(version, tmp_path):
    model, io = _convert(version, tmp_path)
    assert model.config.weight_norm and model.config.gma == (version != "torchdeq")
    with torch.no_grad():
        out = model(io["image1"], io["image2"])
    diff = float((out.flow - io["flow_up"]).abs().max())
    assert diff <= 1e-4, diff
    torch.testing.assert_close(out.flow_low, io["flow_low"], rtol=0, atol=1e-4)
    # the fixture discriminates: one update more or less is far outside the tolerance
    model.config.num_flow_updates = META["steps"] + 1
    with torch.no_grad():
        assert float((model(io["image1"], io["image2"]).flow - io["flow_up"]).abs().max()) > 1e-2


def test_folding_weight_norm_keeps_the_outputs(tmp_path):
    model, io = _convert("v2", tmp_path, fold_weight_norm=True)
    assert not model.config.weight_norm
    assert not any(k.endswith("weight_g") for k in model.state_dict())
    with torch.no_grad():
        out = model(io["image1"], io["image2"])
    assert float((out.flow - io["flow_up"]).abs().max()) <= 1e-4


def test_converted_model_solves_for_the_equilibrium(tmp_path):
    """The same weights as a DEQ (the converter's default): the original's evaluation solver settings."""
    out = L.convert(FIX / META["v2"]["checkpoint"], tmp_path / "deq")
    model = deqzoo.from_pretrained(out, deq={"on_nonconvergence": "ignore"}).eval()
    assert model.config.implicit and model.config.deq["f_max_iter"] == 60
    io = load_file(FIX / META["v2"]["io"])
    with torch.no_grad():
        res = model(io["image1"], io["image2"])
    assert res.flow.shape == io["flow_up"].shape and res.deq_stats.nfe >= 1
    assert (tmp_path / "deq" / "README.md").read_text().startswith("---")


def test_bad_checkpoints_are_refused_with_the_file_named(tmp_path):
    sd = torch.load(FIX / META["v2"]["checkpoint"], weights_only=True)
    small = {k: v for k, v in sd.items() if not k.startswith("update_block.encoder.convc2")}
    torch.save(small, tmp_path / "small.pth")
    with pytest.raises(ValueError, match="small.pth.*--small"):
        L.convert(tmp_path / "small.pth", tmp_path / "o1")
    torch.save({"a.weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="other.pth.*not a DEQ-Flow"):
        L.convert(tmp_path / "other.pth", tmp_path / "o2")
    extra = dict(sd, **{"update_block.extra.weight": torch.zeros(1)})
    torch.save(extra, tmp_path / "extra.pth")
    with pytest.raises(ValueError, match="extra.pth.*update_block.extra.weight"):
        L.convert(tmp_path / "extra.pth", tmp_path / "o3")
    spectral = dict(sd, **{"update_block.flow_head.conv1.weight_orig": torch.zeros(1)})
    torch.save(spectral, tmp_path / "spectral.pth")
    with pytest.raises(ValueError, match="spectral"):
        T.convert(tmp_path / "spectral.pth", tmp_path / "o4")


def test_cli_lists_the_formats():
    from conversion import conversion_formats

    assert {"deq-flow-locuslab", "deq-flow-torchdeq"} <= set(conversion_formats())


# the originals' evaluation settings, read from their val.sh and argument defaults (see the converters'
# docstrings): written out here, not imported, so a converter that drifts from them fails
V2_EVAL = {"f_solver": "fixed_point", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}  # 40 x 1.5
V1_B_EVAL = {"f_solver": "anderson", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}  # 40 x 1.5
V1_H_EVAL = {"f_solver": "broyden", "f_max_iter": 54, "f_tol": 1e-3, "f_stop_mode": "abs"}  # 36 x 1.5
TORCHDEQ_EVAL = {"f_solver": "fixed_point", "f_max_iter": 60, "f_tol": 1e-3, "f_stop_mode": "abs"}


@pytest.mark.parametrize("version, expected",
                         [("v2", V2_EVAL), ("v1", V1_B_EVAL), ("torchdeq", TORCHDEQ_EVAL)])
def test_converters_write_the_release_evaluation_settings(version, expected, tmp_path):
    out = CASES[version].convert(FIX / META[version]["checkpoint"], tmp_path / version)
    written = json.loads((out / "config.json").read_text())["deq"]
    assert {k: written[k] for k in expected} == expected
    if version == "v1":
        assert written["f_solver_kwargs"] == {"m": 6, "tau": 1.0}  # the release's anderson(m=6, beta=1.0)
    card = (out / "README.md").read_text()
    assert f"`{expected['f_solver']}`" in card and f"at most {expected['f_max_iter']} steps" in card
    assert "absolute residual of (h, flow) is below 0.001" in card
    # the written settings are the ones the loaded model solves with: an abs stop on (h, flow)
    model = deqzoo.from_pretrained(out, deq={"on_nonconvergence": "ignore"}).eval()
    io = load_file(FIX / META[version]["io"])
    with torch.no_grad():
        res = model(io["image1"], io["image2"])
    stats = res.deq_stats
    assert stats.solver == expected["f_solver"] and stats.stop_mode == "abs" and stats.tol == 1e-3
    assert stats.nfe <= expected["f_max_iter"] + 1
    assert torch.equal(stats.converged, stats.abs_residual <= 1e-3)


def test_v1_release_and_width_choose_the_solver():
    sd = torch.load(FIX / META["v1"]["checkpoint"], weights_only=True)
    assert L.release_version(sd) == "v1.0"
    assert L.release_version(torch.load(FIX / META["v2"]["checkpoint"], weights_only=True)) == "v2.0"
    h = L.eval_settings("v1.0", 256)  # DEQ-Flow-H (--huge): val.sh's broyden, f_thres 36
    assert {k: h[k] for k in V1_H_EVAL} == V1_H_EVAL and "f_solver_kwargs" not in h
    assert {k: L.eval_settings("v1.0", 128)[k] for k in V1_B_EVAL} == V1_B_EVAL
    assert L.eval_settings("v2.0", 256) == V2_EVAL
    with pytest.raises(ValueError, match="release"):
        L.eval_settings("v3.0", 128)
