"""Training memory and time per step of the MNIST MDEQ under b_mode="reversible" against IFT and unrolled.

    python examples/mdeq/measure_reversible.py --ift model_cards/mdeq-tiny-mnist \\
        --reversible model_cards/mdeq-tiny-mnist-reversible --out model_cards/mdeq-tiny-mnist-reversible

Memory: peak bytes the CPU allocator holds during one training step (forward + backward, batch 64 of the
training split), from torch profiler's memory events, for reversible at 2..16 coupled steps, unrolled
autograd through the same numbers of f calls, and the IFT checkpoint's own settings. Time per step: the two
checkpoints' training steps interleaved in one process (same load), median of --repeats. Writes
measurements.json into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import deqzoo

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.mdeq import mnist


def peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def train_step(model, pixels, labels):
    def run():
        out = model(pixel_values=pixels, labels=labels)
        out.loss.backward()
        return out.deq_stats.nfe
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ift", type=Path, required=True)
    p.add_argument("--reversible", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x, y = mnist.load_split("train")
    ift = deqzoo.from_pretrained(args.ift).train()
    rev = deqzoo.from_pretrained(args.reversible).train()
    pixels, labels = mnist.to_pixel_values(x[:64], ift), torch.from_numpy(y[:64])
    result: dict = {"batch": 64, "repeats": args.repeats, "memory_mib": {}, "seconds_per_step": {}}
    for steps in (2, 4, 8, 16):
        rev.set_deq(f_max_iter=steps)
        result["memory_mib"][f"reversible, {steps} steps ({2 * steps + 1} f calls)"] = round(
            peak_bytes(train_step(rev, pixels, labels)) / 2**20, 2)
        rev.set_deq(b_mode="unrolled", f_solver="fixed_point", f_max_iter=2 * steps, f_tol=1e-30,
                    b_mode_kwargs={})
        result["memory_mib"][f"unrolled autograd, {2 * steps} f calls"] = round(
            peak_bytes(train_step(rev, pixels, labels)) / 2**20, 2)
        rev.set_deq(b_mode="reversible", f_tol=1e-3, b_mode_kwargs={"beta": 0.8})
    result["memory_mib"]["ift checkpoint (anderson max 20, adjoint max 12, Jacobian reg.)"] = round(
        peak_bytes(train_step(ift, pixels, labels)) / 2**20, 2)
    rev = deqzoo.from_pretrained(args.reversible).train()
    times: dict[str, list[float]] = {"ift": [], "reversible": []}
    nfe: dict[str, list[int]] = {"ift": [], "reversible": []}
    for _ in range(args.repeats):
        for name, model in (("ift", ift), ("reversible", rev)):
            t = time.perf_counter()
            nfe[name].append(train_step(model, pixels, labels)())
            times[name].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    for name in times:
        result["seconds_per_step"][name] = round(statistics.median(times[name]), 3)
        result[f"train_nfe_{name}"] = statistics.mean(nfe[name])
    (args.out / "measurements.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
