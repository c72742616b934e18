"""`deqzoo bench implicit2` end to end on a tiny grid: JSON with ratios vs explicit 4L, reuse NFE, PNGs."""

import json

from deqzoo.bench.implicit2 import main


def test_bench_writes_json_and_pngs(tmp_path):
    only = "rep-gabor-imp-1l256d,rep-gabor-exp-4l256d,reuse-gabor-noreuse"
    rc = main(["--size", "8", "--steps", "4", "--filters", "gabor", "--groups", "rep,reuse", "--only", only,
               "--jobs", "2", "--out", str(tmp_path)])
    assert rc == 0
    s = json.loads((tmp_path / "implicit2.json").read_text())
    rows = {r["name"]: r for r in s["rep"]}
    assert rows["rep-gabor-exp-4l256d"]["time_ratio_vs_exp4l"] == 1.0
    imp = rows["rep-gabor-imp-1l256d"]
    assert imp["params"] < rows["rep-gabor-exp-4l256d"]["params"]
    assert imp["memory_ratio_vs_exp4l"] < 1  # one layer's activations instead of four
    assert s["reuse"]["without"] >= s["reuse"]["with"]
    assert (tmp_path / "rep_psnr.png").exists() and (tmp_path / "reuse_nfe.png").exists()
    # a rerun resumes: nothing left to train
    assert main(["--size", "8", "--steps", "4", "--filters", "gabor", "--groups", "rep,reuse", "--only", only,
                 "--out", str(tmp_path)]) == 0
