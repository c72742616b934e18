"""The background kernel compile (issue 35, item 4): one compile per cache folder at a time (a lock there),
and no compile child outlives the process that started it unless it is finishing the shared cache."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deqzoo.core import _kernels

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")
ROOT = Path(__file__).parents[2]

# a process that starts the background compile, reports its compile child's pid, and exits abruptly
PARENT = """
import os, sys, time, psutil
from deqzoo.core import _kernels
assert not _kernels.warm_up()  # background: a child process compiles
for _ in range(200):
    kids = psutil.Process().children()
    if kids:
        break
    time.sleep(0.05)
print(kids[0].pid, flush=True)
time.sleep(1.0)
os._exit(0)  # no cleanup: as a crash or a short script would end
"""

# a process that starts the background compile and waits until the kernels are ready here
WAITER = """
import logging, time
logging.basicConfig(level=logging.INFO)
from deqzoo.core import _kernels
_kernels.warm_up()
for _ in range(6000):
    if _kernels.ready():
        break
    time.sleep(0.1)
print("ready", _kernels.ready(), flush=True)
"""


def _env(cache: Path) -> dict:
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.fresh_compile
def test_waiting_compile_child_exits_with_its_parent(tmp_path):
    """Another process holds the cache folder's lock (it is compiling): the new child waits, compiles
    nothing, and is gone soon after its parent's exit (before, it was re-parented to init and went on
    compiling into the same cache)."""
    cache = tmp_path / "numba"
    cache.mkdir()
    fd = os.open(cache / "deqzoo-kernels.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a compiling process would
    child = None
    try:
        run = subprocess.run([sys.executable, "-c", PARENT], env=_env(cache), capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        child = int(run.stdout.split()[0])
        # the child runs at the lowest priority: on a busy machine importing numba alone can take a while
        deadline = time.monotonic() + 120
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), psutil.Process(child).cmdline()
        assert not list(cache.glob("deqzoo-kernels-*.ready"))  # it compiled nothing
        assert not list(cache.rglob("*.nbi"))  # numba's cache index: nothing written
    finally:
        if child is not None and not _gone(child):
            psutil.Process(child).kill()  # the one process this test started, by its id
        os.close(fd)


@pytest.mark.fresh_compile
def test_two_processes_compile_once_between_them(tmp_path):
    """Two processes that start together on a cold cache: one child compiles, the other waits for the lock
    and loads what the first wrote; both end with the kernels ready."""
    cache = tmp_path / "numba"
    procs = [subprocess.Popen([sys.executable, "-c", WAITER], env=_env(cache), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "ready True" in out, err[-2000:]
    logs = " ".join(err for _, err in outs)
    assert logs.count("kernel cache compiled by a child process") == 1, logs[-3000:]
    assert logs.count("kernel cache loaded by a child process") == 1, logs[-3000:]
    assert len(list(cache.glob("deqzoo-kernels-*.ready"))) == 1


def test_torch_path_loads_the_compiled_host_kernels():
    """A solve that never takes the fused path (a GPU state; here a bfloat16 one) still asks for the
    kernels, so its per-step bookkeeping and Anderson's mixing systems run compiled once the cache is warm,
    not as Python loops for the whole process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the suite's own cache
    warm = "from deqzoo.core import _kernels; assert _kernels.warm_up(block=True)"
    subprocess.run([sys.executable, "-c", warm], env=env, check=True, timeout=600)
    probe = """
import torch
from deqzoo.core import _kernels, solve
assert not _kernels.usable(torch.zeros(2, 3, dtype=torch.bfloat16))
A = 0.5 * torch.eye(3, dtype=torch.bfloat16)
z, stats = solve(lambda z: z @ A + 1, torch.zeros(2, 3, dtype=torch.bfloat16), solver="anderson",
                 max_iter=30, tol=1e-2)
print(*(_kernels.host(k) is k for k in (_kernels.track, _kernels.mixing_weights)))
"""
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
