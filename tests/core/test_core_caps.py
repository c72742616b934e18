"""Caps on every iteration budget and history size (deqzoo.core.config): refused when a config is made or
loaded, with the key named, before anything runs; GMRES's basis bytes checked before a solve allocates."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import deqzoo
from deqzoo.core import DEQ, DEQConfig
from deqzoo.core import caps as caps_module

CARDS = Path(__file__).resolve().parents[2] / "model_cards"


def _copy_with(tmp_path: Path, card: str, **deq) -> Path:
    folder = tmp_path / card
    shutil.copytree(CARDS / card, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["deq"].update(deq)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("card,deq,match", [
    ("mdeq-tiny-mnist", {"f_solver": "gmres", "f_max_iter": 1e12}, r"f_max_iter .*1000000000000\.0"),
    ("mdeq-tiny-mnist", {"f_solver": "gmres", "f_max_iter": 10**12}, r"f_max_iter .*<= 10_000"),
    ("mdeq-tiny-mnist-reversible", {"f_max_iter": 10**9}, r"f_max_iter .*<= 1_000 with b_mode='reversible'"),
], ids=["gmres-1e12", "gmres-10**12", "reversible-10**9"])
def test_huge_budgets_in_a_checkpoint_are_refused_at_load_within_a_second(tmp_path, card, deq, match):
    deqzoo.from_pretrained(CARDS / card)  # imports the family: the timed load below measures the check
    folder = _copy_with(tmp_path, card, **deq)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as err:
        deqzoo.from_pretrained(folder)
    elapsed = time.perf_counter() - start
    assert "config.json" in str(err.value) and "'deq'" in str(err.value)
    assert elapsed < 1.0, f"refusing took {elapsed:.2f} s"


@pytest.mark.parametrize("changes,key", [
    ({"f_max_iter": 10_001}, "f_max_iter"),
    ({"b_max_iter": 10**9}, "b_max_iter"),
    ({"b_mode": "reversible", "f_max_iter": 1_001}, "f_max_iter"),
    ({"f_max_iter_min": 10_001}, "f_max_iter_min"),
    ({"f_solver_kwargs": {"m": 65}}, r"f_solver_kwargs\['m'\]"),
    ({"b_solver_kwargs": {"m": 10**6}}, r"b_solver_kwargs\['m'\]"),
    ({"f_solver": "broyden", "f_solver_kwargs": {"m": 1_025}}, r"f_solver_kwargs\['m'\]"),
    ({"f_solver": "hyperanderson", "f_solver_kwargs": {"m": 65}}, r"f_solver_kwargs\['m'\]"),
    ({"f_solver_kwargs": {"keep_steps": [10**9]}}, r"keep_steps'\] entry"),
    ({"f_solver_kwargs": {"keep_steps": list(range(1, 2000))}}, r"keep_steps'\]"),
    ({"b_mode": "phantom", "b_mode_kwargs": {"k": 1_001}}, r"b_mode_kwargs\['k'\]"),
    ({"b_mode": "shine", "f_solver": "broyden", "b_mode_kwargs": {"refine": 10**7}}, "refine"),
    ({"b_mode": "unrolled", "b_mode_kwargs": {"checkpoint": 10**7}}, "checkpoint"),
    ({"b_mode": "reversible", "b_mode_kwargs": {"segment": 10**7}}, "segment"),
    ({"b_mode": "reversible", "b_mode_kwargs": {"rebuild_tol": 0}}, "rebuild_tol"),
    ({"correction_k": 1_001}, "correction_k"),
    ({"n_states": 1_025}, "n_states"),
    ({"state_indices": [10**8]}, "state_indices entry"),
    ({"state_indices": list(range(1, 1_100))}, "state_indices"),
    ({"jac_reg_samples": 10_001}, "jac_reg_samples"),
])
def test_each_cap_names_its_key(changes, key):
    with pytest.raises(ValueError, match=key):
        DEQConfig(**changes)
    with pytest.raises(ValueError, match=key):  # loading a serialised config checks the same
        DEQConfig.from_dict(changes)


def test_the_caps_themselves_are_accepted():
    DEQConfig(f_max_iter=10_000, b_max_iter=10_000, f_solver_kwargs={"m": 64}, b_solver_kwargs={"m": 64},
              correction_k=1_000, n_states=1_024, jac_reg_samples=10_000)
    DEQConfig(b_mode="reversible", f_max_iter=1_000, b_mode_kwargs={"segment": 0, "rebuild_tol": 1e-3})
    DEQConfig(f_solver="broyden", f_solver_kwargs={"m": 1_024})
    DEQConfig(f_solver="broyden", f_solver_kwargs={"m": None})  # full memory (capped inside broyden)


def test_gmres_memory_is_checked_before_the_forward_solve(monkeypatch):
    monkeypatch.setattr(caps_module, "MAX_GMRES_BYTES", 1_000_000)
    calls = []

    def f(z):
        calls.append(1)
        return 0.5 * z

    z0 = torch.zeros(10, 1_000)  # 40,000 bytes per state: 2 x 12 states fit
    DEQ(f_solver="gmres", f_max_iter=12)(f, z0)
    calls.clear()
    with torch.no_grad(), pytest.raises(ValueError, match=r"f_max_iter=500 .* 40,000,000 bytes .*1,000,000"):
        DEQ(f_solver="gmres", f_max_iter=500)(f, z0)  # 500 vectors and a stacked copy
    assert not calls  # refused before f ran or anything was allocated


def test_gmres_memory_is_checked_before_the_adjoint_solve(monkeypatch):
    monkeypatch.setattr(caps_module, "MAX_GMRES_BYTES", 1_000_000)
    w = torch.nn.Parameter(0.1 * torch.eye(1_000))
    deq = DEQ(f_solver="anderson", f_max_iter=20, b_solver="gmres", b_max_iter=100)
    z, _ = deq(lambda z: torch.tanh(z @ w + 1), torch.zeros(10, 1_000))
    with pytest.raises(ValueError, match=r"b_max_iter=100 .* bytes"):
        z.sum().backward()
    assert w.grad is None


def test_deqconfig_is_strict_on_construction_and_assignment():
    """huggingface_hub's @strict types on every field, and the ranges and caps re-checked on assignment
    (a refused value is not kept)."""
    with pytest.raises(ValueError, match="DEQConfig.f_max_iter must be int, got '30'"):
        DEQConfig(f_max_iter="30")
    with pytest.raises(ValueError, match="DEQConfig.f_solver_kwargs must be dict"):
        DEQConfig(f_solver_kwargs=[("m", 5)])
    cfg = DEQConfig()
    with pytest.raises(ValueError, match=r"f_max_iter .*<= 10_000"):
        cfg.f_max_iter = 10**9
    with pytest.raises(ValueError, match="f_solver must be str"):
        cfg.f_solver = 3
    assert cfg == DEQConfig()
    cfg.f_max_iter = 50
    assert cfg == DEQConfig(f_max_iter=50)
    rev = DEQConfig(b_mode="reversible", f_max_iter=1_000)
    with pytest.raises(ValueError, match="with b_mode='reversible'"):
        rev.f_max_iter = 1_001
    assert rev.f_max_iter == 1_000
