"""Training a hypersolver (recorded problems, ground truth, the three losses); bench and CLI entry points."""

import json

import torch

import deqzoo
from deqzoo.core.solvers import anderson
from deqzoo.hypersolver import HyperSolver, load_hypersolver
from examples.hypersolver._problems import default_config, initial_flat
from examples.hypersolver.train import collect_problems, model_batches, train_hypersolver


def test_training_learns_on_recorded_problems():
    """A few dozen steps on recorded MNIST problems: the unrolled solve gets closer to the ground truth than
    at initialisation, for the initializer alone and after K steps, on held-out problems too."""
    torch.manual_seed(0)
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").eval()
    model.requires_grad_(False)
    train = collect_problems(model, model_batches(model, "mnist", "train", batch_size=8, n_batches=4),
                             gt_iter=40, progress=False)
    test = collect_problems(model, model_batches(model, "mnist", "test", batch_size=8, n_batches=2),
                            gt_iter=40, progress=False)
    assert all(float(p.stats.rel_residual.max()) < 1e-4 for p in train + test)  # ground truth is converged
    cfg = default_config(model, "deqzoo/mdeq-tiny-mnist", unroll_steps=4)

    def init_error(hs):
        with torch.no_grad():
            return sum(float((initial_flat(hs, p) - p.x_star).norm() / p.x_star.norm()) for p in test)

    before = init_error(HyperSolver(cfg))
    result = train_hypersolver(train, cfg, steps=80, lr=1e-2, progress=False)
    after = init_error(result.hypersolver)
    assert after < 0.75 * before  # the untrained initializer is near the model's zero start (error ~1)
    assert result.log[-1]["conv"] < result.log[0]["conv"]
    assert {"conv", "init", "alpha", "final_rel_err"} <= set(result.log[0])


def test_cli_trains_saves_and_loads(tmp_path):
    from deqzoo.cli import main

    out = tmp_path / "hs"
    rc = main(["train-hypersolver", "deqzoo/mdeq-tiny-mnist", "--out", str(out), "--steps", "3",
               "--batches", "2", "--batch-size", "4", "--gt-iter", "20", "--no-progress"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "hypersolver" and cfg["training"]["steps"] == 3
    assert cfg["training"]["seconds_total"] > 0 and "train-hypersolver" in cfg["training"]["command"]
    assert len(json.loads((out / "train_log.json").read_text())) == 3
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", hypersolver=out)
    assert model.hypersolver.num_parameters() == load_hypersolver(out).num_parameters()


def test_bench_writes_json_and_png(tmp_path):
    from benchmarks import hypersolver as bench

    out = tmp_path / "h.json"
    assert bench.main(["--models", "mdeq", "--limit", "100", "--budgets", "1", "2", "4", "8", "12",
                       "--out", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    r = data["results"][0]
    assert set(r["curves"]) == {"anderson-default", "shipped", "anderson", "broyden", "anderson+init",
                                "hyperanderson"}
    acc = r["acceptance"]
    for key in ("shipped_wall_ratio", "shipped_nfe_ratio", "shipped_run", "metric_worst_gap", "no_blowup",
                "parameter_share"):
        assert key in acc
    # the published hypersolver ships its initializer: the shipped run is h_φ + the model's own Anderson at
    # the model's tolerance, so every sample it returns is below that tolerance, like Anderson-default's
    assert r["use"] == "initializer" and acc["shipped_part"] == "anderson+init"
    assert r["curves"]["shipped"]["converged"] == 1.0
    assert acc["shipped_wall_ratio"] == acc.get("anderson+init_wall_ratio")
    assert acc["no_blowup"]["K"] == 6 and acc["parameter_share"] < 0.04
    assert out.with_suffix(".png").stat().st_size > 10_000
    # residual curves are the solvers' own: Anderson's best residual after 4 evaluations is what a solve
    # with max_iter=4 returns (mean over the 100 images)
    from examples.hypersolver._problems import record_problems

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").eval()
    model.set_deq(on_nonconvergence="ignore")
    runs, _ = bench._held_out(model, "mnist", 100)
    four = lambda p: anderson(p.g, p.x0, max_iter=4, tol=1e-30)  # noqa: E731
    with torch.no_grad(), record_problems(model, solve=four) as ps:
        runs[0]()
    mean4 = float(ps[0].stats.rel_residual.double().mean())
    assert abs(r["curves"]["anderson"]["mean_rel_residual"][3] - mean4) < 1e-3 * mean4
