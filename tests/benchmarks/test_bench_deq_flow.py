"""`deqzoo bench deq-flow`: DEQ-Flow's training graph does not grow with the solver's iterations, RAFT's does;
the report (JSON + PNG) carries memory, time and reuse along the video."""

from __future__ import annotations

import json

import pytest

from benchmarks import deq_flow as bench


def test_deq_graph_is_constant_in_iterations_and_raft_grows():
    deq2 = bench.measure_training("deq-flow", 2, batch=1, repeats=1)
    deq6 = bench.measure_training("deq-flow", 6, batch=1, repeats=1)
    raft2 = bench.measure_training("raft", 2, batch=1, repeats=1)
    raft6 = bench.measure_training("raft", 6, batch=1, repeats=1)
    assert deq2["graph_mb"] == deq6["graph_mb"] > 0
    assert raft6["graph_mb"] > 1.2 * raft2["graph_mb"]  # every unrolled update keeps its graph
    assert deq2["param_mb"] == raft2["param_mb"]  # the same blocks and parameters
    assert deq6["peak_mb"] < raft6["peak_mb"]


def test_config_overrides_change_both_models_alike():
    """`config` (issue #32's wide pair): both models get the same wider update block (equal parameters,
    more than the preset's), the encoders' saved graph is unchanged and the update block's grows."""
    wide = {"hidden_dim": 96, "context_dim": 96}
    rows = {(kind, w): bench.measure_training(kind, 2, batch=1, repeats=1, config=wide if w else None)
            for kind in ("deq-flow", "raft") for w in (False, True)}
    wide_params = rows["deq-flow", True]["param_mb"]
    assert wide_params == rows["raft", True]["param_mb"] > rows["raft", False]["param_mb"]
    assert rows["raft", True]["config"] == wide and rows["raft", False]["config"] == {}
    for kind in ("deq-flow", "raft"):
        narrow, wider = rows[kind, False]["graph_by_part_mb"], rows[kind, True]["graph_by_part_mb"]
        assert wider["encoders"] == narrow["encoders"]
        assert wider["update block"] > 1.3 * narrow["update block"]


def test_saved_graph_by_part_and_encoder_checkpointing():
    """The saved graph splits into the model's parts (the encoders dominate DEQ-Flow's); activation
    checkpointing of the encoders removes their saved activations and lowers the step's tensor peak (forward
    and backward, recomputation included) for both models alike, leaving the other parts as they were."""
    rows = {
        (kind, ckpt): bench.measure_training(kind, 4, batch=2, repeats=1, checkpointing=ckpt)
        for kind in ("deq-flow", "raft")
        for ckpt in (False, True)
    }
    for kind in ("deq-flow", "raft"):
        off, on = rows[kind, False], rows[kind, True]
        assert abs(sum(off["graph_by_part_mb"].values()) - off["graph_mb"]) < 1e-9
        assert off["graph_by_part_mb"]["encoders"] > 0.5 * off["graph_mb"] if kind == "deq-flow" else True
        assert on["graph_by_part_mb"]["encoders"] < 0.3 * off["graph_by_part_mb"]["encoders"]  # block inputs
        for part in ("correlation", "update block", "upsampler"):
            assert on["graph_by_part_mb"][part] == off["graph_by_part_mb"][part]
        assert on["step_peak_mb"] < off["step_peak_mb"]
        assert off["step_peak_mb"] >= off["peak_mb"] * 0.95  # the timeline sees at least the saved graph
    # 4 unrolled updates keep their graphs; the DEQ keeps one phantom step's
    assert rows["raft", False]["graph_by_part_mb"]["update block"] > 1.5 * rows["deq-flow", False][
        "graph_by_part_mb"]["update block"]


