"""IGNN inference scaling: time and peak memory against the number of edges (sparse products only).

For each size, a fresh subprocess builds a random directed graph (uniform random edges, average degree 10),
then times (1) building the normalized operator and λ_pf, and (2) a forward solve (fastest of 3) with a fixed
budget of fixed-point steps (so every size does the same number of sparse products). Peak memory is the
growth of the process's peak resident set (``ru_maxrss``) from just before the graph is built, so the
interpreter and torch themselves are not counted. Ratios are per edge, relative to the smallest size: values
near 1 mean linear growth.

    deqzoo bench ignn                       # 10k, 100k, 1M edges -> ignn_bench.json
    deqzoo bench ignn --quick               # 1k, 10k edges (seconds)
    python -m benchmarks.ignn --edges 10000 100000 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import child_env

__all__ = ["main", "measure"]


def measure(
    edges: int,
    *,
    degree: int = 10,
    features: int = 16,
    hidden: int = 16,
    steps: int = 30,
    seed: int = 0,
    repeats: int = 3,
) -> dict:
    """One size, in this process: graph build + λ_pf time, forward time (fastest of `repeats`), peak RSS
    growth (MB)."""
    import torch

    from deqzoo.models.ignn import IGNNConfig, IGNNModel

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    deq = {"f_solver": "fixed_point", "f_max_iter": steps, "f_tol": 1e-30, "f_stop_mode": "abs"}
    model = IGNNModel(IGNNConfig(in_features=features, hidden_size=hidden, deq=deq)).eval()
    with torch.no_grad():  # warm-up: first-call allocations (kernels, thread pools) are not the graph's
        model(torch.randn(8, features), torch.tensor([[0, 1], [1, 2]]))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nodes = max(2, edges // degree)
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen)
    x = torch.randn(nodes, features, generator=gen)
    t0 = time.perf_counter()
    graph = model.prepare_graph(x, edge_index)
    rho = graph.spectral_radius(model.config.pf_tol, model.config.pf_max_iter)
    t1 = time.perf_counter()
    forward = []
    for _ in range(repeats):  # the machine is shared: the fastest of a few runs is the least disturbed
        t = time.perf_counter()
        with torch.no_grad():
            out = model(x, graph=graph)
        forward.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "edges": edges,
        "nodes": nodes,
        "nfe": out.deq_stats.nfe,
        "spectral_radius": round(rho, 6),
        "seconds_graph": round(t1 - t0, 4),
        "seconds_forward": round(min(forward), 4),
        "peak_mem_mb": round((peak - base) / 1024.0, 1),
    }


def _child(edges: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.ignn", "--_child", str(edges)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=child_env())
    if res.returncode != 0:
        raise RuntimeError(f"bench child for {edges} edges failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _with_ratios(rows: list[dict]) -> list[dict]:
    ref = rows[0]
    for r in rows:
        scale = r["edges"] / ref["edges"]
        r["forward_time_per_edge_ratio"] = round(
            r["seconds_forward"] / max(ref["seconds_forward"], 1e-9) / scale, 3
        )
        r["graph_time_per_edge_ratio"] = round(
            r["seconds_graph"] / max(ref["seconds_graph"], 1e-9) / scale, 3
        )
        r["mem_per_edge_ratio"] = round(r["peak_mem_mb"] / max(ref["peak_mem_mb"], 1e-3) / scale, 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="deqzoo bench ignn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--edges", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--quick", action="store_true", help="toy sizes (1k, 10k edges)")
    p.add_argument("--out", type=Path, default=Path("ignn_bench.json"))
    p.add_argument("--_child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child is not None:
        print(json.dumps(measure(args._child)))
        return 0
    sizes = [1_000, 10_000] if args.quick else sorted(args.edges)
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover

        def tqdm(it, **_):
            return it

    for edges in tqdm(sizes, desc="ignn bench"):
        rows.append(_child(edges))
    rows = _with_ratios(rows)
    result = {
        "benchmark": "ignn-inference-scaling",
        "degree": 10,
        "hidden": 16,
        "fixed_point_steps": 30,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print("| edges | nodes | graph+λ_pf s | forward s | peak MB | fwd time/edge ratio | mem/edge ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['edges']} | {r['nodes']} | {r['seconds_graph']} | {r['seconds_forward']} | "
            f"{r['peak_mem_mb']} | "
            f"{r['forward_time_per_edge_ratio']} | {r['mem_per_edge_ratio']} |"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
