"""MDEQ TINY inference, deqzoo against TorchDEQ's deq-zoo MDEQ: images/s and mean NFE, side by side.

Both models hold the same weights (the deq-zoo model's state dict converted by
``conversion/mdeq_torchdeq.py``) and run the same forward solver with the same settings (solver, max
iterations, tolerance, stop mode; Anderson with m=6, λ=1e-4 on both sides), in eval mode under
``torch.no_grad`` on the same random 32x32 batches, timed batch by batch in alternating order (a shared
machine's load drifts). NFE is counted the same way on both sides, by a forward hook on f_θ
(``mdeq.fullstage`` / ``full_stage``), so it includes every evaluation a solver makes; each side's own
statistic (deqzoo ``stats.nfe``, TorchDEQ ``info["nstep"]``) is reported next to it. Ratios are
deqzoo / TorchDEQ.

TorchDEQ's deq-zoo is research code, not a package: point ``--torchdeq-zoo`` at a checkout of
locuslab/torchdeq (its root, ``deq-zoo``, ``deq-zoo/mdeq`` or ``deq-zoo/mdeq/mdeq_cifar``); the ``torchdeq``
package itself must be importable (``pip install torchdeq==0.1.0``, the ``bench`` extra).

    deqzoo bench mdeq --torchdeq-zoo /tmp/torchdeq           # 3 solvers, batch 32 x 5 -> mdeq_bench.json
    deqzoo bench mdeq --torchdeq-zoo /tmp/torchdeq --quick   # anderson, batch 4 x 2
    deqzoo bench mdeq --ours-only --quick                     # deqzoo side alone (no TorchDEQ checkout)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

__all__ = ["find_zoo", "main", "measure"]

_TORCHDEQ_SOLVER = {"fixed_point": "fixed_point_iter", "anderson": "anderson", "broyden": "broyden"}
_OUR_KWARGS = {"fixed_point": {}, "anderson": {"m": 6, "lam": 1e-4}, "broyden": {}}   # TorchDEQ's defaults
_FIXTURE = Path("conversion") / "fixtures" / "mdeq" / "torchdeq_mdeq_tiny.pth.tar"


def _repo_root() -> Path:
    from benchmarks import REPO_ROOT

    return REPO_ROOT


def find_zoo(path: str | Path | None) -> tuple[Path | None, str]:
    """(deq-zoo ``mdeq_cifar`` directory, "") or (None, the reason it was not found)."""
    if not path:
        return None, "no --torchdeq-zoo PATH given"
    root = Path(path).expanduser()
    if not root.exists():
        return None, f"--torchdeq-zoo {root}: no such directory"
    cands = (root, root / "mdeq_cifar", root / "mdeq" / "mdeq_cifar",
             root / "deq-zoo" / "mdeq" / "mdeq_cifar")
    for cand in cands:
        if (cand / "mdeq" / "models" / "mdeq.py").is_file() and (cand / "configs" / "small.yaml").is_file():
            return cand, ""
    return None, (f"--torchdeq-zoo {root}: no deq-zoo MDEQ found (looked for "
                  "mdeq_cifar/mdeq/models/mdeq.py and mdeq_cifar/configs/small.yaml under it; "
                  "clone locuslab/torchdeq and point at its root)")


def _load_file_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _torchdeq_model(zoo: Path, solver: str, f_max_iter: int, f_tol: float, stop_mode: str):
    """deq-zoo's MDEQ built from configs/small.yaml (the CIFAR TINY config) with TorchDEQ's DEQ settings."""
    import yaml

    try:
        from torchdeq.utils import add_deq_args
    except ImportError as err:
        raise RuntimeError("the torchdeq package is not importable; pip install torchdeq==0.1.0") from err
    if "termcolor" not in sys.modules:   # imported (unused) by deq-zoo's model file
        try:
            import termcolor  # noqa: F401
        except ImportError:
            sys.modules["termcolor"] = types.SimpleNamespace(colored=lambda s, *a, **k: s)
    module = _load_file_module("deqzoo_bench_torchdeq_mdeq", zoo / "mdeq" / "models" / "mdeq.py")
    cfg = yaml.safe_load((zoo / "configs" / "small.yaml").read_text())
    parser = argparse.ArgumentParser()
    add_deq_args(parser)
    args = parser.parse_args(["--norm_type", "weight_norm", "--f_solver", _TORCHDEQ_SOLVER[solver],
                              "--f_max_iter", str(f_max_iter), "--f_tol", str(f_tol),
                              "--f_stop_mode", stop_mode])
    return module.get_cls_net(cfg, args)


def _count_calls(module) -> list[int]:
    calls = [0]

    def hook(*_):
        calls[0] += 1

    module.register_forward_pre_hook(hook)
    return calls


class _Side:
    """One implementation under test: a callable on a batch, its f-call counter, its statistics."""

    def __init__(self, name: str, run, f_module):
        self.name, self.run, self.calls = name, run, _count_calls(f_module)
        self.seconds, self.outputs, self.stats = 0.0, [], []

    def reset(self) -> None:
        self.calls[0], self.seconds = 0, 0.0
        self.outputs.clear()
        self.stats.clear()


def _interleaved(sides: list[_Side], batches: list) -> None:
    """Warm each side up, then time every batch on each side in alternating order (shared machines drift)."""
    import torch

    with torch.no_grad():
        for side in sides:
            side.run(batches[0])   # warm-up (allocations, first-call overheads), not counted
            side.reset()
        for i, x in enumerate(batches):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                t0 = time.perf_counter()
                side.outputs.append(side.run(x))
                side.seconds += time.perf_counter() - t0


def measure(zoo: Path | None, *, solver: str = "anderson", f_max_iter: int = 30, f_tol: float = 1e-3,
            stop_mode: str = "rel", batch_size: int = 32, batches: int = 5, weights: str = "fixture",
            seed: int = 0) -> dict[str, Any]:
    """One solver setting: both models on the same batches; returns the side-by-side row."""
    import torch

    from conversion import converter_module

    conv = converter_module("mdeq_torchdeq")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch_size, 3, 32, 32, generator=gen) for _ in range(batches)]
    deq = {"f_solver": solver, "f_max_iter": f_max_iter, "f_tol": f_tol, "f_stop_mode": stop_mode,
           "f_solver_kwargs": _OUR_KWARGS[solver]}
    row: dict[str, Any] = {"solver": solver, "f_max_iter": f_max_iter, "f_tol": f_tol,
                           "f_stop_mode": stop_mode, "batch_size": batch_size, "batches": batches,
                           "weights": weights}
    if weights == "fixture":
        sd = conv._L.load_checkpoint(_repo_root() / _FIXTURE)
    theirs = None
    if zoo is not None:
        theirs = _torchdeq_model(zoo, solver, f_max_iter, f_tol, stop_mode).eval()
        if weights == "fixture":
            theirs.load_state_dict(sd)
        sd = theirs.state_dict()
    elif weights != "fixture":
        raise RuntimeError("--weights init needs the deq-zoo model (--torchdeq-zoo) to draw them")
    ours, _ = conv.convert_state_dict(sd, {"arch": "mdeq-cifar-tiny"}, "<bench>")
    ours.set_deq(**deq)
    ours.eval()

    def run_ours(x):
        out = ours(x)
        our_side.stats.append(out.deq_stats)
        return out.logits

    our_side = _Side("deqzoo", run_ours, ours.mdeq.fullstage)
    sides = [our_side]
    if theirs is not None:
        orig_deq = theirs.deq.forward

        def deq_with_info(*args, **kwargs):
            z, info = orig_deq(*args, **kwargs)
            their_side.stats.append(info)
            return z, info

        theirs.deq.forward = deq_with_info
        their_side = _Side("torchdeq", theirs, theirs.full_stage)
        sides.append(their_side)
    _interleaved(sides, xs)

    n_images = batch_size * batches
    st = our_side.stats
    row["deqzoo"] = {"images_per_s": round(n_images / our_side.seconds, 2),
                     "seconds": round(our_side.seconds, 4),
                     "mean_nfe": round(our_side.calls[0] / batches, 3),
                     "mean_nfe_stats": round(sum(s.nfe for s in st) / batches, 3),
                     "mean_rel_residual": _mean([s.rel_residual for s in st]),
                     "converged_fraction": _mean([s.converged for s in st])}
    if theirs is None:
        row["torchdeq"] = None
        return row
    infos = their_side.stats
    row["torchdeq"] = {"images_per_s": round(n_images / their_side.seconds, 2),
                       "seconds": round(their_side.seconds, 4),
                       "mean_nfe": round(their_side.calls[0] / batches, 3),
                       "mean_nstep_info": round(_mean([i["nstep"] for i in infos]), 3),
                       "mean_rel_residual": _mean([i["rel_lowest"] for i in infos])}
    row["ratio_images_per_s"] = round(row["deqzoo"]["images_per_s"] / row["torchdeq"]["images_per_s"], 3)
    row["ratio_mean_nfe"] = round(row["deqzoo"]["mean_nfe"] / max(row["torchdeq"]["mean_nfe"], 1e-9), 3)
    row["max_abs_logit_diff"] = float(max((a - b).abs().max()
                                          for a, b in zip(our_side.outputs, their_side.outputs)))
    return row


def _mean(tensors) -> float:
    import torch

    return float(torch.cat([t.detach().float().reshape(-1) for t in tensors]).mean())


def _table(rows: list[dict]) -> str:
    head = ("| solver | deqzoo img/s | TorchDEQ img/s | ratio | deqzoo NFE | TorchDEQ NFE | NFE ratio "
            "| max logit diff |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["torchdeq"] or {}
        lines.append(f"| {r['solver']} | {r['deqzoo']['images_per_s']} | {t.get('images_per_s', '-')} | "
                     f"{r.get('ratio_images_per_s', '-')} | {r['deqzoo']['mean_nfe']} | "
                     f"{t.get('mean_nfe', '-')} | {r.get('ratio_mean_nfe', '-')} | "
                     f"{r.get('max_abs_logit_diff', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench mdeq", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torchdeq-zoo", metavar="PATH",
                   help="checkout of locuslab/torchdeq (or its deq-zoo folder)")
    p.add_argument("--ours-only", action="store_true",
                   help="measure deqzoo alone when no deq-zoo is available")
    p.add_argument("--quick", action="store_true", help="toy run: anderson only, batch 4 x 2")
    p.add_argument("--solvers", nargs="+", choices=sorted(_TORCHDEQ_SOLVER), default=None)
    p.add_argument("--f-max-iter", type=int, default=30)
    p.add_argument("--f-tol", type=float, default=1e-3)
    p.add_argument("--f-stop-mode", choices=("abs", "rel"), default="rel")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--weights", choices=("fixture", "init"), default="fixture",
                   help="fixture: the contractive TINY weights of conversion/fixtures/mdeq (solves "
                        "converge); init: deq-zoo's own random init")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="mdeq_bench.json")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    zoo, reason = find_zoo(args.torchdeq_zoo)
    if zoo is None:
        print(f"TorchDEQ deq-zoo MDEQ not available: {reason}", file=sys.stderr)
        if not args.ours_only:
            print("nothing compared; pass --torchdeq-zoo PATH, or --ours-only to measure deqzoo alone",
                  file=sys.stderr)
            return 2
    solvers = args.solvers or (["anderson"] if args.quick else ["fixed_point", "anderson", "broyden"])
    batch_size = args.batch_size or (4 if args.quick else 32)
    batches = args.batches or (2 if args.quick else 5)
    rows = []
    for solver in solvers:
        rows.append(measure(zoo, solver=solver, f_max_iter=args.f_max_iter, f_tol=args.f_tol,
                            stop_mode=args.f_stop_mode, batch_size=batch_size, batches=batches,
                            weights=args.weights, seed=args.seed))
        print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "mdeq-tiny inference (CIFAR TINY config, 32x32 inputs)", "threads": args.threads,
              "torch": torch.__version__, "torchdeq_zoo": str(zoo) if zoo else None,
              "torchdeq_zoo_missing_reason": reason or None, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(_table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
