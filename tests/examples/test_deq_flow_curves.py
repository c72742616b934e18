"""examples/deq_flow/train.py --keep-every and examples/deq_flow/curves.py (issue #32): the long runs keep
weights-only snapshots that an interrupted and resumed run writes exactly as an uninterrupted one, and the
curves are `deqzoo.tasks.flow.evaluate` of those snapshots at the cards' settings, cached per snapshot."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import deqzoo
from deqzoo.tasks.flow import evaluate
from examples.deq_flow import curves
from examples.deq_flow.make_cards import INFERENCE_DEQ, _curve_section, _deq_recipe, _log
from examples.deq_flow.train import main as train

TINY = ["--steps", "4", "--batch-size", "1", "--keep-every", "2", "--save-every", "2", "--log-every", "2",
        "--no-progress"]


def _run(out, model="deq-flow-cpu", *extra):
    assert train(["--model", model, "--out", str(out), *TINY, *extra]) == 0


def _weights(snapshot):
    return load_file(str(snapshot / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted DEQ-Flow run of 4 steps and a RAFT-twin run of 2, snapshots every 2 steps."""
    root = tmp_path_factory.mktemp("runs")
    _run(root / "deq")
    assert train(["--model", "raft-cpu", "--out", str(root / "raft"), *TINY, "--steps", "2"]) == 0
    return root


def test_snapshots_of_an_interrupted_and_resumed_run_equal_the_uninterrupted_ones(tmp_path, runs):
    whole = runs / "deq"
    _run(tmp_path / "split", "deq-flow-cpu", "--stop-after", "2")  # what a killed session leaves, at step 2
    split = tmp_path / "split" / "snapshots"
    assert sorted(p.name for p in split.iterdir()) == ["step-000000", "step-000002"]
    assert not (tmp_path / "split" / "model").exists()  # stopped early: no final model yet
    kept = (split / "step-000002" / "model.safetensors").stat().st_mtime_ns
    _run(tmp_path / "split")  # rerunning the same command resumes at step 2
    names = ["step-000000", "step-000002", "step-000004"]
    for run in (whole, tmp_path / "split"):
        assert sorted(p.name for p in (run / "snapshots").iterdir()) == names
    assert (split / "step-000002" / "model.safetensors").stat().st_mtime_ns == kept  # never rewritten
    for name in names:
        a, b = _weights(whole / "snapshots" / name), _weights(split / name)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), name
        meta = json.loads((split / name / "snapshot.json").read_text())
        assert meta["step"] == int(name[-6:])
        assert set(meta) == {"step", "elapsed", "model_seconds", "cpu_seconds"}
    cpu = [json.loads((split / n / "snapshot.json").read_text())["cpu_seconds"] for n in names]
    assert cpu[0] == 0 < cpu[1] < cpu[2]  # CPU time carried over the resume, not restarted
    first, last = _weights(split / "step-000000"), _weights(split / "step-000004")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # training moved the weights
    # the rerun resumed after step 2's line; a killed session's lines past its checkpoint (here: a stale
    # step 4 logged before the rerun's) count once, the later line, in the cards' training curves
    log = tmp_path / "split" / "log.jsonl"
    lines = log.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4]
    log.write_text("\n".join([lines[0], lines[1].replace('"loss"', '"stale": 1, "loss"'), lines[1]]) + "\n")
    assert [(e["step"], "stale" in e) for e in _log(tmp_path / "split")] == [(2, False), (4, False)]
    final = load_file(str(tmp_path / "split" / "model" / "model.safetensors"))
    assert all(torch.equal(final[k], last[k]) for k in final)  # the last snapshot is the final model


def test_curves_equal_a_direct_evaluate_of_each_snapshot_and_are_cached(tmp_path, runs, monkeypatch, capsys):
    out = tmp_path / "curves"
    args = [str(runs / "deq"), str(runs / "raft"), "--names", "deq", "raft", "--limit", "2"]
    args += ["--out", str(out)]
    assert curves.main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["step"] for r in report["common_steps"]] == [0, 2]  # the steps both runs have
    for name, model, steps in (("deq", "deq-flow-cpu", [0, 2, 4]), ("raft", "raft-cpu", [0, 2])):
        points = report["curves"][name]
        assert [p["step"] for p in points] == steps
        for point in points:
            # the reference: the preset built afresh, the snapshot's tensors loaded, the card's solver set
            snap = runs / name / "snapshots" / f"step-{point['step']:06d}"
            ref = deqzoo.create_model(model)
            ref.load_state_dict(load_file(str(snap / "model.safetensors")))
            if model == "deq-flow-cpu":
                ref.set_deq(**INFERENCE_DEQ)
                assert ref.config.deq["f_tol"] == 5e-3 and ref.config.deq["f_max_iter"] == 24
            direct = evaluate(ref, limit=2, progress=False, baselines=False)
            assert {k: point[k] for k in direct} == direct
    printed = capsys.readouterr().out
    row = report["common_steps"][-1]
    assert f"| 2 | {row['deq']:.4f} | {row['raft']:.4f} |" in printed

    # the cards' section: the rows at every 2nd step (here: all) and the last, the report's numbers
    section = _curve_section(report, every=2)
    for r in report["common_steps"]:
        assert f"| {r['step']} | {r['deq']:.4f} | {r['raft']:.4f} |" in section
    assert "(first 2)" in section and "![held-out EPE vs steps](curves.png)" in section

    def no_evaluation(*a, **k):
        raise AssertionError("a cached snapshot was evaluated again")

    monkeypatch.setattr(curves, "evaluate", no_evaluation)
    assert curves.main(args) == 0  # every snapshot cached: nothing evaluated
    assert json.loads(out.with_suffix(".json").read_text())["curves"] == report["curves"]


def test_curves_refuses_a_folder_without_snapshots_and_a_foreign_report(tmp_path):
    with pytest.raises(FileNotFoundError, match="keep-every"):
        curves.snapshots(tmp_path)
    (tmp_path / "mine.json").write_text("{}")
    with pytest.raises(SystemExit):
        curves.main([str(tmp_path), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine.json").read_text() == "{}"


def test_a_rerun_with_another_recipe_is_refused(runs, capsys):
    before = sorted(p.name for p in (runs / "deq" / "snapshots").iterdir())
    with pytest.raises(SystemExit, match="steps: 4.*now steps: 6"):
        train(["--model", "deq-flow-cpu", "--out", str(runs / "deq"), *TINY, "--steps", "6"])
    with pytest.raises(SystemExit, match="deq"):
        train(["--model", "deq-flow-cpu", "--out", str(runs / "deq"), *TINY, "--deq", '{"n_states": 6}'])
    assert sorted(p.name for p in (runs / "deq" / "snapshots").iterdir()) == before


def test_card_recipe_names_the_runs_correction_states():
    assert "iterations 8, 16 and 24 " in _deq_recipe({"deq": {}})  # the preset: the embedded checkpoint's
    six = _deq_recipe({"deq": {"n_states": 6}})
    assert "iterations 4, 8, 12, 16, 20 and 24 " in six and "at most 24 steps" in six
    stage2 = _deq_recipe({"deq": {}, "steps": 600, "lr": 2e-4, "flow_residual_weight": 2}, {"steps": 1600})
    assert stage2.startswith("Stage 1 (1600 steps)") and "iterations 8, 16 and 24 " in stage2
