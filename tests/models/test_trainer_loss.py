"""Every head's loss is right under transformers' Trainer (issue 57 item 5): our losses are batch means, so
each model declares ``accepts_loss_kwargs = False``; without it Trainer multiplied the DEQ language model's
loss by the number of processes and stopped dividing it by the gradient accumulation (2 processes logged
8.532 against the model's own 4.240; this test logged 7.38 against 3.69, 14.77 with accumulation 2, and
2x, 4x for the IGNN graph head). A 2-process CPU run (gloo, torchrun) at learning rate 0: the loss
Trainer logs equals the model's own mean loss over the same samples, with and without accumulation."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_trainer_logs_the_models_own_loss(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(_free_port()), str(HERE / "_trainer_loss_worker.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"losses-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r.pop("world_size") == 2 for r in ranks)
    assert sorted(ranks[0]) == ["ignn-ga1", "ignn-ga2", "lm-ga1", "lm-ga2"]
    for name in ranks[0]:
        accumulation = int(name[-1])
        runs = [r[name] for r in ranks]
        assert all(run["accepts_loss_kwargs"] is False for run in runs), name
        logged = runs[0]["logged"]
        steps = 16 // (4 * accumulation)
        assert len(logged) == steps and all(len(run["seen"]) >= steps * accumulation for run in runs), name
        seen = sorted(i for run in runs for batch in run["seen"][:steps * accumulation] for i in batch)
        assert seen == list(range(16)), name  # one epoch, each sample once
        for step in range(steps):
            # the model's own loss: the mean over both processes' micro-batches of this optimizer step
            own = [loss for run in runs for loss in run["own"][step * accumulation:(step + 1) * accumulation]]
            assert logged[step] == pytest.approx(sum(own) / len(own), abs=1e-5), (name, step, logged, runs)
        mean_own = sum(sum(run["own"][:steps * accumulation]) for run in runs) / (2 * steps * accumulation)
        assert runs[0]["training_loss"] == pytest.approx(mean_own, rel=1e-5), name
