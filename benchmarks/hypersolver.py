"""`deqzoo bench hypersolver`: HyperDEQ against classic solvers on held-out inputs, side by side in one run.

For each model (``--models``, with its hypersolver): the held-out forward passes of the model's task are
recorded once (each DEQ solve answered by Anderson at the model's default settings: the reference; the
DEQ-Transformer's memory of past equilibria comes from this pass). Every recorded problem is then solved by
each method at the largest budget with no early stopping, recording per f evaluation the wall time since the
solve began (the initializer included) and every sample's residual, and keeping each sample's best iterate at
every budget (the answer a solve with that budget returns). The task metric at each budget is the model's head
on those answers. Methods: ``anderson`` and ``broyden`` from the model's zero start, ``anderson+init``
from the learned initializer, ``hyperanderson`` (initializer + learned mixing), plus ``anderson-default``
(the model's own settings with early stopping: the reference point of the acceptance ratios).

Acceptance ratios in the JSON (``acceptance``): the NFE and wall time HyperAnderson needs to reach the mean
relative residual of Anderson at its default budget (log-linear interpolation between budgets), divided by
Anderson's; the task metric at equal wall time (HyperAnderson's curve interpolated at Anderson's times); and
the residual of the current iterate from K to 2K (and beyond) steps, K being the hypersolver's unroll length.

Example:
    >>> from benchmarks import hypersolver  # doctest: +SKIP
    >>> hypersolver.main(["--models", "mdeq", "--limit", "100"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

MODELS = {
    "mdeq": ("deqzoo/mdeq-tiny-mnist", "deqzoo/hyperdeq-mdeq-tiny-mnist"),
    "pydoc": ("deqzoo/deq-transformer-tiny-pydoc", "deqzoo/hyperdeq-deq-transformer-tiny-pydoc"),
}
METHODS = ("anderson-default", "anderson", "broyden", "anderson+init", "hyperanderson")


class _Timed:
    """f on flat states, recording per call the time since `start` and each sample's relative residual."""

    def __init__(self, g):
        self.g, self.times, self.res = g, [], []
        self.start = time.perf_counter()

    def __call__(self, x):
        fx = self.g(x)
        self.times.append(time.perf_counter() - self.start)
        r = torch.linalg.vector_norm(fx - x, dim=1) / (torch.linalg.vector_norm(fx, dim=1) + 1e-12)
        self.res.append(r.double())
        return fx


def _solve(method: str, p, hs, budget: int, deq_cfg, keep: list[int], extra: dict | None = None):
    from deqzoo.core.solvers import get_solver

    if method in (extra or {}):  # another hypersolver for the same model, e.g. the paper's form
        hs, method = extra[method], "hyperanderson"

    timed = _Timed(p.g)
    if method in ("anderson+init", "hyperanderson"):
        from deqzoo.hypersolver.attach import initial_flat

        x0 = initial_flat(hs, p)
    else:
        x0 = p.x0
    if method == "anderson-default":
        solver, kw = get_solver(deq_cfg.f_solver), dict(deq_cfg.f_solver_kwargs)
        budget, tol = deq_cfg.f_max_iter, deq_cfg.f_tol
    elif method == "hyperanderson":
        solver = get_solver("hyperanderson")
        kw = {
            "net": hs.bind(p.packer.shapes),
            "m": hs.config.m,
            "form": hs.config.form,
            "base": hs.config.alpha_base,
        }
        tol = 1e-30
    else:
        solver, kw, tol = get_solver(method.split("+")[0]), {}, 1e-30
    keep_steps = [k for k in keep if k <= budget] if method != "anderson-default" else []
    x, stats = solver(timed, x0, max_iter=budget, tol=tol, stop_mode="rel", keep_steps=keep_steps, **kw)
    wall = time.perf_counter() - timed.start
    res = torch.stack(timed.res, 1)  # (B, nfe): residual of the iterate f was called on
    times = np.array(timed.times)
    if method != "anderson-default" and res.shape[1] < budget:  # stopped early (non-finite): hold the last
        res = torch.cat((res, res[:, -1:].expand(-1, budget - res.shape[1])), 1)
        times = np.concatenate((times, np.full(budget - len(times), times[-1])))
    return x, stats, res, times, wall


