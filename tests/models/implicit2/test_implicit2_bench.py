"""`deqzoo bench implicit2` end to end on a tiny grid: JSON with ratios vs explicit 4L, reuse NFE, every T
at the same step count, PNGs (one bench call: each setting is its own process)."""

import json

import pytest

from deqzoo.bench.implicit2 import main


def test_bench_writes_json_and_pngs(tmp_path):
    only = "rep-gabor-imp-1l256d,rep-gabor-exp-4l256d,reuse-gabor-noreuse,T-gabor-T0,T-gabor-Tinf,time-gabor"
    args = ["--size", "8", "--steps", "5", "--t-steps", "3", "--time-rounds", "2", "--time-after", "4",
            "--filters", "gabor", "--groups", "rep,reuse,T,time", "--only", only, "--out", str(tmp_path)]
    assert main([*args, "--jobs", "2"]) == 0
    s = json.loads((tmp_path / "implicit2.json").read_text())
    rows = {r["name"]: r for r in s["rep"]}
    assert rows["rep-gabor-exp-4l256d"]["time_ratio_vs_exp4l"] == 1.0
    imp = rows["rep-gabor-imp-1l256d"]
    assert imp["params"] < rows["rep-gabor-exp-4l256d"]["params"]
    assert imp["memory_ratio_vs_exp4l"] < 1  # one layer's activations instead of four
    assert s["reuse"]["without"] >= s["reuse"]["with"]
    # T = 0 / inf run --t-steps steps; the T = 1 row is the representation run's evaluation at that step
    assert set(s["T"]) == {"0", "1", "inf"}
    assert {row["steps"] for row in s["T"].values()} == {3}
    rec = json.loads((tmp_path / "runs" / "rep-gabor-imp-1l256d.json").read_text())
    assert [st for st, _ in rec["eval"]] == [3, 5]
    assert s["T"]["1"]["final_psnr"] == round(rec["eval"][0][1], 2)
    # the paper's per-pixel frequencies: 256 (MFN) and 128 (SIREN) at 512², scaled with the grid
    assert rec["input_scale"] == 256.0 * 8 / 512
    # interleaved timing: both networks stepped alternately, the ratio is of their medians
    t = s["time"]["gabor"]
    assert len(t["round_ratios"]) == 2 and len(t["imp_nfe"]) == 2
    trec = json.loads((tmp_path / "runs" / "time-gabor.json").read_text())
    assert trec["warmup_implicit"] == 4 and trec["warmup"] == 2  # --time-after: the implicit net trains first
    med = {k: sorted(v)[0] / 2 + sorted(v)[1] / 2 for k, v in trec["step_times"].items()}  # median of 2
    assert t["time_ratio_imp1l_vs_exp4l"] == pytest.approx(med["imp-1l256d"] / med["exp-4l256d"], abs=1e-3)
    for png in ("rep_psnr.png", "reuse_nfe.png", "npg_T.png"):
        assert (tmp_path / png).exists()
    # a rerun resumes: nothing left to train
    assert main(args) == 0
