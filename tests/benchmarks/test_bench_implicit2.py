"""`deqzoo bench implicit2` end to end on a tiny grid: JSON with ratios vs explicit 4L, reuse NFE, every T
at the same step count, PNGs (one bench call: each setting is its own process).

At this size a setting trains in well under a second and its process start-up (torch, transformers) costs
~6 s, so the test runs five settings through the very entry point each process runs (`--run-one NAME`)
in-process first, and the bench call launches the other two as two processes at once (`--jobs 2`) and
resumes over the five: the launcher, the parallel processes and the resume are all still exercised."""

import json

import pytest

from benchmarks.implicit2 import main


@pytest.mark.slow
def test_bench_writes_json_and_pngs(tmp_path, capsys):
    only = ("rep-gabor-imp-1l256d,rep-gabor-exp-4l256d,reuse-gabor-noreuse,reuse-gabor-onestep,T-gabor-T0,"
            "T-gabor-Tinf,time-gabor")
    args = ["--size", "8", "--steps", "5", "--t-steps", "3", "--time-rounds", "3", "--time-after", "2,4",
            "--filters", "gabor", "--groups", "rep,reuse,T,time", "--only", only, "--out", str(tmp_path)]
    launched = ("rep-gabor-imp-1l256d", "time-gabor")
    for name in only.split(","):
        if name not in launched:
            assert main([*args, "--run-one", name]) == 0
    capsys.readouterr()
    assert main([*args, "--jobs", "2"]) == 0
    assert "7 settings, 2 to run, 2 at a time" in capsys.readouterr().out
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.log")) == sorted(launched)  # their processes
    s = json.loads((tmp_path / "implicit2.json").read_text())
    rows = {r["name"]: r for r in s["rep"]}
    assert rows["rep-gabor-exp-4l256d"]["time_ratio_vs_exp4l"] == 1.0
    imp = rows["rep-gabor-imp-1l256d"]
    assert imp["params"] < rows["rep-gabor-exp-4l256d"]["params"]
    assert imp["memory_ratio_vs_exp4l"] < 1  # one layer's activations instead of four
    assert s["reuse"]["without"] >= s["reuse"]["with"]
    # the original's no-solve reuse: solver steps only at step 1, its states' residuals reported, and the
    # without-reuse count probed on its own weights (steps 1 and every 10th / after 100: step 1 here)
    one = s["reuse"]["runs"]["reuse, no solve on hits"]
    orec = json.loads((tmp_path / "runs" / "reuse-gabor-onestep.json").read_text())
    assert orec["nfe"][1:] == [0] * 4 and one["mean_solver_nfe_after_100"] == round(orec["nfe"][0] / 5, 2)
    assert one["cold_mean_nfe_after_100"]["0.01"] == orec["nfe"][0]  # step 1: both solve from zeros
    assert one["max_rel_residual_after_100"] == max(orec["residual"])
    # T = 0 / inf run --t-steps steps; the T = 1 row is the representation run's evaluation at that step
    assert set(s["T"]) == {"0", "1", "inf"}
    assert {row["steps"] for row in s["T"].values()} == {3}
    rec = json.loads((tmp_path / "runs" / "rep-gabor-imp-1l256d.json").read_text())
    assert [st for st, _ in rec["eval"]] == [3, 5]
    assert s["T"]["1"]["final_psnr"] == round(rec["eval"][0][1], 2)
    # the paper's per-pixel frequencies: 256 (MFN) and 128 (SIREN) at 512², scaled with the grid
    assert rec["input_scale"] == 256.0 * 8 / 512
    # interleaved timing: the three networks stepped in rotation, ratios of their medians, one phase per
    # --time-after entry (the tolerance-checked implicit net trained to at least 2, then 4 steps first)
    t = s["time"]["gabor"]
    assert [ph["after_steps"] for ph in t] == [2, 4]
    trec = json.loads((tmp_path / "runs" / "time-gabor.json").read_text())
    assert [ph["steps_before"]["imp-1l256d"] for ph in trec["phases"]] == [2, 2 + 3]  # already past 4
    assert [ph["steps_before"]["exp-4l256d"] for ph in trec["phases"]] == [2, 2 + 3]
    for ph, row in zip(trec["phases"], t):
        med = {k: sorted(v)[1] for k, v in ph["step_times"].items()}  # median of 3
        assert row["time_ratio_imp1l_vs_exp4l"] == pytest.approx(
            med["imp-1l256d"] / med["exp-4l256d"], abs=1e-3)
        assert row["time_ratio_imp1l_nosolve_vs_exp4l"] == pytest.approx(
            med["imp0-1l256d"] / med["exp-4l256d"], abs=1e-3)
        assert len(row["round_ratios"]) == 3 and row["solver_nfe"]["imp0-1l256d"] == [0, 0, 0]
    for png in ("rep_psnr.png", "reuse_nfe.png", "npg_T.png"):
        assert (tmp_path / png).exists()
    # a rerun resumes: nothing left to train
    assert main(args) == 0
