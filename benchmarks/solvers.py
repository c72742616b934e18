"""Solver benchmark: deqzoo's solvers side by side with TorchDEQ's on the same f and tolerance.

``deqzoo bench solvers [--quick] [--out PATH] [--repeats N] [--tol 1e-5] [--max-iter 200] [--device cpu]``

``--device cuda`` builds every problem on the GPU (ours then runs its torch path; times are wall-clock
seconds read after a device synchronisation); without CUDA it stops with a one-line error.

Problems (float32, CPU, one thread):
- ``tanh_contractive``: z ↦ tanh(W z + U x), d = 512, batch 64, W = 0.9 · (random orthogonal), so
  ||W||₂ = 0.9, U Gaussian / √d, x standard normal;
- ``tanh_noncontractive``: the same with ||W||₂ = 1.5 (plain fixed-point iteration does not converge);
- ``multires``: a three-tensor multi-resolution state (64·8·8, 32·4·4, 16·2·2 channels·pixels) coupled by
  convolutions, average pooling and nearest upsampling, as in MDEQ.

For each (problem, solver, library) it records NFE, the final residual (recomputed independently at the
returned state: max over samples of ||f(z) - z|| / ||f(z)||), the time of the solve, the time spent
inside f (f wrapped by a timer), the overhead share (1 - time in f / time), and ratios to TorchDEQ, with the
range over rounds of the share and the ratio. Times are CPU time of the (single) compute thread,
`time.thread_time`: on a shared machine wall time mostly measures the other processes. Runs are
interleaved (every library and solver once per round) and the median over rounds is reported, because the
machine is shared. TorchDEQ runs with its defaults (Anderson m=6, lam=1e-4; full-memory Broyden), ours with
deqzoo's defaults (Anderson m=6, relative lam=1e-5; full-memory Broyden), its one torch implementation per
solver; both stop on the per-sample maximum relative residual. A first, unrecorded round warms up both
libraries' first solves; the medians and ranges are over the rounds after it.
TorchDEQ receives the same flat f (TorchDEQ's own DEQ core flattens tuple states too).
Writes JSON (default ``bench_results/solvers.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deqzoo.core.solvers import get_solver
from deqzoo.core.state import StatePacker

SOLVERS = ("anderson", "broyden", "fixed_point")
TORCHDEQ_NAMES = {"anderson": "anderson", "broyden": "broyden", "fixed_point": "fixed_point_iter"}


# CPU time of this thread: with one torch thread all the work runs here, and unlike wall time it does not
# count the time the OS gives to other processes (the machine is shared, load is high and varies)
clock = time.thread_time


class TimedF:
    """f with a stopwatch: counts calls and the CPU seconds spent inside."""

    def __init__(self, f):
        self.f, self.seconds, self.calls = f, 0.0, 0

    def __call__(self, x):
        t = clock()
        out = self.f(x)
        self.seconds += clock() - t
        self.calls += 1
        return out

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def _tanh_problem(d: int, batch: int, norm: float, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    # every singular value equal to `norm`: with norm > 1 plain iteration diverges wherever tanh' ~ 1
    W = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * norm
    U = torch.randn(d, d, generator=g) / d**0.5
    x = torch.randn(batch, d, generator=g)
    inj = (x @ U.T).to(device)
    Wt = W.T.contiguous().to(device)

    def f(z):
        return torch.tanh(torch.addmm(inj, z, Wt))

    return f, torch.zeros(batch, d, device=device)


def _multires_problem(batch: int, scale: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    chans, sizes = (8 * scale, 16 * scale, 32 * scale), (8, 4, 2)
    shapes = [(batch, c, s, s) for c, s in zip(chans, sizes)]

    def conv_w(c):
        w = torch.randn(c, c, 3, 3, generator=g)
        return w * (0.5 / torch.linalg.matrix_norm(w.reshape(c, -1), 2))

    convs = [conv_w(c) for c in chans]
    up = [
        torch.randn(chans[i], chans[i + 1], 1, 1, generator=g) * 0.3 / chans[i + 1] ** 0.5 for i in range(2)
    ]
    down = [torch.randn(chans[i + 1], chans[i], 1, 1, generator=g) * 0.3 / chans[i] ** 0.5 for i in range(2)]
    inj = [torch.randn(s, generator=g).to(device) for s in shapes]
    convs, up, down = ([w.to(device) for w in ws] for ws in (convs, up, down))

    def f_tuple(zs):
        out = []
        for i, z in enumerate(zs):
            y = F.conv2d(z, convs[i], padding=1) + inj[i]
            if i > 0:
                y = y + F.conv2d(F.avg_pool2d(zs[i - 1], 2), down[i - 1])
            if i < 2:
                y = y + F.interpolate(F.conv2d(zs[i + 1], up[i]), scale_factor=2, mode="nearest")
            out.append(torch.tanh(y))
        return tuple(out)

    z0 = tuple(torch.zeros(s, device=device) for s in shapes)
    packer = StatePacker(z0)
    return packer.wrap(f_tuple), packer.flatten(z0)


def problems(quick: bool, device: str = "cpu") -> dict:
    if quick:
        return {
            "tanh_contractive": _tanh_problem(64, 8, 0.9, device=device),
            "tanh_noncontractive": _tanh_problem(64, 8, 1.5, device=device),
            "multires": _multires_problem(4, 1, device=device),
        }
    return {
        "tanh_contractive": _tanh_problem(512, 64, 0.9, device=device),
        "tanh_noncontractive": _tanh_problem(512, 64, 1.5, device=device),
        "multires": _multires_problem(32, 2, device=device),
    }


def check_device(device: str, prog: str = "deqzoo bench solvers") -> None:
    """A clear error for a device this machine does not have."""
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"{prog}: --device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{prog}: --device cuda, but CUDA is not available on this machine")


def _max_rel_residual(f, z: torch.Tensor) -> float:
    with torch.no_grad():
        fz = f(z)
        return float(((fz - z).norm(dim=1) / (fz.norm(dim=1) + 1e-12)).max())


def _run_ours(solver: str, f: TimedF, x0, tol, max_iter):
    with torch.no_grad():
        t = clock()
        z, stats = get_solver(solver)(f, x0, max_iter=max_iter, tol=tol, stop_mode="rel")
        return z, clock() - t


def _run_torchdeq(solver: str, f: TimedF, x0, tol, max_iter):
    from torchdeq.solver import get_solver as td_get_solver

    fn = td_get_solver(TORCHDEQ_NAMES[solver])
    with torch.no_grad():
        t = clock()
        z, _, _ = fn(f, x0, max_iter=max_iter, tol=tol, stop_mode="rel")
        return z, clock() - t


def run(
    quick: bool = False,
    repeats: int = 5,
    tol: float = 1e-5,
    max_iter: int = 200,
    solvers=SOLVERS,
    device: str = "cpu",
) -> dict:
    global clock
    check_device(device)
    torch.set_num_threads(1)
    if device == "cuda":  # kernels run asynchronously: wall time after a synchronisation

        def clock():
            torch.cuda.synchronize()
            return time.perf_counter()

    try:
        import torchdeq  # noqa: F401

        libs = {"deqzoo": _run_ours, "torchdeq": _run_torchdeq}
    except ImportError:
        libs = {"deqzoo": _run_ours}
    results = {}
    for pname, (f_raw, x0) in problems(quick, device).items():
        f = TimedF(f_raw)
        runs: dict[tuple[str, str], list[dict]] = {}
        for round_ in range(1 + repeats):  # round 0 warms up: kernels compiled or loaded, buffers pooled
            for solver in solvers:
                for lib, runner in libs.items():
                    f.reset()
                    z, seconds = runner(solver, f, x0.clone(), tol, max_iter)
                    if round_ > 0:
                        runs.setdefault((solver, lib), []).append(
                            {"time": seconds, "time_in_f": f.seconds, "nfe": f.calls, "z": z}
                        )
        table = {}
        for (solver, lib), rs in runs.items():
            med_time = statistics.median(r["time"] for r in rs)
            med_f = statistics.median(r["time_in_f"] for r in rs)
            shares = [1 - r["time_in_f"] / r["time"] for r in rs]
            residual = _max_rel_residual(f_raw, rs[-1]["z"])
            table.setdefault(solver, {})[lib] = {
                "nfe": rs[-1]["nfe"],
                "final_rel_residual": residual,
                "converged": residual < tol,
                "time_s": med_time,
                "time_in_f_s": med_f,
                "overhead_share": statistics.median(shares),
                # the spread over rounds: how much the machine's load moved the median
                "overhead_share_range": [min(shares), max(shares)],
                "time_per_nfe_ms": 1e3 * med_time / rs[-1]["nfe"],
            }
        for solver, by_lib in table.items():
            if "torchdeq" in by_lib:
                ours, ref = by_lib["deqzoo"], by_lib["torchdeq"]
                # paired per-round ratios, then the median: robust to load changes between rounds
                ratios = [
                    a["time"] / b["time"]
                    for a, b in zip(runs[(solver, "deqzoo")], runs[(solver, "torchdeq")])
                ]
                ours["time_ratio_to_torchdeq"] = statistics.median(ratios)
                ours["time_ratio_range"] = [min(ratios), max(ratios)]
                ours["nfe_ratio_to_torchdeq"] = ours["nfe"] / ref["nfe"]
        results[pname] = table
    return {
        "tol": tol,
        "max_iter": max_iter,
        "repeats": repeats,
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device,
        "problems": results,
    }


def format_table(res: dict) -> str:
    lines = [
        f"tol={res['tol']} (rel, per-sample max)  max_iter={res['max_iter']}  repeats={res['repeats']}",
        f"{'problem':22s} {'solver':11s} {'lib':9s} {'nfe':>4s} {'residual':>9s} {'conv':>5s} {'time ms':>8s}"
        f" {'in f ms':>8s} {'overhead':>8s} {'t/TDEQ':>7s}",
    ]
    for pname, table in res["problems"].items():
        for solver, by_lib in table.items():
            for lib, r in by_lib.items():
                ratio = r.get("time_ratio_to_torchdeq")
                lines.append(
                    f"{pname:22s} {solver:11s} {lib:9s} {r['nfe']:4d} {r['final_rel_residual']:9.2e} "
                    f"{str(r['converged']):>5s} {1e3 * r['time_s']:8.1f} {1e3 * r['time_in_f_s']:8.1f} "
                    f"{100 * r['overhead_share']:7.1f}% {'' if ratio is None else f'{ratio:7.2f}'}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deqzoo bench solvers", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (CI)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="rounds after a warm-up round (default 5, quick 2)"
    )
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--max-iter", type=int, default=200)
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--out", default="bench_results/solvers.json")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    res = run(
        quick=args.quick,
        repeats=repeats,
        tol=args.tol,
        max_iter=args.max_iter,
        solvers=tuple(s for s in args.solvers.split(",") if s),
        device=args.device,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(format_table(res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
