"""`deqzoo bench mdeq` at toy scale: the deqzoo side runs; a missing TorchDEQ checkout is named."""

from __future__ import annotations

import json

from benchmarks import mdeq as bench


def test_missing_torchdeq_zoo_is_reported(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = bench.main(["--torchdeq-zoo", str(tmp_path / "nowhere"), "--quick", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "TorchDEQ deq-zoo MDEQ not available" in err and "no such directory" in err
    assert not out.exists()


def test_find_zoo_rejects_a_folder_without_the_model(tmp_path):
    (tmp_path / "deq-zoo" / "mdeq").mkdir(parents=True)
    zoo, reason = bench.find_zoo(tmp_path)
    assert zoo is None and "mdeq_cifar/mdeq/models/mdeq.py" in reason


def test_ours_only_toy_run(tmp_path):
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--ours-only",
            "--quick",
            "--batch-size",
            "2",
            "--batches",
            "1",
            "--f-max-iter",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["torchdeq"] is None and result["torchdeq_zoo"] is None
    ours = row["deqzoo"]
    assert ours["images_per_s"] > 0
    # the hook count of f_θ calls agrees with the engine's own NFE statistic
    assert ours["mean_nfe"] == ours["mean_nfe_stats"] and 1 <= ours["mean_nfe"] <= 8