def _forward_all(model, runs, answers: list[torch.Tensor]):
    """Run the recorded forward passes again, each DEQ solve answered by the next state in `answers`."""
    from deqzoo.hypersolver.attach import record_problems

    queue = list(answers)

    def take(p):
        x = queue.pop(0)
        from deqzoo.core import SolverStats

        zero = torch.zeros(x.shape[0])
        return x, SolverStats(
            nfe=0,
            abs_residual=zero,
            rel_residual=zero,
            trace=torch.zeros(0),
            converged=torch.ones(x.shape[0], dtype=torch.bool),
        )

    outs = []
    with torch.no_grad(), record_problems(model, solve=take):
        for run in runs:
            outs.append(run())
    return outs


def _metric(task: str, outs, labels) -> float:
    if task == "mnist":
        pred = torch.cat([o.logits.argmax(-1) for o in outs])
        return float((pred == labels).double().mean())
    nll, count = 0.0, 0
    for o, y in zip(outs, labels):
        nll += float(
            F.cross_entropy(o.logits.reshape(-1, o.logits.shape[-1]).float(), y.reshape(-1), reduction="sum")
        )
        count += y.numel()
    return math.exp(nll / count)


def _held_out(model, task: str, limit: int):
    """Forward calls over held-out inputs and their targets (labels / next tokens)."""
    if task == "mnist":
        from deqzoo.tasks import mnist

        x, y = mnist.load_split("test")
        order = np.argsort(np.arange(len(y)) % 100, kind="stable")[:limit]  # classes interleaved
        x, y = x[order], y[order]
        runs = []
        for s in range(0, len(y), 100):
            pixels = mnist.to_pixel_values(x[s : s + 100], model)
            runs.append(lambda pixels=pixels: model(pixel_values=pixels))
        return runs, torch.from_numpy(y)
    from deqzoo.tasks import pydoc_lm

    ids = pydoc_lm.token_stream(pydoc_lm.load_tokenizer(model), "held_out")
    seg = model.config.tgt_len
    n = min(limit, (ids.numel() - 1) // seg)
    state: dict = {"cache": None}

    def run(i):
        out = model(ids[None, i * seg : (i + 1) * seg], past_key_values=state["cache"])
        state["cache"] = out.past_key_values
        return out

    def first(i):
        if i == 0:
            state["cache"] = None
        return run(i)

    runs = [lambda i=i: first(i) for i in range(n)]
    return runs, [ids[i * seg + 1 : (i + 1) * seg + 1] for i in range(n)]


def _interp_log(xs, ys, target):
    """Smallest x (log-linear interpolation) where the decreasing series ys reaches target; None: never."""
    for i in range(len(ys)):
        if ys[i] <= target:
            if i == 0:
                return float(xs[0])
            y0, y1 = math.log(ys[i - 1]), math.log(max(ys[i], 1e-300))
            t = (y0 - math.log(target)) / max(y0 - y1, 1e-300)
            return float(xs[i - 1] + t * (xs[i] - xs[i - 1]))
    return None


def bench_model(
    key: str, *, limit: int, budgets: list[int], hypersolver: str | None = None, progress: bool = True,
    also: dict[str, str] | None = None,
) -> dict:
    from tqdm.auto import tqdm

    import deqzoo
    from deqzoo.core.solvers import get_solver
    from deqzoo.hub import resolve
    from deqzoo.hub.cards import read_model_card
    from deqzoo.hypersolver import load_hypersolver
    from deqzoo.hypersolver.attach import record_problems
    from deqzoo.hypersolver.io import check_compatible

    model_id, hs_id = MODELS[key]
    hs_id = hypersolver or hs_id
    model = deqzoo.from_pretrained(model_id).eval()
    model.requires_grad_(False)
    hs = load_hypersolver(hs_id)
    check_compatible(model, hs)
    extra = {f"hyperanderson[{label}]": load_hypersolver(path) for label, path in (also or {}).items()}
    for other in extra.values():
        check_compatible(model, other)
    methods = METHODS + tuple(extra)
    task = read_model_card(resolve(model_id))[0].get("deqzoo_task")
    deq_cfg = model.config.deq_config
    ref = get_solver(deq_cfg.f_solver)
    runs, targets = _held_out(model, task, limit)
    model.set_deq(on_nonconvergence="ignore")  # the reference's residuals are reported in the JSON
    with (
        torch.no_grad(),
        record_problems(
            model,
            solve=lambda p: ref(
                p.g,
                p.x0,
                max_iter=deq_cfg.f_max_iter,
                tol=deq_cfg.f_tol,
                stop_mode="rel",
                **deq_cfg.f_solver_kwargs,
            ),
        ) as problems,
    ):
        for run in runs:
            run()
    top = max(budgets)
    curves: dict = {}
    rec = {m: {"res": [], "times": [], "walls": [], "nfes": [], "finals": [],
               "kept": {k: [] for k in budgets}} for m in methods}
    with torch.no_grad():
        for method in methods:  # warm-up (kernels compiled, caches and allocator primed), not recorded
            _solve(method, problems[0], hs, min(top, 4), deq_cfg, [], extra)
        # side by side: every method on a problem before the next problem, so load drift hits all alike
        for p in tqdm(problems, desc=f"{key} solves", disable=not progress):
            for method in methods:
                x, stats, res, times, wall = _solve(method, p, hs, top, deq_cfg, budgets, extra)
                r = rec[method]
                r["res"].append(res)
                r["times"].append(times)
                r["walls"].append(wall)
                r["nfes"].append(stats.nfe)
                r["finals"].append((x, stats))
                if method != "anderson-default":
                    for k in budgets:
                        r["kept"][k].append(stats.extra["kept"][k] if k < stats.nfe else x)
        for method in methods:
            r = rec[method]
            finals = r["finals"]
            if method == "anderson-default":
                rel = torch.cat([s.rel_residual.double() for _, s in finals])
                outs = _forward_all(model, runs, [x for x, _ in finals])
                curves[method] = {
                    "mean_nfe": float(np.mean(r["nfes"])),
                    "mean_rel_residual": float(rel.mean()),
                    "median_rel_residual": float(rel.median()),
                    "wall_s": float(np.sum(r["walls"])),
                    "metric": _metric(task, outs, targets),
                    "converged": float(torch.cat([s.converged for _, s in finals]).double().mean()),
                }
                continue
            # best-so-far residual per sample after k evaluations = what a solve with budget k returns
            mean_best = torch.cat([torch.cummin(x, 1).values for x in r["res"]]).mean(0).tolist()
            current = torch.cat(r["res"]).mean(0).tolist()  # residual of the iterate itself (no best-of)
            wall_at = np.sum(r["times"], 0).tolist()  # summed over problems, per NFE
            metric = {k: _metric(task, _forward_all(model, runs, r["kept"][k]), targets) for k in budgets}
            curves[method] = {
                "nfe": list(range(1, top + 1)),
                "mean_rel_residual": mean_best,
                "mean_rel_residual_current": current,
                "wall_s": wall_at,
                "budgets": budgets,
                "metric": [metric[k] for k in budgets],
                "wall_s_at_budget": [wall_at[k - 1] for k in budgets],
            }
    out = {
        "model": model_id,
        "hypersolver": hs_id,
        "task": task,
        "problems": len(problems),
        "samples": int(sum(p.x0.shape[0] for p in problems)),
        "model_parameters": int(sum(p.numel() for p in model.parameters())),
        "hypersolver_parameters": hs.num_parameters(),
        "unroll_steps_K": hs.config.unroll_steps,
        "default": {"solver": deq_cfg.f_solver, "f_max_iter": deq_cfg.f_max_iter, "f_tol": deq_cfg.f_tol},
        "metric_name": "accuracy" if task == "mnist" else "perplexity",
        "curves": curves,
    }
    out["acceptance"] = _acceptance(out)
    return out


def _acceptance(out: dict) -> dict:
    c = out["curves"]
    ref = c["anderson-default"]
    target = ref["mean_rel_residual"]
    acc: dict = {
        "target_mean_rel_residual": target,
        "anderson_default_mean_nfe": ref["mean_nfe"],
        "anderson_default_wall_s": ref["wall_s"],
        "anderson_default_metric": ref["metric"],
    }
    for m in [k for k in c if k != "anderson-default"]:
        nfe = _interp_log(c[m]["nfe"], c[m]["mean_rel_residual"], target)
        acc[f"{m}_nfe_to_target"] = nfe
        if nfe is not None:
            lo = int(math.floor(nfe))
            w = c[m]["wall_s"]
            t = (
                w[max(lo - 1, 0)] + (nfe - lo) * (w[min(lo, len(w) - 1)] - w[max(lo - 1, 0)])
                if lo >= 1
                else w[0]
            )
            acc[f"{m}_wall_s_to_target"] = float(t)
    h_nfe, h_wall = acc.get("hyperanderson_nfe_to_target"), acc.get("hyperanderson_wall_s_to_target")
    acc["nfe_ratio_vs_anderson_default"] = None if h_nfe is None else h_nfe / ref["mean_nfe"]
    acc["wall_ratio_vs_anderson_default"] = None if h_wall is None else h_wall / ref["wall_s"]
    a_nfe = acc.get("anderson_nfe_to_target")
    acc["nfe_ratio_vs_anderson_curve"] = None if h_nfe is None or not a_nfe else h_nfe / a_nfe
    acc["nfe_ratio_met"] = (
        acc["nfe_ratio_vs_anderson_default"] is not None and acc["nfe_ratio_vs_anderson_default"] <= 0.5
    )
    acc["wall_ratio_met"] = (
        acc["wall_ratio_vs_anderson_default"] is not None and acc["wall_ratio_vs_anderson_default"] <= 0.6
    )
    # metric at equal wall time: HyperAnderson's metric curve interpolated at each Anderson budget's time
    ha, an = c["hyperanderson"], c["anderson"]
    higher_better = out["metric_name"] == "accuracy"
    diffs = []
    for t, ma in zip(an["wall_s_at_budget"], an["metric"]):
        mh = float(np.interp(t, ha["wall_s_at_budget"], ha["metric"]))
        if t >= ha["wall_s_at_budget"][0]:
            diffs.append({"wall_s": t, "anderson": ma, "hyperanderson": mh})
    acc["metric_at_equal_wall"] = diffs
    if higher_better:
        worst = min((d["hyperanderson"] - d["anderson"] for d in diffs), default=None)
        acc["metric_worst_gap"] = worst
        acc["metric_met"] = worst is not None and worst >= -0.001 - 1e-9  # 0.1 points, as a fraction
    else:
        worst = max((d["hyperanderson"] / d["anderson"] - 1 for d in diffs), default=None)
        acc["metric_worst_gap"] = worst
        acc["metric_met"] = worst is not None and worst <= 0.005 + 1e-9
    K = out["unroll_steps_K"]
    cur = ha["mean_rel_residual_current"]
    if len(cur) >= 2 * K:
        acc["no_blowup"] = {
            "K": K,
            "current_residual_at_K": cur[K - 1],
            "current_residual_at_2K": cur[2 * K - 1],
            "max_current_residual_K_to_2K": max(cur[K - 1 : 2 * K]),
            "reduced_from_K_to_2K": cur[2 * K - 1] < cur[K - 1],
            "current_residual_at_end": cur[-1],
            "steps": len(cur),
        }
    acc["parameter_share"] = out["hypersolver_parameters"] / out["model_parameters"]
    return acc


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(15, 4.2 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        c = r["curves"]
        colors = {m: f"C{i}" for i, m in enumerate(k for k in c if k != "anderson-default")}
        ref = c["anderson-default"]
        for m, col in colors.items():
            row[0].semilogy(c[m]["nfe"], c[m]["mean_rel_residual"], color=col, label=m)
            row[1].semilogy(np.array(c[m]["wall_s"]), c[m]["mean_rel_residual"], color=col, label=m)
            row[2].plot(c[m]["wall_s_at_budget"], c[m]["metric"], "o-", color=col, label=m, ms=3)
        row[0].semilogy(
            c["hyperanderson"]["nfe"],
            c["hyperanderson"]["mean_rel_residual_current"],
            ":",
            color="C3",
            label="hyperanderson (current iterate)",
        )
        for ax in row[:2]:
            ax.axhline(
                ref["mean_rel_residual"], color="k", lw=0.8, ls="--", label="anderson default residual"
            )
        row[0].plot([ref["mean_nfe"]], [ref["mean_rel_residual"]], "k*", ms=10, label="anderson default")
        row[1].plot([ref["wall_s"]], [ref["mean_rel_residual"]], "k*", ms=10)
        row[2].plot([ref["wall_s"]], [ref["metric"]], "k*", ms=10, label="anderson default")
        name = r["model"].split("/")[-1]
        row[0].set(title=f"{name}: residual vs NFE", xlabel="NFE", ylabel="mean relative residual")
        row[1].set(title=f"{name}: residual vs wall time", xlabel=f"wall s ({r['problems']} solves)")
        row[2].set(title=f"{name}: {r['metric_name']} vs wall time", xlabel="wall s", ylabel=r["metric_name"])
        if r["metric_name"] == "perplexity":
            row[2].set_yscale("log")
        row[0].legend(fontsize=7)
        row[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown_table(r: dict) -> str:
    """The card's table: per method, residual / metric / wall time at each budget, and the ratios."""
    c, a = r["curves"], r["acceptance"]
    lines = [
        "| method | " + " | ".join(f"NFE {k}" for k in c["anderson"]["budgets"]) + " |",
        "|---|" + "---|" * len(c["anderson"]["budgets"]),
    ]
    for m in [k for k in c if k != "anderson-default"]:
        cells = [
            f"{c[m]['mean_rel_residual'][k - 1]:.2e} / {mt:.4g} / {w:.2f}s"
            for k, mt, w in zip(c[m]["budgets"], c[m]["metric"], c[m]["wall_s_at_budget"])
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ref = c["anderson-default"]
    d = r["default"]
    lines.append("")
    lines.append(
        f"Cells: mean relative residual / {r['metric_name']} / wall time over all {r['problems']} solves. "
        f"Anderson at the model's default settings ({d['solver']}, f_max_iter {d['f_max_iter']}, "
        f"tol {d['f_tol']}): mean NFE {ref['mean_nfe']:.2f}, mean relative residual "
        f"{ref['mean_rel_residual']:.2e}, {r['metric_name']} {ref['metric']:.4g}, wall {ref['wall_s']:.2f}s."
    )
    fmt = lambda v: "not reached" if v is None else f"{v:.2f}"  # noqa: E731
    lines.append("")
    reach = []
    for m in [k for k in c if k != "anderson-default"]:
        n, t = a.get(f"{m}_nfe_to_target"), a.get(f"{m}_wall_s_to_target")
        reach.append(f"{m} {fmt(n)}" + ("" if t is None else f" ({t:.2f}s)"))
    lines.append("NFE (wall time) to reach the Anderson-default mean residual: " + ", ".join(reach) + ".")
    lines.append("")
    lines.append("| acceptance | value | bar | met |")
    lines.append("|---|---|---|---|")
    lines.append(
        f"| HyperAnderson NFE to Anderson-default residual / Anderson-default NFE | "
        f"{fmt(a['nfe_ratio_vs_anderson_default'])} ({fmt(a.get('hyperanderson_nfe_to_target'))} vs "
        f"{a['anderson_default_mean_nfe']:.2f}) | <= 0.5 | {a['nfe_ratio_met']} |"
    )
    lines.append(
        f"| its wall time / Anderson-default wall time | {fmt(a['wall_ratio_vs_anderson_default'])} | "
        f"<= 0.6 | {a['wall_ratio_met']} |"
    )
    gap = a["metric_worst_gap"]
    bar = "accuracy within 0.1 points" if r["metric_name"] == "accuracy" else "perplexity within 0.5%"
    lines.append(
        f"| worst {r['metric_name']} gap at equal wall time (hyper - anderson"
        f"{'' if r['metric_name'] == 'accuracy' else ', relative'}) | "
        f"{'n/a' if gap is None else f'{gap:+.4f}'} | {bar} | {a['metric_met']} |"
    )
    nb = a.get("no_blowup")
    if nb:
        lines.append(
            f"| current-iterate residual at K={nb['K']} -> 2K | {nb['current_residual_at_K']:.2e} -> "
            f"{nb['current_residual_at_2K']:.2e} (at {nb['steps']}: {nb['current_residual_at_end']:.2e}) "
            f"| keeps reducing | {nb['reduced_from_K_to_2K']} |"
        )
    lines.append(
        f"| parameters (share of the model's) | {r['hypersolver_parameters']:,} "
        f"({100 * a['parameter_share']:.2f}%) | < 4% | {a['parameter_share'] < 0.04} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deqzoo bench hypersolver", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument(
        "--hypersolver",
        action="append",
        default=[],
        metavar="KEY=PATH",
        help="use another hypersolver for a model, e.g. mdeq=/tmp/hs",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="held-out inputs (mdeq: images, default 500) / chunks (pydoc: default 24)",
    )
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=PATH",
                        help="another hypersolver for the model, benchmarked as hyperanderson[LABEL]")
    parser.add_argument("--budgets", type=int, nargs="+", default=None)
    parser.add_argument("--out", default="bench_output/hypersolver.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from deqzoo.core import _kernels

    _kernels.warm_up(block=True)  # no solve may run the torch path while the kernels compile
    override = dict(s.split("=", 1) for s in args.hypersolver)
    results = []
    for key in args.models:
        limit = args.limit or (500 if key == "mdeq" else 24)
        budgets = args.budgets or (
            [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30]
            if key == "mdeq"
            else [1, 2, 3, 4, 6, 8, 10, 12, 15, 20, 25, 30, 40]
        )
        results.append(
            bench_model(
                key,
                limit=limit,
                budgets=sorted(budgets),
                hypersolver=override.get(key),
                also=dict(a.split("=", 1) for a in args.also),
                progress=not args.no_progress,
            )
        )
        print(f"\n## {results[-1]['model']}\n\n{markdown_table(results[-1])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "threads": args.threads}, indent=1) + "\n")
    _plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
