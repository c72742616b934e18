"""Suite-wide settings: one thread, offline hub, private HF cache, headless matplotlib."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Before anything imports huggingface_hub/transformers (they read these at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="deqzoo-test-hf-"))
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

RUNNER = Path(__file__).resolve().parent / "_fresh_runner.py"


@pytest.fixture(scope="session")
def run_fresh():
    """Run jobs that each need a fresh interpreter through tests/_fresh_runner.py: one start-up and one
    torch import for all of them, one forked child per job (see that file). Returns
    ``run(jobs, env, workdir, timeout) -> {name: {"returncode", "stdout", "stderr"}}``."""

    def run(jobs: list[dict], env: dict[str, str], workdir: Path, timeout: float) -> dict[str, dict]:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "jobs.json").write_text(json.dumps(jobs), encoding="utf-8")
        proc = subprocess.run([sys.executable, str(RUNNER), "jobs.json", "results.json"], cwd=workdir,
                              env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"the fresh-interpreter runner failed:\n{proc.stderr[-4000:]}"
        results = json.loads((workdir / "results.json").read_text(encoding="utf-8"))
        assert set(results) == {job["name"] for job in jobs}, sorted(results)
        return results

    return run
