"""`deqzoo bench halting` at toy scale: both problems run, compacted and uncompacted solves agree per sample
(same stopping steps, outputs within rounding), and the JSON and PNG are written."""

from __future__ import annotations

import json

from benchmarks import halting as bench


def test_toy_run(tmp_path):
    out = tmp_path / "halting.json"
    code = bench.main(["--batch-size", "10", "--dim", "16", "--rounds", "1", "--max-iter", "8",
                       "--out", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["problem"] for r in data["results"]] == ["mdeq", "synthetic"]
    for r in data["results"]:
        assert r["batch"] == 10 and r["same_stop_steps"] and r["max_rel_output_diff"] < 1e-6
        assert r["f_rows_evaluated"]["compacted"] == sum(r["stop_steps"])
        assert r["f_rows_evaluated"]["compacted"] <= r["f_rows_evaluated"]["uncompacted"]
    assert out.with_suffix(".png").stat().st_size > 1000