def test_main_writes_the_report(tmp_path, monkeypatch):
    def in_process(kind, iters, preset, batch, size, n_states, repeats, checkpointing, two_stage=False):
        return bench.measure_training(kind, iters, preset=preset, batch=batch, size=size, n_states=n_states,
                                      repeats=1, checkpointing=checkpointing, two_stage=two_stage)

    monkeypatch.setattr(bench, "_subprocess", in_process)
    # encoder checkpointing on only (the setting of the acceptance ratios; on vs off is tested above)
    argv = ["--quick", "--iterations", "2", "4", "--frames", "3", "--checkpointing", "on"]
    argv += ["--out", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "deq_flow_bench.json").read_text())
    assert (tmp_path / "deq_flow_bench.png").is_file()
    assert len(report["training"]) == 8  # 2 iteration counts x 4 rows (RAFT, DEQ 1 / 3 / 3 two-stage states)
    assert {r["checkpointing"] for r in report["training"]} == {True}
    summary = report["summary"]
    for ckpt in ("on",):
        tag = f"deq-flow-cpu-synth, encoder checkpointing {ckpt}"
        assert summary[f"{tag}: saved deq_growth_2_to_4_1_state"] == 0.0
        assert abs(summary[f"{tag}: step_peak deq_growth_2_to_4_1_state"]) < 0.05
        assert summary[f"{tag}: saved raft_growth_2_to_4"] > 0.05
        assert summary[f"{tag}: step_peak raft_growth_2_to_4"] > 0.05
        assert abs(summary[f"{tag}: step_peak deq_growth_2_to_4_3_states_two_stage"]) < 0.05
    video = report["reuse"]
    assert len(video["cold"]["nfe"]) == len(video["reuse"]["nfe"]) == 2
    assert video["cold"]["nfe"][0] == video["reuse"]["nfe"][0]  # the first pair has nothing to reuse
    assert set(video["modes"]) == {"fixed_point", "forward_interpolate", "warm_start", "warp"}
    assert video["reuse"]["mode"] == "warp"  # estimate_sequence(reuse=True)
    for run in video["modes"].values():
        assert run["nfe"][0] == video["cold"]["nfe"][0] and run["nfe_ratio"] > 0
    eq = video["equal_accuracy"]
    assert eq["budgets"][-1] == video["max_iter"]
    assert set(eq["modes"]) == {"none", "warp", "forward_interpolate"}
    # a per-pair budget equal to f_max_iter is no cap: the cold curve's last point is the reference itself
    uncapped = eq["modes"]["none"]["curve"][-1]
    assert uncapped["mean_nfe"] == eq["reference"]["mean_nfe"]
    assert uncapped["mean_epe"] == pytest.approx(eq["reference"]["mean_epe"], rel=1e-6)
    for run in eq["modes"].values():
        assert [p["budget"] for p in run["curve"]] == eq["budgets"]
        assert all(p["mean_nfe"] <= p["budget"] for p in run["curve"])  # pairs after the first obey k
    held = eq["held_out"]
    chosen = {m: r["at_target"]["budget"] for m, r in eq["modes"].items() if m != "none" and r["at_target"]}
    assert held["seeds"] == [1] and {m: r["point"]["budget"] for m, r in held["modes"].items()} == chosen
    for start in video["start_residual"].values():  # each part is a share of the whole residual
        assert 0 < start["flow_part"] <= start["rel_residual"]
        assert 0 < start["hidden_part"] <= start["rel_residual"]


def test_two_stage_backward_lowers_the_step_peak_with_three_states():
    """With 3 supervised states, the two-stage backward keeps one state's graph at a time: its training-step
    tensor peak is below the one-shot backward's and close to the single-state step's."""
    rows = {
        name: bench.measure_training("deq-flow", 3, batch=1, repeats=1, n_states=n, two_stage=two)
        for name, n, two in (("one", 1, False), ("three", 3, False), ("three_two_stage", 3, True))
    }
    assert rows["three_two_stage"]["graph_mb"] is None and rows["three"]["graph_mb"] > rows["one"]["graph_mb"]
    assert rows["three_two_stage"]["step_peak_mb"] < rows["three"]["step_peak_mb"]
    assert rows["three_two_stage"]["step_peak_mb"] < 1.05 * rows["one"]["step_peak_mb"]
