"""Load-time benchmark: deqzoo's CPU time to load one embedded checkpoint in a fresh process.

``deqzoo bench load-time [--runs 9] [--checkpoint deqzoo/mdeq-tiny-mnist] [--checkout PATH ...] [--out PATH]``

Each run is a fresh interpreter (import state is what is measured) that first imports ``torch``,
``transformers`` and ``from transformers import PreTrainedModel, PretrainedConfig`` (what loading any
transformers model imports), then measures ``time.process_time()`` across ``import deqzoo`` and
``deqzoo.from_pretrained(CHECKPOINT)``, and lists the modules that load imported from other families or from
torchvision, timm, diffusers and matplotlib. CPU time, not wall time: on a shared machine wall time mostly
measures the other processes. One OpenMP/MKL thread, HF_HUB_OFFLINE=1. Bytecode is written and reused
(PYTHONDONTWRITEBYTECODE is dropped, as for an installed package) and a first, unrecorded run per checkout
writes it: compiling deqzoo's sources would otherwise be most of what is measured.

``--checkout`` (repeatable) names deqzoo clones to compare (default: this one); their runs are interleaved
(A, B, A, B, ...) so that both see the same machine load. Prints and writes JSON (default
``bench_results/load_time.json``): per checkout, every run's CPU seconds and their median, min and max, plus
the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import REPO_ROOT

CHECKPOINT = "deqzoo/mdeq-tiny-mnist"
# packages a load of an MDEQ checkpoint must not import (other families, heavy optional libraries)
FOREIGN = ("deqzoo.models.deq_transformer", "deqzoo.models.ignn", "deqzoo.models.implicit2",
           "deqzoo.models.deq_flow", "deqzoo.pipelines", "deqzoo.integrations.timm")
FOREIGN_TOP = ("torchvision", "timm", "diffusers", "matplotlib")

CHILD = """\
import json, sys, time
import torch, transformers
from transformers import PreTrainedModel, PretrainedConfig  # what any model load imports
before = set(sys.modules)
t0 = time.process_time()
import deqzoo
model = deqzoo.from_pretrained({checkpoint!r})
cpu = time.process_time() - t0
new = set(sys.modules) - before
bad = sorted(m for m in new if m.startswith({foreign!r}) or m.split('.')[0] in {foreign_top!r})
print(json.dumps({{"cpu": cpu, "bad": bad, "cls": type(model).__name__}}))
"""


def measure_once(checkout: Path = REPO_ROOT, checkpoint: str = CHECKPOINT, timeout: float = 300) -> dict:
    """One fresh process loading `checkpoint` with the deqzoo of `checkout`: its CPU seconds (``cpu``), the
    foreign modules it imported (``bad``) and the loaded class name (``cls``)."""
    code = CHILD.format(checkpoint=checkpoint, foreign=FOREIGN, foreign_top=FOREIGN_TOP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({"PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=checkout)
    if proc.returncode != 0:
        raise RuntimeError(f"{checkout}: loading {checkpoint} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(cpus: list[float]) -> dict:
    return {"median": statistics.median(cpus), "min": min(cpus), "max": max(cpus), "runs": len(cpus)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench load-time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=9, help="fresh processes per checkout (default 9)")
    p.add_argument("--checkpoint", default=CHECKPOINT, help=f"what to load (default {CHECKPOINT})")
    p.add_argument("--checkout", type=Path, action="append",
                   help="a deqzoo clone to measure (repeatable; default this clone)")
    p.add_argument("--out", type=Path, default=Path("bench_results/load_time.json"))
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    checkouts = [c.resolve() for c in (args.checkout or [REPO_ROOT])]
    load_before = os.getloadavg()
    for checkout in checkouts:  # unrecorded: writes the bytecode an installed package has
        measure_once(checkout, args.checkpoint)
    runs: dict[str, list[dict]] = {str(c): [] for c in checkouts}
    for i in range(args.runs):
        for checkout in checkouts:  # interleaved: every checkout sees the same load
            result = measure_once(checkout, args.checkpoint)
            runs[str(checkout)].append(result)
            print(f"run {i + 1}/{args.runs} {checkout}: {result['cpu']:.3f} s"
                  + (f", foreign modules {result['bad']}" if result["bad"] else ""), flush=True)
    report = {
        "benchmark": "load-time", "checkpoint": args.checkpoint,
        "measure": "process_time of `import deqzoo; deqzoo.from_pretrained(...)` after importing torch, "
                   "transformers, PreTrainedModel and PretrainedConfig; fresh process per run, 1 thread",
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "checkouts": {c: {**summary([r["cpu"] for r in rs]), "cpu": [r["cpu"] for r in rs],
                          "foreign_modules": sorted({m for r in rs for m in r["bad"]})}
                      for c, rs in runs.items()},
    }
    for checkout, row in report["checkouts"].items():
        print(f"{checkout}: median {row['median']:.3f} s, min {row['min']:.3f} s, max {row['max']:.3f} s "
              f"over {row['runs']} runs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
