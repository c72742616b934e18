"""`deqzoo bench torchdeq-models`: the TorchDEQ adapter solves the same problem as deqzoo's DEQ module,
and the returned point's residual is measured independently of either library's statistics."""

from __future__ import annotations

import pytest
import torch

from benchmarks import torchdeq_models as bench
from deqzoo.core import DEQ, DEQConfig

pytest.importorskip("torchdeq")


def _problem():
    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(6, 6, generator=g, dtype=torch.float64) / 6**0.5
    x = torch.randn(3, 6, generator=g, dtype=torch.float64)
    return (lambda z: (torch.tanh(z[0] @ w + x), 0.5 * z[1] + z[0][:, :2])), (
        torch.zeros(3, 6, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64))  # fmt: skip


@pytest.mark.parametrize("which", ["deqzoo", "torchdeq"])
def test_both_modules_reach_the_fixed_point_and_the_residual_is_recomputed(which):
    f, z0 = _problem()
    cfg = DEQConfig(f_solver="anderson", f_max_iter=60, f_tol=1e-10)
    rec = bench._Recorder(DEQ(cfg) if which == "deqzoo" else bench._TorchDEQ(cfg, 1e-10)).eval()
    with torch.no_grad():
        z, _ = rec(f, z0)
    assert rec.nfe > 0 and rec.f_seconds > 0
    fz = f(tuple(z))
    want = torch.cat([(a - b) for a, b in zip(fz, z)], 1).norm(dim=1) / torch.cat(fz, 1).norm(dim=1)
    assert bench._residual(rec) == pytest.approx(float(want.mean()), rel=1e-6, abs=1e-15)
    assert bench._residual(rec) < 1e-8


def test_table_lists_every_module():
    r = {"case": "x", "ratio": {"deqzoo": 0.5, "deqzoo+final": 0.6},
         "seconds_median": {"deqzoo": 1.0, "deqzoo+final": 1.2, "torchdeq": 2.0},
         "returned_rel_residual": {"deqzoo": 1e-4, "deqzoo+final": 1e-4, "torchdeq": 1e-4},
         "tol": {"deqzoo": 1e-3, "deqzoo+final": 2e-3, "torchdeq": 5e-3},
         "f_calls_median": {"deqzoo": 9, "deqzoo+final": 9, "torchdeq": 8},
         "f_share_median": {"deqzoo": 0.8, "deqzoo+final": 0.8, "torchdeq": 0.7}}  # fmt: skip
    lines = bench.format_table([r]).splitlines()
    assert len(lines) == 4 and lines[1].split()[1:4] == ["deqzoo", "1.0000", "0.50"]


def test_device_and_batch_options_refuse_clearly(tmp_path):
    """--device cuda stops with one line naming this program where CUDA is absent; --batch beyond the held-out
    data is refused before any timing."""
    out = str(tmp_path / "x.json")
    if not torch.cuda.is_available():  # the GPU run itself is benchmarks/gpu.sh's, on a lent machine
        with pytest.raises(SystemExit, match="deqzoo bench torchdeq-models: --device cuda, but CUDA"):
            bench.main(["--quick", "--device", "cuda", "--out", out])
    with pytest.raises(SystemExit, match="--batch 100000: the MNIST test split has"):
        bench.main(["--quick", "--cases", "mdeq-infer", "--batch", "100000", "--out", out])


@pytest.mark.parametrize("which", ["deqzoo", "torchdeq"])
def test_training_step_jacobian_term_is_the_frobenius_norm_on_both_sides(which):
    """In training, both DEQ modules hand the model the Jacobian term its card trains with (mdeq-train):
    the Hutchinson estimate of ||J_f(z*)||_F² / dim, against the dense Jacobian at the returned point (tuple
    state, float64, 4000 probe vectors: the estimator's spread is ~2% here)."""
    from deqzoo.core.state import StatePacker

    f, z0 = _problem()
    cfg = DEQConfig(f_solver="anderson", f_max_iter=60, f_tol=1e-10, jac_reg_samples=4000)
    torch.manual_seed(0)
    rec = bench._Recorder(DEQ(cfg) if which == "deqzoo" else bench._TorchDEQ(cfg, 1e-10)).train()
    z, stats = rec(f, z0)
    packer = StatePacker(tuple(t.detach() for t in z))
    flat = packer.flatten(tuple(t.detach() for t in z))
    jac = torch.autograd.functional.jacobian(lambda v: packer.flatten(f(packer.unflatten(v))), flat)
    exact = float((jac**2).sum()) / flat.numel()
    assert stats.jac_loss is not None and stats.jac_loss.requires_grad  # it trains: a graph to the parameters
    assert float(stats.jac_loss.detach()) == pytest.approx(exact, rel=0.06)
    cfg_eval = DEQConfig(f_solver="anderson", f_max_iter=60, f_tol=1e-10, jac_reg_samples=1)
    rec = bench._Recorder(DEQ(cfg_eval) if which == "deqzoo" else bench._TorchDEQ(cfg_eval, 1e-10)).eval()
    with torch.no_grad():
        assert rec(f, z0)[1].jac_loss is None  # inference computes no Jacobian term


