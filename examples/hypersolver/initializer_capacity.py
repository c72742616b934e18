"""How far can a learned initializer alone take HyperDEQ's NFE bar? A capacity probe, by initializer size.

Issue #20 asks HyperAnderson to reach Anderson's default-budget residual in at most half of Anderson's NFE.
On `mdeq-tiny-mnist` almost all of the published hypersolver's saving comes from its initializer h_φ (the
card's `anderson+init` row), so this probe asks how accurate an initializer of a given size can be. Each
architecture is trained by plain regression on the frozen model's fixed points (relative error to z*, the
hypersolver's L_init; no unrolled solver, so the probe isolates what h_φ can represent), then Anderson runs
from its output on held-out inputs for a range of budgets. The target is measured in the same run: the mean
relative residual and mean NFE of Anderson at the model's default settings (from zero, early stopping); the
bar is half that NFE.

    PYTHONPATH=. python examples/hypersolver/initializer_capacity.py --out examples/hypersolver/results
    PYTHONPATH=. python examples/hypersolver/initializer_capacity.py --model pydoc --out /tmp/capacity

Writes ``initializer_capacity_<model>.json`` and a PNG (mean residual against NFE, one curve per size).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = {"mdeq": "deqzoo/mdeq-tiny-mnist", "pydoc": "deqzoo/deq-transformer-tiny-pydoc"}
BUDGETS = {"mdeq": (1, 2, 3, 4, 5, 6, 8, 10, 12), "pydoc": (1, 2, 4, 6, 8, 10, 12, 15, 20, 25, 30)}


class ImageInit(nn.Module):
    """Multi-resolution initializer: a conv trunk over the injection, pooled to each branch, then a conv.
    ``trunk=()`` with ``depthwise=True`` is the published hypersolver's architecture (depthwise 3x3 + ReLU,
    1x1 projections)."""

    def __init__(
        self, inj: int, shapes, trunk: tuple[int, ...], depthwise: bool = False, head_kernel: int = 1
    ):
        super().__init__()
        layers, width = [], inj
        if depthwise:
            layers.append(nn.Conv2d(inj, inj, 3, padding=1, groups=inj))
        for w in trunk:
            layers.append(nn.Conv2d(width, w, 3, padding=1))
            width = w
        self.trunk = nn.ModuleList(layers)
        self.shapes = [tuple(s) for s in shapes]
        pad = head_kernel // 2
        self.heads = nn.ModuleList(nn.Conv2d(width, s[1], head_kernel, padding=pad) for s in self.shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.trunk:
            x = F.relu(layer(x))
        outs = [head(F.adaptive_avg_pool2d(x, s[-2:])) for head, s in zip(self.heads, self.shapes)]
        return torch.cat([o.flatten(1) for o in outs], 1)


class SequenceInit(nn.Module):
    """Sequence initializer: causal Conv1d(k=3) + ReLU layers over the injection, then a linear map to d.
    One layer of 6 is the published hypersolver's architecture."""

    def __init__(self, inj: int, d: int, trunk: tuple[int, ...]):
        super().__init__()
        widths = (inj, *trunk)
        self.trunk = nn.ModuleList(nn.Conv1d(a, b, 3) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        for conv in self.trunk:
            h = F.relu(conv(F.pad(h, (2, 0))))  # left padding: no position sees a later token
        return self.head(h.transpose(1, 2)).flatten(1)


def architectures(model: str, inj: int, shapes) -> dict[str, Callable[[], nn.Module]]:
    if model == "mdeq":
        return {
            "published (dw3x3, 1x1)": lambda: ImageInit(inj, shapes, (), depthwise=True),
            "3x3 conv 16": lambda: ImageInit(inj, shapes, (16,), head_kernel=1),
            "3x3 convs 32-32": lambda: ImageInit(inj, shapes, (32, 32), head_kernel=3),
            "3x3 convs 64-64-64": lambda: ImageInit(inj, shapes, (64, 64, 64), head_kernel=3),
        }
    d = shapes[0][2]
    return {
        "published (conv 6)": lambda: SequenceInit(inj, d, (6,)),
        "convs 64-64": lambda: SequenceInit(inj, d, (64, 64)),
        "convs 256-256": lambda: SequenceInit(inj, d, (256, 256)),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-12)


def _nfe_to(curve: list[float], budgets: tuple[int, ...], target: float) -> float | None:
    """First budget where the mean residual reaches `target`, log-linear between measured budgets."""
    for (k0, r0), (k1, r1) in zip(zip(budgets, curve), list(zip(budgets, curve))[1:]):
        if r0 <= target:
            return float(k0)
        if r1 <= target:
            return k0 + (k1 - k0) * math.log(r0 / target) / math.log(r0 / r1)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mdeq")
    p.add_argument("--out", type=Path, default=Path("bench_output/initializer_capacity"))
    p.add_argument("--steps", type=int, default=1500, help="Adam steps per initializer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from train import collect_problems, model_batches  # examples/hypersolver/train.py

    import deqzoo
    from deqzoo.core.solvers import get_solver
    from deqzoo.hypersolver import load_hypersolver
    from examples.hypersolver._problems import initial_flat

    model_id = MODELS[args.model]
    model = deqzoo.from_pretrained(model_id).eval()
    cfg = model.config.deq_config
    if args.model == "mdeq":
        train = model_batches(model, "mnist", "train", batch_size=32, n_batches=48, seed=args.seed)
        test = model_batches(model, "mnist", "test", batch_size=50, n_batches=6)
    else:
        train = model_batches(model, "pydoc_lm", "train", batch_size=4, n_batches=48, seed=args.seed)
        test = model_batches(model, "pydoc_lm", "held_out", batch_size=1, n_batches=24)
    problems = {"train": collect_problems(model, train), "test": collect_problems(model, test)}
    shapes = problems["train"][0].packer.shapes
    inj = problems["train"][0].injection
    x_train = torch.cat([q.injection for q in problems["train"]])
    z_train = torch.cat([q.x_star for q in problems["train"]])
    anderson = get_solver("anderson")
    budgets = BUDGETS[args.model]

    @torch.no_grad()
    def from_start(start: Callable) -> dict:
        err, curve = [], torch.zeros(len(budgets))
        n = 0
        for q in problems["test"]:
            z0 = start(q)
            err.append(_rel(z0, q.x_star))
            for i, k in enumerate(budgets):
                _, st = anderson(q.g, z0, max_iter=k, tol=1e-12, stop_mode="rel")
                curve[i] += st.rel_residual.sum()
            n += len(z0)
        return {
            "rel_err_to_fixed_point": torch.cat(err).mean().item(),
            "mean_rel_residual": (curve / n).tolist(),
        }

    with torch.no_grad():  # the target: Anderson at the model's default settings, from the model's start
        nfe, res, n = 0.0, 0.0, 0
        for q in problems["test"]:
            _, st = anderson(q.g, q.x0, max_iter=cfg.f_max_iter, tol=cfg.f_tol, stop_mode=cfg.f_stop_mode)
            nfe, res, n = nfe + st.nfe * len(q.x0), res + st.rel_residual.sum().item(), n + len(q.x0)
    target = {
        "mean_nfe": nfe / n,
        "mean_rel_residual": res / n,
        "f_max_iter": cfg.f_max_iter,
        "f_tol": cfg.f_tol,
    }
    target["nfe_bar"] = 0.5 * target["mean_nfe"]
    report = {"model": model_id, "budgets": list(budgets), "target": target, "steps": args.steps, "rows": {}}
    report["rows"]["zero start (Anderson)"] = dict(from_start(lambda q: q.x0), parameters=0)
    hs = load_hypersolver(model_id.replace("deqzoo/", "deqzoo/hyperdeq-"))
    init_params = sum(t.numel() for m in (hs.init_conv, hs.init_proj) for t in m.parameters())
    report["rows"]["published hypersolver's h_φ"] = dict(
        from_start(lambda q: initial_flat(hs, q)), parameters=init_params
    )
    for name, build in architectures(
        args.model, inj.shape[1 if args.model == "mdeq" else -1], shapes
    ).items():
        torch.manual_seed(args.seed)
        net = build()
        opt = torch.optim.Adam(net.parameters(), 3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
        gen = torch.Generator().manual_seed(args.seed)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            idx = torch.randint(0, len(x_train), (64,), generator=gen)
            loss = _rel(net(x_train[idx]), z_train[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        row = from_start(lambda q, net=net: net(q.injection))
        row.update(
            parameters=sum(t.numel() for t in net.parameters()), train_seconds=time.perf_counter() - t0
        )
        report["rows"][name] = row
    model_params = sum(t.numel() for t in model.parameters())
    for row in report["rows"].values():
        row["parameter_share"] = row["parameters"] / model_params
        row["nfe_to_target"] = _nfe_to(row["mean_rel_residual"], budgets, target["mean_rel_residual"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"initializer_capacity_{args.model}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, path.with_suffix(".png"))
    print(
        f"target: mean residual {target['mean_rel_residual']:.3g} at mean NFE {target['mean_nfe']:.2f} "
        f"(bar: NFE <= {target['nfe_bar']:.2f})"
    )
    for name, row in report["rows"].items():
        reach = row["nfe_to_target"]
        print(
            f"{name:32s} params {row['parameters']:7d} ({100 * row['parameter_share']:6.2f}%)  "
            f"init error {row['rel_err_to_fixed_point']:.3f}  NFE to target "
            f"{'not reached' if reach is None else f'{reach:.2f}'}"
        )
    print(f"wrote {path}")
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in report["rows"].items():
        ax.semilogy(
            report["budgets"],
            row["mean_rel_residual"],
            "o-",
            label=f"{name} ({row['parameters']:,} params, {100 * row['parameter_share']:.1f}%)",
        )
    t = report["target"]
    ax.axhline(t["mean_rel_residual"], color="k", ls="--", lw=1, label="Anderson default: mean residual")
    ax.axvline(t["nfe_bar"], color="r", ls=":", lw=1, label="the bar: half its mean NFE")
    ax.set_xlabel("Anderson NFE from the start")
    ax.set_ylabel("mean relative residual (held-out)")
    ax.set_title(f"{report['model']}: initializer capacity", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
