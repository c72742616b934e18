"""Every example script answers `--help` with its usage and exit status 0 (without training anything)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the example programs (a module without a main, such as a task's data and evaluation, is imported by them)
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.py")
                  if not p.name.startswith("_") and '__name__ == "__main__"' in p.read_text())


def test_examples_found():
    assert len(EXAMPLES) >= 9


def _name(script: Path) -> str:
    return str(script.relative_to(ROOT / "examples"))


@pytest.fixture(scope="module")
def help_runs(run_fresh, tmp_path_factory):
    """Every example's `python SCRIPT --help`, each in a fresh interpreter (a forked child of one that has
    imported torch: tests/_fresh_runner.py) and its own empty working directory."""
    base = tmp_path_factory.mktemp("examples-help")
    cwds = {_name(p): base / f"cwd{i}" for i, p in enumerate(EXAMPLES)}
    for cwd in cwds.values():
        cwd.mkdir()
    jobs = [{"name": _name(p), "script": str(p), "argv": ["--help"], "cwd": str(cwds[_name(p)]),
             "timeout": 240} for p in EXAMPLES]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return cwds, run_fresh(jobs, env, base / "runner", timeout=240 * len(jobs))


@pytest.mark.parametrize("script", EXAMPLES, ids=[_name(p) for p in EXAMPLES])
def test_help(script, help_runs):
    cwds, results = help_runs
    proc, cwd = results[_name(script)], cwds[_name(script)]
    assert proc["returncode"] == 0, proc["stderr"][-3000:]
    assert proc["stdout"].startswith("usage: " + script.name), proc["stdout"][:500]
    assert not list(cwd.iterdir()), "--help must not write files"


def test_train_mnist_state_round_trip(tmp_path):
    """The resumable state restores model, optimizer, schedule and both RNGs exactly."""
    import importlib.util
    import math

    import torch

    import deqzoo

    script = ROOT / "examples" / "mdeq" / "train_mnist.py"
    spec = importlib.util.spec_from_file_location("train_mnist", script)
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)

    def setup():
        torch.manual_seed(0)
        model = deqzoo.create_model("mdeq-tiny-mnist", deq={"f_max_iter": 3, "on_nonconvergence": "ignore"})
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / 10)))
        return model, opt, sched, torch.Generator().manual_seed(1)

    model, opt, sched, gen = setup()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        model(pixel_values=x, labels=y).loss.backward()
        opt.step()
        sched.step()
    torch.randn(3, generator=gen)
    tm._save_state(tmp_path, model, opt, sched, gen, epoch=4, log=[{"loss": 1.0}], seconds=12.5)
    expect_gen, expect_rng = torch.randn(2, generator=gen), torch.randn(2)

    fresh, opt2, sched2, gen2 = setup()
    first, log, spent = tm._load_state(tmp_path, fresh, opt2, sched2, gen2)
    assert (first, log, spent) == (5, [{"loss": 1.0}], 12.5)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert sched2.last_epoch == sched.last_epoch and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    sched.step()
    sched2.step()  # the schedule continues where it stopped
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] < 1e-3
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)
    assert torch.equal(torch.randn(2, generator=gen2), expect_gen) and torch.equal(torch.randn(2), expect_rng)