def test_floor_is_the_fewer_f_calls_at_deqzoo_cost_plus_the_model_without_its_solve(tmp_path):
    """The no-solve module calls f zero times and hands back the initial state; the reported floor is
    recomputed here from the run's own medians (mdeq-infer, a quick run)."""
    import json
    import statistics

    f, z0 = _problem()
    rec = bench._Recorder(bench._NoSolve())
    z, stats = rec(f, z0)
    assert rec.calls == 0 and z is z0 and stats.nfe == 0
    out = tmp_path / "q.json"
    bench.main(["--quick", "--cases", "mdeq-infer", "--rounds", "2", "--out", str(out)])
    r = json.loads(out.read_text())["results"][0]
    med = r["seconds_median"]
    calls, residual = r["f_calls_median"], r["returned_rel_residual"]
    capped = calls["deqzoo"] > calls["torchdeq"]  # deqzoo capped at TorchDEQ's calls, timed alongside
    assert set(med) == {"deqzoo", "deqzoo+final", "deqzoo+stored", "deqzoo@worst", "torchdeq"} | (
        {"deqzoo@calls"} if capped else set())
    # the two rows matched on the worst sample: their last scanned tolerance is the one timed, and it met
    # TorchDEQ's worst returned residual when it was scanned
    worst = r["returned_rel_residual_max"]
    for key, scan in (("deqzoo+stored", r["deqzoo_stored_tol_scan_max_residual"]),
                      ("deqzoo@worst", r["deqzoo_worst_tol_scan_max_residual"])):
        assert r["tol"][key] == scan[-1][0] and scan[-1][1] <= max(worst["torchdeq"], min(s[1] for s in scan))
        assert len(r["nfe_per_sample"][key]) == 8 and max(r["nfe_per_sample"][key]) <= r["f_max_iter"]
    assert len(r["seconds"]["no-solve"]) == 2
    if capped:  # it stops where TorchDEQ stops, so its best point is no better than the full solve's
        assert calls["deqzoo@calls"] == calls["torchdeq"]
        assert residual["deqzoo@calls"] >= residual["deqzoo"]
    assert r["model_without_solve_seconds_median"] == statistics.median(r["seconds"]["no-solve"])
    per_call = r["f_share_median"]["deqzoo"] * med["deqzoo"] / calls["deqzoo"]
    rest = r["model_without_solve_seconds_median"]
    want = (min(calls["torchdeq"], calls["deqzoo"]) * per_call + rest) / med["torchdeq"]
    assert r["floor"] == pytest.approx(want, rel=1e-12)
    assert 0 < r["model_without_solve_seconds_median"] < med["deqzoo"]


def test_torchdeq_per_sample_stop_is_the_call_count_of_its_solve_alone():
    """The adapter's per-sample count (the first call at which a sample meets the tolerance, read from
    TorchDEQ's trace) equals the calls TorchDEQ makes solving that sample alone (a batch of one stops
    then)."""
    a = torch.tensor([0.2, 0.6, 0.9], dtype=torch.float64)[:, None]
    c = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = DEQConfig(f_solver="anderson", f_max_iter=60, f_tol=1e-3)  # TorchDEQ's Anderson: both cases' solver

    def run(rows):
        calls = [0]

        def f(z):
            calls[0] += 1
            return torch.tanh(a[rows] * z + c[rows])

        with torch.no_grad():
            _, stats = bench._TorchDEQ(cfg, 1e-3).eval()(f, torch.zeros(len(rows), 5, dtype=torch.float64))
        return stats.nfe_per_sample.tolist(), calls[0]

    per_sample, _ = run([0, 1, 2])
    alone = [run([i])[1] for i in range(3)]
    assert per_sample == alone and len(set(alone)) == 3
    assert bench._compaction_bound(per_sample) == pytest.approx(sum(alone) / (3 * max(alone)))
