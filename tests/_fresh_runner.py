"""Run many "fresh interpreter" jobs for the price of one interpreter start-up (a test helper, not a test).

Usage: ``python tests/_fresh_runner.py jobs.json results.json``. The parent imports the heavy third-party
libraries in ``PRELOAD`` once (torch and its lazily imported submodules, numpy, scipy...: ~5 s of the
~6.5 s a fresh ``python`` + deqzoo model import costs on 2 CPU cores), then forks one child per job. Each
child therefore starts as a fresh interpreter would after ``import torch``: no deqzoo, transformers, timm or
diffusers module is loaded (deqzoo registers with transformers and timm through import hooks, so their
import order stays exactly the user's), its own ``sys.modules``/``sys.path``/``sys.argv``/working directory,
its stdout and stderr (file descriptors 1 and 2, so C-level output and grandchildren are captured too) in
files, its own atexit handlers run at its end (not the parent's), and nothing it does can leak into the
next job. Jobs (JSON list), each a dict with:

* ``name``: reported back as the key of its result;
* ``timeout`` (optional, seconds): the child is killed by SIGALRM past it (returncode -14);
* ``cwd``: the job's working directory (made if missing; ``sys.path[0]`` for ``blocks`` jobs);
* either ``script`` + ``argv``: run the file as ``__main__`` like ``python script *argv`` (``sys.path[0]``
  is the script's folder, ``sys.argv[0]`` the script path), or ``blocks``: a list of source strings, each
  exec'd in its own fresh ``__main__`` namespace, stopping at the first failure (named in stderr).

results.json maps each name to ``{"returncode", "stdout", "stderr", "seconds"}`` (the exit status a ``python``
process would have had: 0, the ``sys.exit`` code, or 1 on an uncaught exception; -N when killed by signal N).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback

# Third-party libraries only, none of which deqzoo hooks or patches (never deqzoo, transformers, timm,
# diffusers or anything importing them): preloading them changes no import order a test is about.
PRELOAD = (
    "numpy", "torch", "torch._dynamo", "torch.distributed.tensor", "torch.fx.experimental.symbolic_shapes",
    "torch.nn.functional", "torchvision", "scipy", "scipy.sparse", "scipy.linalg", "scipy.optimize",
    "scipy.special", "safetensors.torch", "huggingface_hub", "accelerate", "jinja2",
    "tqdm", "tqdm.auto", "PIL.Image", "sympy",
)


def _exit_code(err: SystemExit) -> int:
    """What `python` exits with for an uncaught SystemExit (a non-int code is printed to stderr)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def _run_job(job: dict) -> int:
    if "script" in job:
        script = os.path.abspath(job["script"])
        sys.argv = [script, *job.get("argv", [])]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        return 0
    sys.path[0] = os.getcwd()  # as for `python run.py` started in the job's folder
    for i, code in enumerate(job["blocks"]):
        try:
            exec(compile(code, f"<{job['name']} python block {i + 1}>", "exec"), {"__name__": "__main__"})
        except BaseException:
            print(f"BLOCK {i + 1} FAILED:\n{code}", file=sys.stderr)
            raise
    print(f"ran {len(job['blocks'])} blocks")
    return 0


def _child(job: dict, out_path: str, err_path: str) -> None:
    """In the forked child: redirect fds 1/2, run the job, leave with its exit status (never returns)."""
    code = 1
    atexit._clear()  # the parent's handlers are not this process's (one would delete the parent's files)
    try:
        for fd, path in ((1, out_path), (2, err_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        if job.get("timeout"):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(job["timeout"]))
        os.makedirs(job["cwd"], exist_ok=True)
        os.chdir(job["cwd"])
        try:
            code = _run_job(job)
        except SystemExit as err:
            code = _exit_code(err)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # the job's own handlers, as at an interpreter's exit
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(jobs_path: str, results_path: str) -> None:
    start = time.perf_counter()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library absent here: the job imports (and fails on) it itself
            pass
    print(f"preloaded in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    jobs = json.load(open(jobs_path, encoding="utf-8"))
    results = {}
    # a plain folder, removed below: a TemporaryDirectory's finalizer would be inherited by every child
    tmp = tempfile.mkdtemp(prefix="deqzoo-fresh-")
    try:
        for i, job in enumerate(jobs):
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _child(job, out_path, err_path)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            with open(out_path, encoding="utf-8", errors="replace") as out, \
                    open(err_path, encoding="utf-8", errors="replace") as err:
                results[job["name"]] = {"returncode": code, "stdout": out.read(), "stderr": err.read(),
                                        "seconds": round(time.perf_counter() - start, 3)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
