"""The solver benchmark at toy scale: it runs, writes the documented JSON, and our solvers converge."""

import json

import pytest

from deqzoo.bench import solvers as bench


def test_bench_solvers_quick(tmp_path, capsys):
    pytest.importorskip("torchdeq")
    out = tmp_path / "solvers.json"
    assert bench.main(["--quick", "--repeats", "1", "--solvers", "anderson,broyden", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["problems"]) == {"tanh_contractive", "tanh_noncontractive", "multires"}
    for pname, table in res["problems"].items():
        for solver in ("anderson", "broyden"):
            ours, ref = table[solver]["deqzoo"], table[solver]["torchdeq"]
            for key in (
                "nfe",
                "final_rel_residual",
                "time_s",
                "time_in_f_s",
                "overhead_share",
                "time_ratio_to_torchdeq",
                "nfe_ratio_to_torchdeq",
            ):
                assert key in ours, key
            lo, hi = ours["overhead_share_range"]
            assert lo <= ours["overhead_share"] <= hi, (pname, solver, ours)
            lo, hi = ours["time_ratio_range"]
            assert lo <= ours["time_ratio_to_torchdeq"] <= hi, (pname, solver, ours)
            # independently recomputed residual agrees with the claim of convergence
            assert ours["converged"] and ours["final_rel_residual"] < res["tol"], (pname, solver, ours)
            if ref["converged"]:
                assert ours["nfe"] <= ref["nfe"] + 1, (pname, solver, ours["nfe"], ref["nfe"])
    assert "tanh_contractive" in capsys.readouterr().out
