"""`deqzoo bench deq-flow`: DEQ-Flow's training graph does not grow with the solver's iterations, RAFT's does;
the report (JSON + PNG) carries memory, time and reuse along the video."""

from __future__ import annotations

import json

from deqzoo.bench import deq_flow as bench


def test_deq_graph_is_constant_in_iterations_and_raft_grows():
    deq2 = bench.measure_training("deq-flow", 2, batch=1, repeats=1)
    deq6 = bench.measure_training("deq-flow", 6, batch=1, repeats=1)
    raft2 = bench.measure_training("raft", 2, batch=1, repeats=1)
    raft6 = bench.measure_training("raft", 6, batch=1, repeats=1)
    assert deq2["graph_mb"] == deq6["graph_mb"] > 0
    assert raft6["graph_mb"] > 1.2 * raft2["graph_mb"]  # every unrolled update keeps its graph
    assert deq2["param_mb"] == raft2["param_mb"]  # the same blocks and parameters
    assert deq6["peak_mb"] < raft6["peak_mb"]


def test_main_writes_the_report(tmp_path, monkeypatch):
    def in_process(kind, iters, preset, batch, size, n_states, repeats):
        return bench.measure_training(kind, iters, preset=preset, batch=batch, size=size, n_states=n_states,
                                      repeats=1)

    monkeypatch.setattr(bench, "_subprocess", in_process)
    assert bench.main(["--quick", "--iterations", "2", "4", "--frames", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "deq_flow_bench.json").read_text())
    assert (tmp_path / "deq_flow_bench.png").is_file()
    assert len(report["training"]) == 6
    assert report["summary"]["deq-flow-cpu: deq_growth_2_to_4_1_state"] == 0.0
    assert report["summary"]["deq-flow-cpu: raft_growth_2_to_4"] > 0.05
    video = report["reuse"]
    assert len(video["cold"]["nfe"]) == len(video["reuse"]["nfe"]) == 2
    assert video["cold"]["nfe"][0] == video["reuse"]["nfe"][0]  # the first pair has nothing to reuse
