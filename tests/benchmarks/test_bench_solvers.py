"""The solver benchmark at toy scale: it runs, writes the documented JSON, and our solvers converge."""

import json

import pytest
import torch

from benchmarks import solvers as bench


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


def test_bench_solvers_device_option(tmp_path):
    """--device cpu builds the problems on the CPU; --device cuda stops with one clear line where CUDA is
    absent (and would run the torch path on the GPU where it exists)."""
    for f, x0 in bench.problems(quick=True, device="cpu").values():
        assert x0.device.type == "cpu" and f(x0).shape == x0.shape
    if torch.cuda.is_available():  # pragma: no cover - no GPU in the CI
        pytest.skip("CUDA present: the error path does not apply")
    with pytest.raises(SystemExit, match="--device cuda, but CUDA is not available"):
        bench.main(["--quick", "--device", "cuda", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--device must be cpu or cuda"):
        bench.main(["--quick", "--device", "tpu", "--out", str(tmp_path / "x.json")])
