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
    if version == "v1":  # the release's anderson(m=6, beta=1.0, lam=1e-4) regularises absolutely
        assert written["f_solver_kwargs"] == {"m": 6, "tau": 1.0, "lam": 1e-4, "lam_mode": "abs"}
    # what the original returns from its solve: f of the accepted iterate (v2.0's naive solver, TorchDEQ's
    # fixed_point_iter), the iterate itself (v1.0's anderson)
    assert written["f_final_step"] == (False if version == "v1" else 1)
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
    assert stats.nfe <= expected["f_max_iter"] + 2  # + the final step's f and the call that measures it
    assert torch.equal(stats.converged, stats.abs_residual <= 1e-3)


def test_v1_release_and_width_choose_the_solver():
    sd = torch.load(FIX / META["v1"]["checkpoint"], weights_only=True)
    assert L.release_version(sd) == "v1.0"
    assert L.release_version(torch.load(FIX / META["v2"]["checkpoint"], weights_only=True)) == "v2.0"
    h = L.eval_settings("v1.0", 256)  # DEQ-Flow-H (--huge): val.sh's broyden, f_thres 36
    assert {k: h[k] for k in V1_H_EVAL} == V1_H_EVAL
    # its broyden's extra breaks: 30-step stall; protective break at 1e6 x positions x the first residual,
    # (256 + 2) state elements a position
    assert h["f_solver_kwargs"] == {"stall_window": 30, "protect_per_element": 1e6 / 258}
    assert {k: L.eval_settings("v1.0", 128)[k] for k in V1_B_EVAL} == V1_B_EVAL
    assert L.eval_settings("v2.0", 256) == V2_EVAL
    with pytest.raises(ValueError, match="release"):
        L.eval_settings("v3.0", 128)


@pytest.mark.parametrize("version", ["v2", "torchdeq"])
def test_converted_deq_returns_the_originals_point(version, tmp_path):
    """The fixture's flow is what the original's solver returns after 6 fixed-point steps (v2.0's
    naive_solver, TorchDEQ's fixed_point_iter): f of the iterate it accepts. The converter's written
    settings, at the same budget, return it (issue 58: 0.92 px and 0.33 px apart when the iterate itself
    was returned)."""
    out = CASES[version].convert(FIX / META[version]["checkpoint"], tmp_path / version)
    io = load_file(FIX / META[version]["io"])
    budget = {"f_max_iter": META["steps"], "f_tol": 1e-12, "on_nonconvergence": "ignore"}
    model = deqzoo.from_pretrained(out, deq=budget).eval()
    assert model.config.deq["f_solver"] == "fixed_point" and model.config.deq["f_final_step"] == 1
    with torch.no_grad():
        res = model(io["image1"], io["image2"])
    diff = float((res.flow - io["flow_up"]).abs().max())
    print(f"{version}: max |deqzoo - original returned flow| = {diff:.2e} px")
    assert diff <= 1e-4
    torch.testing.assert_close(res.flow_low, io["flow_low"], rtol=0, atol=1e-4)
    model.set_deq(f_final_step=False)  # the iterate: one update short
    with torch.no_grad():
        assert float((model(io["image1"], io["image2"]).flow - io["flow_up"]).abs().max()) > 1e-2


def v1_anderson_reference(g, x0, *, max_iter, tol, stop_mode="abs", **_):
    """A transcription of DEQ-Flow v1.0's anderson (code.v.1.0/core/lib/solvers.py: m 6, lam 1e-4 added to
    the Gram matrix, beta 1, the batch-mean residual, returns the lowest-residual X), registered as a solver
    so that it runs on the converted model's own f."""
    from deqzoo.core.stats import SolverStats

    b, m = x0.shape[0], 6
    X, F = x0.new_zeros(b, m, x0.shape[1]), x0.new_zeros(b, m, x0.shape[1])
    X[:, 0], F[:, 0] = x0, g(x0)
    X[:, 1], F[:, 1] = F[:, 0], g(F[:, 0])
    H = x0.new_zeros(b, m + 1, m + 1)
    H[:, 0, 1:] = H[:, 1:, 0] = 1
    y = x0.new_zeros(b, m + 1, 1)
    y[:, 0] = 1
    lowest, lowest_x, nfe = float("inf"), x0, 2
    for k in range(2, max_iter):
        n = min(k, m)
        G = F[:, :n] - X[:, :n]
        H[:, 1:n + 1, 1:n + 1] = G @ G.transpose(1, 2) + 1e-4 * torch.eye(n, dtype=x0.dtype)[None]
        alpha = torch.linalg.solve(H[:, :n + 1, :n + 1], y[:, :n + 1])[:, 1:n + 1, 0]
        X[:, k % m] = (alpha[:, None] @ F[:, :n])[:, 0]
        F[:, k % m] = g(X[:, k % m])
        nfe += 1
        gx = F[:, k % m] - X[:, k % m]
        a = gx.norm(dim=1)
        r = float((a if stop_mode == "abs" else a / (1e-5 + F[:, k % m].norm(dim=1))).mean())
        if r < lowest:
            lowest, lowest_x = r, X[:, k % m].clone()
        if r < tol:
            break
    res = (g(lowest_x) - lowest_x).norm(dim=1)
    return lowest_x, SolverStats(nfe=nfe, abs_residual=res, rel_residual=res, trace=torch.zeros(0),
                                 converged=(res < tol).cpu(), solver="v1_anderson_reference",
                                 stop_mode=stop_mode, tol=tol)


def test_v1_converted_deq_returns_what_the_v1_anderson_returns(tmp_path, monkeypatch):
    """v1.0's fixture holds 6 plain steps (its release has no such solver), so v1.0's own returned point is
    checked in two parts: the converted f is the original's (the fixture, above), and the written solver
    settings return, on that f, what a transcription of v1.0's anderson returns (its lowest-residual iterate,
    absolute lam 1e-4), at its evaluation settings and at a 12-step budget (6.4e-12 px; deqzoo's relative
    lam 1e-5, what was written before, 0.84 px). In float64: this random-weight f
    does not converge (residual ~1), so float32 rounding in the two mixing solves grows with the steps
    (1.2e-6 px at 4 steps, 1.2e-3 at 12); in float64 they agree to 6e-12 at 60 steps."""
    from deqzoo.core.solvers import SOLVERS

    monkeypatch.setitem(SOLVERS, "v1_anderson_reference", v1_anderson_reference)
    out = L.convert(FIX / META["v1"]["checkpoint"], tmp_path / "v1")
    io = load_file(FIX / META["v1"]["io"])
    images = io["image1"].double(), io["image2"].double()
    for budget in ({}, {"f_max_iter": 12, "f_tol": 1e-12}):
        model = deqzoo.from_pretrained(out, deq={**budget, "on_nonconvergence": "ignore"}).eval().double()
        ref = deqzoo.from_pretrained(out, deq={**budget, "f_solver": "v1_anderson_reference",
                                               "f_solver_kwargs": {}, "on_nonconvergence": "ignore"})
        with torch.no_grad():
            got, want = model(*images).flow, ref.eval().double()(*images).flow
        diff = float((got - want).abs().max())
        print(f"v1 {budget or 'release settings'}: max |deqzoo - v1.0 anderson| = {diff:.2e} px")
        assert diff <= 1e-4, budget
    model.set_deq(f_solver_kwargs={"m": 6, "tau": 1.0})  # deqzoo's relative regularisation: another point
    with torch.no_grad():
        assert float((model(*images).flow - want).abs().max()) > 1e-3
