"""tests/_fresh_runner.py, the helper that runs the examples' `--help` and the cards' snippets: each job
starts as a fresh interpreter would (no deqzoo/transformers/timm/diffusers loaded, nothing left by an earlier
job), and failures, exit codes and timeouts are reported as `python` itself would have them."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("import sys\nnames = ('deqzoo', 'transformers', 'timm', 'diffusers', 'leak')\n"
           "print(sorted(m for m in names if m in sys.modules))\n")


def test_jobs_are_isolated_and_report_like_python(run_fresh, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import sys, helper\nprint(sys.argv[1:], helper.VALUE, sys.path[0] == helper.HERE)\n")
    (tmp_path / "helper.py").write_text("import os\nVALUE = 7\nHERE = os.path.dirname(__file__)\n")
    jobs = [
        {"name": "leaks", "cwd": str(tmp_path / "a"),
         "blocks": ["import sys, types, deqzoo, transformers\n"
                    "sys.modules['leak'] = types.ModuleType('leak')\nprint(deqzoo.__file__)\n",
                    "import os\nopen('made.txt', 'w').write(os.getcwd())\n"]},
        {"name": "fresh", "cwd": str(tmp_path / "b"), "blocks": [MODULES, "x = 1\n", "print(x)\n"]},
        {"name": "script", "cwd": str(tmp_path / "c"), "script": str(script), "argv": ["--flag", "v"]},
        {"name": "exit3", "cwd": str(tmp_path / "d"),
         "blocks": ["import atexit, sys\natexit.register(print, 'at exit')\nsys.exit(3)\n"]},
        {"name": "raises", "cwd": str(tmp_path / "e"), "blocks": ["print('before')\n", "1 / 0\n"]},
        {"name": "hangs", "cwd": str(tmp_path / "f"), "blocks": ["import time\ntime.sleep(60)\n"],
         "timeout": 1},
        {"name": "after", "cwd": str(tmp_path / "g"), "blocks": [MODULES]},
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = run_fresh(jobs, env, tmp_path / "runner", timeout=300)
    expected = f"{ROOT / 'deqzoo' / '__init__.py'}\nran 2 blocks\n"  # the checkout's deqzoo (PYTHONPATH)
    assert r["leaks"]["returncode"] == 0 and r["leaks"]["stdout"] == expected, r["leaks"]
    assert (tmp_path / "a" / "made.txt").read_text() == str(tmp_path / "a")  # the job's own folder
    # the second block of "fresh" fails: each block has its own namespace, as in the original card runner
    assert r["fresh"]["returncode"] == 1 and r["fresh"]["stdout"] == "[]\n", r["fresh"]
    assert "BLOCK 3 FAILED" in r["fresh"]["stderr"] and "NameError: name 'x'" in r["fresh"]["stderr"]
    assert r["script"] == {**r["script"], "returncode": 0, "stdout": "['--flag', 'v'] 7 True\n"}, r["script"]
    assert r["exit3"]["returncode"] == 3 and r["exit3"]["stdout"] == "at exit\n", r["exit3"]
    assert r["raises"]["returncode"] == 1 and r["raises"]["stdout"] == "before\n"
    assert "ZeroDivisionError" in r["raises"]["stderr"] and "BLOCK 2 FAILED" in r["raises"]["stderr"]
    assert r["hangs"]["returncode"] == -14 and r["hangs"]["seconds"] < 30  # SIGALRM
    # nothing the first job imported is loaded in a later one
    assert r["after"]["stdout"] == "[]\nran 1 blocks\n", r["after"]
