"""Fine-tuning under the transformers Trainer: a 2-process CPU DDP run (gloo, torchrun) keeps replicas
identical; the Lipschitz projection callback keeps the constraints during Trainer training."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import deqzoo
from deqzoo.models.mdeq import conv_operator_norm
from deqzoo.models.mdeq.lipschitz import MeanOnlyGroupNorm

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "mdeq" / "finetune_trainer.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_finetune_keeps_parameters_identical(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(SCRIPT),
        "--model",
        "mdeq-tiny-mnist",
        "--out",
        str(tmp_path),
        "--max-steps",
        "3",
        "--batch-size",
        "8",
        "--limit",
        "64",
        "--f-max-iter",
        "4",
        "--dump-params",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no DDP performance warning: the example tells DDP that every parameter is used (it is: with
    # find_unused_parameters=False an unused one would stop the run with a reduction error)
    assert "find_unused_parameters" not in proc.stderr + proc.stdout
    rank0 = load_file(tmp_path / "params_rank0.safetensors")
    rank1 = load_file(tmp_path / "params_rank1.safetensors")
    assert rank0.keys() == rank1.keys() and len(rank0) > 50
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    # the replicas did train: parameters moved away from the (seeded, identical) initialization
    torch.manual_seed(0)
    init = deqzoo.create_model("mdeq-tiny-mnist").state_dict()
    moved = [k for k in rank0 if rank0[k].is_floating_point() and not torch.equal(rank0[k], init[k])]
    assert "classifier.weight" in moved and any("fullstage" in k for k in moved)
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_trainer_with_lipschitz_callback_keeps_the_constraints(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import finetune_trainer
    finally:
        sys.path.remove(str(SCRIPT.parent))
    # a large learning rate pushes weights out of the constraint set every step; the callback projects back
    finetune_trainer.main(
        [
            "--model",
            "lipschitz-mdeq-tiny-mnist",
            "--out",
            str(tmp_path),
            "--max-steps",
            "2",
            "--batch-size",
            "8",
            "--limit",
            "32",
            "--lr",
            "0.1",
        ]
    )
    model = deqzoo.from_pretrained(tmp_path / "final")
    cfg = model.config
    for m in model.modules():
        if getattr(m, "_deqzoo_lipschitz_conv", False):
            assert conv_operator_norm(m.weight, cfg.spectral_fft_size) <= cfg.conv_norm * (1 + 1e-6)
        if isinstance(m, MeanOnlyGroupNorm):
            assert m.weight.abs().max() <= cfg.gamma_bound
