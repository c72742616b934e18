"""`deqzoo bench hypersolver`: HyperDEQ against classic solvers on held-out inputs, side by side in one run.

For each model (``--models``, with its hypersolver): the held-out forward passes of the model's task are
recorded once (each DEQ solve answered by Anderson at the model's default settings: the reference; the
DEQ-Transformer's memory of past equilibria comes from this pass). Every recorded problem is then solved by
each method at the largest budget with no early stopping, recording per f evaluation the wall time since the
solve began (the initializer included) and every sample's residual, and keeping each sample's best iterate at
every budget (the answer a solve with that budget returns). The task metric at each budget is the model's head
on those answers. Methods: ``anderson`` and ``broyden`` from the model's zero start, ``anderson+init``
from the learned initializer, ``hyperanderson`` (initializer + learned mixing), plus two runs at the model's
own settings with early stopping: ``anderson-default`` (the reference point of the acceptance ratios) and
``shipped`` (the hypersolver as attaching it runs, `HyperSolverConfig.use`: the initializer and then the
model's solver, or HyperAnderson). The order of the methods rotates from one problem to the next.

Acceptance (``acceptance`` in the JSON): the wall time each method needs to reach the mean relative residual
of Anderson at its default settings (log-linear interpolation between NFEs), over Anderson-default's wall
time, at most 0.8 for the part the hypersolver ships (``anderson+init`` for ``use="initializer"``,
``hyperanderson`` otherwise); the NFE ratios; the task metric at equal wall time (the shipped part's curve
interpolated at Anderson's times); and the residual of HyperAnderson's current iterate from K to 2K (and
beyond) steps, K being the hypersolver's unroll length.

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
METHODS = ("anderson-default", "shipped", "anderson", "broyden", "anderson+init", "hyperanderson")
EARLY_STOPPING = ("anderson-default", "shipped")  # the model's budget and tolerance; no curve
WALL_BAR = 0.8  # the shipped part's wall time to the Anderson-default residual, over Anderson-default's


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
    from examples.hypersolver._problems import initial_flat

    if method in (extra or {}):  # another hypersolver for the same model, e.g. the paper's form
        hs, method = extra[method], "hyperanderson"
    if method == "shipped":
        method = "default+init" if hs.config.use == "initializer" else "hyperanderson-default"
    timed = _Timed(p.g)  # the clock starts here: the initializer's time is part of the solve
    x0 = initial_flat(hs, p) if method.endswith("+init") or method.startswith("hyperanderson") else p.x0
    kw = {}
    if method.startswith("hyperanderson"):
        c = hs.config
        solver = get_solver("hyperanderson")
        kw = {"net": hs.bind(p.packer.shapes), "m": c.m, "form": c.form, "base": c.alpha_base}
    elif method.startswith(("default", "anderson-default")):
        solver, kw = get_solver(deq_cfg.f_solver), dict(deq_cfg.f_solver_kwargs)
    else:
        solver = get_solver(method.split("+")[0])
    early = method.endswith("-default") or method == "default+init"
    budget, tol = (deq_cfg.f_max_iter, deq_cfg.f_tol) if early else (budget, 1e-30)
    keep_steps = [] if early else [k for k in keep if k <= budget]
    x, stats = solver(timed, x0, max_iter=budget, tol=tol, stop_mode="rel", keep_steps=keep_steps, **kw)
    wall = time.perf_counter() - timed.start
    res = torch.stack(timed.res, 1)  # (B, nfe): residual of the iterate f was called on
    times = np.array(timed.times)
    if not early and res.shape[1] < budget:  # stopped early (non-finite): hold the last
        res = torch.cat((res, res[:, -1:].expand(-1, budget - res.shape[1])), 1)
        times = np.concatenate((times, np.full(budget - len(times), times[-1])))
    return x, stats, res, times, wall


def _forward_all(model, runs, answers: list[torch.Tensor]):
    """Run the recorded forward passes again, each DEQ solve answered by the next state in `answers`."""
    from examples.hypersolver._problems import record_problems

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
        from examples.mdeq import mnist

        x, y = mnist.load_split("test")
        order = np.argsort(np.arange(len(y)) % 100, kind="stable")[:limit]  # classes interleaved
        x, y = x[order], y[order]
        runs = []
        for s in range(0, len(y), 100):
            pixels = mnist.to_pixel_values(x[s : s + 100], model)
            runs.append(lambda pixels=pixels: model(pixel_values=pixels))
        return runs, torch.from_numpy(y)
    from examples.deq_transformer import pydoc_lm

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
    from deqzoo.hypersolver.io import check_compatible
    from examples.hypersolver._problems import record_problems

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
        # side by side: every method on a problem before the next problem, so load drift hits all alike, in
        # an order that rotates (no method always runs right after another's allocations)
        for i, p in enumerate(tqdm(problems, desc=f"{key} solves", disable=not progress)):
            for method in methods[i % len(methods) :] + methods[: i % len(methods)]:
                x, stats, res, times, wall = _solve(method, p, hs, top, deq_cfg, budgets, extra)
                r = rec[method]
                r["res"].append(res)
                r["times"].append(times)
                r["walls"].append(wall)
                r["nfes"].append(stats.nfe)
                r["finals"].append((x, stats))
                if method not in EARLY_STOPPING:
                    for k in budgets:
                        r["kept"][k].append(stats.extra["kept"][k] if k < stats.nfe else x)
        for method in methods:
            r = rec[method]
            finals = r["finals"]
            if method in EARLY_STOPPING:
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
        "use": hs.config.use,
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


def _curve_methods(curves: dict) -> list[str]:
    return [k for k in curves if k not in EARLY_STOPPING]


def shipped_part(use: str) -> str:
    """The curve of the part a hypersolver ships (`HyperSolverConfig.use`)."""
    return "anderson+init" if use == "initializer" else "hyperanderson"


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
    for m in _curve_methods(c):
        nfe = _interp_log(c[m]["nfe"], c[m]["mean_rel_residual"], target)
        acc[f"{m}_nfe_to_target"] = nfe
        acc[f"{m}_nfe_ratio"] = None if nfe is None else nfe / ref["mean_nfe"]
        if nfe is not None:
            # wall time at a fractional NFE: linear between the times of the evaluations around it
            acc[f"{m}_wall_s_to_target"] = float(np.interp(nfe, c[m]["nfe"], c[m]["wall_s"]))
            acc[f"{m}_wall_ratio"] = acc[f"{m}_wall_s_to_target"] / ref["wall_s"]
    part = shipped_part(out.get("use", "hyperanderson"))
    acc["shipped_part"] = part
    acc["shipped_wall_ratio"] = acc.get(f"{part}_wall_ratio")
    acc["shipped_nfe_ratio"] = acc.get(f"{part}_nfe_ratio")
    acc["wall_bar"] = WALL_BAR
    acc["wall_ratio_met"] = acc["shipped_wall_ratio"] is not None and acc["shipped_wall_ratio"] <= WALL_BAR
    if "shipped" in c:  # as a user runs it: the model's budget and tolerance, early stopping
        s = c["shipped"]
        acc["shipped_run"] = {
            "wall_ratio": s["wall_s"] / ref["wall_s"],
            "mean_nfe": s["mean_nfe"],
            "mean_rel_residual": s["mean_rel_residual"],
            "metric": s["metric"],
        }
    # metric at equal wall time: the shipped part's metric curve interpolated at each Anderson budget's time
    sh, an = c[part], c["anderson"]
    diffs = [
        {"wall_s": t, "anderson": ma, part: float(np.interp(t, sh["wall_s_at_budget"], sh["metric"]))}
        for t, ma in zip(an["wall_s_at_budget"], an["metric"])
        if t >= sh["wall_s_at_budget"][0]
    ]
    acc["metric_at_equal_wall"] = diffs
    if out["metric_name"] == "accuracy":
        worst = min((d[part] - d["anderson"] for d in diffs), default=None)
        acc["metric_met"] = worst is not None and worst >= -0.001 - 1e-9  # 0.1 points, as a fraction
    else:
        worst = max((d[part] / d["anderson"] - 1 for d in diffs), default=None)
        acc["metric_met"] = worst is not None and worst <= 0.005 + 1e-9
    acc["metric_worst_gap"] = worst
    K = out["unroll_steps_K"]
    cur = c["hyperanderson"]["mean_rel_residual_current"]
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
        colors = {m: f"C{i}" for i, m in enumerate(_curve_methods(c))}
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
        if "shipped" in c:
            s = c["shipped"]
            row[0].plot([s["mean_nfe"]], [s["mean_rel_residual"]], "r*", ms=10, label=f"shipped ({r['use']})")
            row[1].plot([s["wall_s"]], [s["mean_rel_residual"]], "r*", ms=10)
            row[2].plot([s["wall_s"]], [s["metric"]], "r*", ms=10, label=f"shipped ({r['use']})")
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
    for m in _curve_methods(c):
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
    for m in _curve_methods(c):
        n, t = a.get(f"{m}_nfe_to_target"), a.get(f"{m}_wall_s_to_target")
        reach.append(f"{m} {fmt(n)}" + ("" if t is None else f" ({t:.2f}s)"))
    lines.append("NFE (wall time) to reach the Anderson-default mean residual: " + ", ".join(reach) + ".")
    part, use = a["shipped_part"], r.get("use", "hyperanderson")
    lines += ["", "| acceptance | value | bar | met |", "|---|---|---|---|"]
    lines.append(
        f"| shipped part (`use: {use}`, curve `{part}`): wall time to the Anderson-default residual / "
        f"Anderson-default wall time | {fmt(a['shipped_wall_ratio'])} "
        f"(NFE ratio {fmt(a['shipped_nfe_ratio'])}) "
        f"| <= {a['wall_bar']} | {a['wall_ratio_met']} |"
    )
    for m in [k for k in ("anderson+init", "hyperanderson") if k != part]:
        lines.append(
            f"| the other part, `{m}`: the same wall-time ratio | {fmt(a.get(f'{m}_wall_ratio'))} (NFE ratio "
            f"{fmt(a.get(f'{m}_nfe_ratio'))}) | not shipped | - |"
        )
    run = a.get("shipped_run")
    if run:
        lines.append(
            f"| as attached (`shipped`: the model's budget and tolerance, early stopping): wall time / "
            f"Anderson-default's | {run['wall_ratio']:.2f} (mean NFE {run['mean_nfe']:.2f} vs "
            f"{a['anderson_default_mean_nfe']:.2f}, mean residual {run['mean_rel_residual']:.2e} vs "
            f"{a['target_mean_rel_residual']:.2e}, {r['metric_name']} {run['metric']:.4g} vs "
            f"{a['anderson_default_metric']:.4g}) | - | - |"
        )
    gap = a["metric_worst_gap"]
    bar = "accuracy within 0.1 points" if r["metric_name"] == "accuracy" else "perplexity within 0.5%"
    lines.append(
        f"| worst {r['metric_name']} gap at equal wall time (`{part}` - anderson"
        f"{'' if r['metric_name'] == 'accuracy' else ', relative'}) | "
        f"{'n/a' if gap is None else f'{gap:+.4f}'} | {bar} | {a['metric_met']} |"
    )
    nb = a.get("no_blowup")
    if nb:
        lines.append(
            f"| HyperAnderson's current-iterate residual at K={nb['K']} -> 2K | "
            f"{nb['current_residual_at_K']:.2e} -> {nb['current_residual_at_2K']:.2e} "
            f"(at {nb['steps']}: {nb['current_residual_at_end']:.2e}) "
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
