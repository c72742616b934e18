"""`deqzoo bench implicit2`: Implicit² against explicit networks, side by side at equal steps (one run).

Groups (``--groups``, default all):
- ``rep``: image representation of `camera` at ``--size``: implicit 1L-256D / 1L-512D vs explicit 1L and
  4L-256D per filter (``--filters``): PSNR (from a zero initial state) against step, step time, peak training
  memory (tensors saved for backward + weights, gradients, Adam moments; and the process's peak RSS growth),
  parameters.
- ``reuse``: forward-solve f-evaluations per training step with and without fixed-point reuse (Fig. 8.3).
- ``T``: NPG with T = 0 (Jacobian-free), 1 and ∞ (IFT) on `camera` (Fig. 8.4), all at ``--t-steps``.
- ``time``: implicit 1L-256D and explicit 4L-256D training steps alternated in one process (the time ratio
  under the same machine load).
- ``gen``: generalization (train on 25% of the pixels, PSNR on a disjoint 25%) over every bundled image,
  implicit vs explicit at equal width.

Every setting runs in its own process (a clean peak-RSS measurement; finished settings are kept in
``OUT/runs/*.json`` and skipped on a rerun, so an interrupted bench resumes). Writes
``OUT/implicit2.json`` and
PNGs (``rep_psnr.png``, ``reuse_nfe.png``, ``npg_T.png``, ``gen.png``).

Example (the runs of examples/implicit2/README.md; ~1 h on one CPU thread):
    python -m deqzoo.cli bench implicit2 --filters gabor,siren --groups rep,reuse,T,time \
        --only rep-gabor-imp-1l256d,rep-gabor-exp-4l256d,reuse-gabor-noreuse,T-gabor-T0,T-gabor-Tinf,\
time-gabor --out bench_implicit2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_GEN_EXPLICIT_LAYERS = 1  # explicit baseline of the generalization table: same width, one layer


def paper_input_scale(filter_type: str, size: int) -> float:
    """The original's frequency scale per pixel: camera at 512² uses 256 for Fourier/Gabor MFNs and 128 for
    SIREN (its `siren_like` filters get input_scale / 2); a size² grid gets the same frequencies per pixel."""
    return (128.0 if filter_type == "siren" else 256.0) * size / 512


def _t_steps(args) -> int:
    """Steps of the T comparison: --t-steps (0 = --steps), never more than --steps (T = 1 is the
    representation run's evaluation at that step)."""
    return min(args.t_steps or args.steps, args.steps)


def _settings(args) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    groups = set(args.groups.split(","))
    filters = args.filters.split(",")
    rep = {"image": "camera", "size": args.size, "split": "full", "steps": args.steps,
           "t_steps": _t_steps(args)}
    if "rep" in groups:
        for f in filters:
            for imp, layers, width in ((True, 1, 256), (True, 1, 512), (False, 1, 256), (False, 4, 256)):
                tag = f"{f}-{'imp' if imp else 'exp'}-{layers}l{width}d"
                out.append(
                    {
                        "name": f"rep-{tag}",
                        "group": "rep",
                        "filter": f,
                        "implicit": imp,
                        "layers": layers,
                        "width": width,
                        "T": 1,
                        "reuse": True,
                        "input_scale": paper_input_scale(f, args.size),
                        **rep,
                    }
                )
    first = filters[0]
    base = {
        "group": "",
        "filter": first,
        "implicit": True,
        "layers": 1,
        "width": 256,
        "T": 1,
        "reuse": True,
        "input_scale": paper_input_scale(first, args.size),
        **rep,
    }
    if "reuse" in groups:
        out.append({**base, "name": f"reuse-{first}-noreuse", "group": "reuse", "reuse": False})
        # the original's training forward: no solve, one f step from the previous fixed point
        out.append({**base, "name": f"reuse-{first}-onestep", "group": "reuse", "max_iter": 1})
    if "T" in groups:
        for t in ("0", "inf"):
            steps = _t_steps(args)
            out.append({**base, "name": f"T-{first}-T{t}", "group": "T", "T": t, "steps": steps})
    if "time" in groups:
        for f in filters:
            out.append({**rep, "name": f"time-{f}", "group": "time", "filter": f, "T": 1, "reuse": True,
                        "input_scale": paper_input_scale(f, args.size), "warmup": 2,
                        "warmup_implicit": max(2, args.time_after), "rounds": args.time_rounds})
    if "gen" in groups:
        from ..tasks.implicit2 import IMAGES

        for image in IMAGES:
            for imp in (True, False):
                layers = 1 if imp else _GEN_EXPLICIT_LAYERS
                out.append(
                    {
                        "name": f"gen-{image}-{first}-{'imp' if imp else 'exp'}",
                        "group": "gen",
                        "filter": first,
                        "implicit": imp,
                        "layers": layers,
                        "width": 256,
                        "T": 1,
                        "reuse": True,
                        "image": image,
                        "size": args.gen_size,
                        "split": "generalization",
                        "steps": args.gen_steps,
                        # the original: input scale 128 for a 512 grid; the same frequencies per pixel here
                        "input_scale": 128.0 * args.gen_size / 512,
                    }
                )
    if args.only:
        keep = set(args.only.split(","))
        out = [s for s in out if s["name"] in keep]
    return out


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _build(setting: dict[str, Any], data, seed: int):
    """The setting's model (config from the setting, seeded initialisation)."""
    import torch

    from ..core import neumann_backward
    from ..models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation

    T = float("inf") if str(setting["T"]) == "inf" else int(setting["T"])
    cfg = Implicit2Config(
        filter_type=setting["filter"],
        implicit=setting["implicit"],
        num_layers=setting["layers"],
        hidden_size=setting["width"],
        input_scale=float(setting.get("input_scale", 256.0)),
        out_features=data.train_values.shape[-1],
        deq={**neumann_backward(T)},
        task_specific_params={
            "implicit2": {"image": setting["image"], "size": int(setting["size"]), "split": setting["split"]}
        },
    )
    torch.manual_seed(seed)
    model = Implicit2ForSignalRepresentation(cfg)
    return model


def run_timing(setting: dict[str, Any], data, out_dir: Path, seed: int) -> dict[str, Any]:
    """Time per training step of implicit 1L-256D and explicit 4L-256D under the same machine load: their
    steps alternate (ABBA order per pair of rounds) in one process after `warmup` steps each."""
    from ..tasks.implicit2 import Fitter

    fitters = {}
    for kind, implicit, layers in (("imp-1l256d", True, 1), ("exp-4l256d", False, 4)):
        model = _build({**setting, "implicit": implicit, "layers": layers, "width": 256}, data, seed)
        fitters[kind] = Fitter(model, data.train_coords, data.train_values)
    times: dict[str, list[float]] = {k: [] for k in fitters}
    nfe: list[int] = []
    # the implicit network trains `warmup_implicit` steps first (its step time depends on how many solver
    # steps the reuse solve still needs; the explicit network's does not)
    for kind, f in fitters.items():
        for _ in range(int(setting.get("warmup_implicit", setting["warmup"]) if kind.startswith("imp")
                           else setting["warmup"])):  # fmt: skip
            f.step()
    for r in range(int(setting["rounds"])):
        for kind in list(fitters)[:: 1 if r % 2 == 0 else -1]:
            rec = fitters[kind].step()
            times[kind].append(rec["step_time"])
            if kind.startswith("imp"):
                nfe.append(rec["nfe"])
    med = {k: float(np.median(v)) for k, v in times.items()}
    record = {
        **setting,
        "seed": seed,
        "step_times": times,
        "median_step_time": med,
        "imp_nfe": nfe,
        "time_ratio": med["imp-1l256d"] / med["exp-4l256d"],
        "round_ratios": [a / b for a, b in zip(times["imp-1l256d"], times["exp-4l256d"])],
    }
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    (out_dir / "runs" / f"{setting['name']}.json").write_text(json.dumps(record))
    return record


def run_one(setting: dict[str, Any], out_dir: Path, seed: int, save_dir: Path | None) -> dict[str, Any]:
    """Train one setting in this process; returns its record (also written to out_dir/runs/NAME.json)."""
    import torch

    torch.set_num_threads(1)
    from ..tasks.implicit2 import fit, image_data, psnr

    data = image_data(setting["image"], int(setting["size"]), setting["split"])
    if setting["group"] == "time":
        return run_timing(setting, data, out_dir, seed)
    model = _build(setting, data, seed)
    cfg = model.config
    rss0 = _rss_kib("VmRSS")

    eval_iter = cfg.deq_config.f_max_iter
    train_iter = int(setting.get("max_iter", eval_iter))
    model.set_deq(f_max_iter=train_iter)

    @torch.no_grad()
    def eval_fn(m):  # always from zeros, with the full evaluation budget
        m.set_deq(f_max_iter=eval_iter)
        try:
            return psnr(m(data.test_coords).values, data.test_values)
        finally:
            m.set_deq(f_max_iter=train_iter)

    hist = fit(
        model,
        data.train_coords,
        data.train_values,
        int(setting["steps"]),
        reuse=setting["reuse"],
        eval_every=int(setting.get("eval_every", 10)),
        eval_at=(int(setting.get("t_steps", 0)),),  # the T comparison's step count
        eval_fn=eval_fn,
        desc=setting["name"],
    )
    model.set_deq(f_max_iter=eval_iter)
    record = {
        **setting,
        "seed": seed,
        "params": sum(p.numel() for p in model.parameters()),
        "train_pixels": int(data.train_coords.shape[0]),
        "loss": hist["loss"],
        "train_psnr": [-10 * np.log10(max(v / 4.0, 1e-30)) for v in hist["loss"]],
        "nfe": hist["nfe"],
        "residual": hist["residual"],
        "f_tol": cfg.deq_config.f_tol,
        "step_time": hist["step_time"],
        "eval": hist["eval"],
        "final_psnr": hist["eval"][-1][1],
        "saved_bytes": hist["saved_bytes"],
        "state_bytes": hist["state_bytes"],
        "peak_rss_growth_bytes": 1024 * max(0, _rss_kib("VmHWM") - rss0),
    }
    if save_dir is not None:
        model.save_pretrained(save_dir / setting["name"])
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    (out_dir / "runs" / f"{setting['name']}.json").write_text(json.dumps(record))
    return record


def _launch(setting, args) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "deqzoo.bench.implicit2",
        "--run-one",
        setting["name"],
        "--out",
        str(args.out),
        "--size",
        str(args.size),
        "--steps",
        str(args.steps),
        "--t-steps",
        str(args.t_steps),
        "--time-rounds",
        str(args.time_rounds),
        "--time-after",
        str(args.time_after),
        "--gen-size",
        str(args.gen_size),
        "--gen-steps",
        str(args.gen_steps),
        "--filters",
        args.filters,
        "--groups",
        args.groups,
        "--seed",
        str(args.seed),
    ]
    if args.save_models:
        cmd += ["--save-models", str(args.save_models)]
    log = open(Path(args.out) / "runs" / f"{setting['name']}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})


def _mean_after(xs: list[float], start: int) -> float:
    tail = xs[start:] if len(xs) > start else xs
    return float(np.mean(tail)) if tail else float("nan")


def summarize(records: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """Tables, ratios and PNGs from the finished runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary: dict[str, Any] = {"rep": [], "reuse": {}, "T": {}, "gen": [], "time": {}, "pngs": {}}
    for r in records.values():
        if r["group"] == "time":
            summary["time"][r["filter"]] = {
                "median_step_time_s": {k: round(v, 3) for k, v in r["median_step_time"].items()},
                "time_ratio_imp1l_vs_exp4l": round(r["time_ratio"], 3),
                "round_ratios": [round(x, 3) for x in r["round_ratios"]],
                "imp_nfe": r["imp_nfe"],
                "rounds": r["rounds"],
            }
    rep = [r for r in records.values() if r["group"] == "rep"]
    for r in rep:
        summary["rep"].append(
            {
                "name": r["name"],
                "filter": r["filter"],
                "implicit": r["implicit"],
                "layers": r["layers"],
                "width": r["width"],
                "steps": r["steps"],
                "size": r["size"],
                "params": r["params"],
                "final_psnr": round(r["final_psnr"], 2),
                "step_time_s": round(_mean_after(r["step_time"], 5), 3),
                "train_memory_bytes": r["saved_bytes"] + r["state_bytes"],
                "peak_rss_growth_bytes": r["peak_rss_growth_bytes"],
                "mean_nfe_after_100": round(_mean_after(r["nfe"], 100), 2) if r["implicit"] else None,
            }
        )
    for f in sorted({r["filter"] for r in rep}):
        rows = {(x["implicit"], x["layers"], x["width"]): x for x in summary["rep"] if x["filter"] == f}
        ref = rows.get((False, 4, 256))
        for x in rows.values():
            if ref is not None:
                x["psnr_minus_exp4l"] = round(x["final_psnr"] - ref["final_psnr"], 2)
                x["memory_ratio_vs_exp4l"] = round(x["train_memory_bytes"] / ref["train_memory_bytes"], 3)
                x["time_ratio_vs_exp4l"] = round(x["step_time_s"] / ref["step_time_s"], 3)
    if rep:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in sorted(rep, key=lambda r: r["name"]):
            label = r["name"].removeprefix("rep-")
            axes[0].plot(np.arange(1, len(r["train_psnr"]) + 1), r["train_psnr"], label=label, lw=1)
            steps, vals = zip(*r["eval"])
            axes[1].plot(steps, vals, "o-", label=label)
        axes[0].set(title="training PSNR (training forward)", xlabel="step", ylabel="PSNR (dB)")
        axes[1].set(title="PSNR from a zero initial state", xlabel="step", ylabel="PSNR (dB)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "rep_psnr.png", dpi=110)
        plt.close(fig)
        summary["pngs"]["rep"] = str(out / "rep_psnr.png")
    no = [r for r in records.values() if r["group"] == "reuse" and not r.get("max_iter")]
    one = [r for r in records.values() if r["group"] == "reuse" and r.get("max_iter")]
    if one:
        summary["reuse"]["onestep"] = {
            "mean_nfe_after_100": round(_mean_after(one[0]["nfe"], 100), 2),
            "mean_rel_residual_after_100": float(_mean_after(one[0]["residual"], 100)),
            "final_psnr": round(one[0]["final_psnr"], 2),
        }
    if no:
        r0 = no[0]
        with_ = records.get(f"rep-{r0['filter']}-imp-1l256d")
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(r0["nfe"], label="without reuse (zeros)")
        summary["reuse"]["without"] = round(_mean_after(r0["nfe"], 100), 2)
        if with_:
            ax.plot(with_["nfe"], label="with reuse (previous z*)")
            summary["reuse"]["with"] = round(_mean_after(with_["nfe"], 100), 2)
            summary["reuse"]["ratio"] = round(
                summary["reuse"]["without"] / max(summary["reuse"]["with"], 1e-9), 2
            )
            summary["reuse"]["psnr_with"] = round(with_["final_psnr"], 2)
            summary["reuse"]["mean_rel_residual_with_after_100"] = float(_mean_after(with_["residual"], 100))
        summary["reuse"]["psnr_without"] = round(r0["final_psnr"], 2)
        summary["reuse"]["tol"] = f"rel {r0.get('f_tol', 1e-3):g} (fixed_point, max 100)"
        ax.set(
            xlabel="training step",
            ylabel="forward f-evaluations",
            yscale="log",
            title=f"fixed-point reuse ({r0['filter']} 1L-256D, camera {r0['size']}px)",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "reuse_nfe.png", dpi=110)
        plt.close(fig)
        summary["pngs"]["reuse"] = str(out / "reuse_nfe.png")
    ts = {str(r["T"]): r for r in records.values() if r["group"] == "T"}
    if ts:
        f = next(iter(ts.values()))["filter"]
        t_steps = min(int(r["steps"]) for r in ts.values())
        if f"rep-{f}-imp-1l256d" in records:
            ts["1"] = records[f"rep-{f}-imp-1l256d"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for t in sorted(ts, key=lambda s: float(s)):
            r = ts[t]
            n = min(t_steps, len(r["train_psnr"]))  # every T compared at the same step count
            axes[0].plot(np.arange(1, n + 1), r["train_psnr"][:n], label=f"T = {t}")
            ev = [(s, v) for s, v in r["eval"] if s <= t_steps]
            axes[1].plot(*zip(*ev), "o-", label=f"T = {t}")
            summary["T"][t] = {
                "steps": ev[-1][0],
                "final_psnr": round(ev[-1][1], 2),
                "step_time_s": round(_mean_after(r["step_time"][:n], 5), 3),
            }
        axes[0].set(xlabel="step", ylabel="training PSNR (dB)", title="NPG with T terms (T=0 JFB, T=inf IFT)")
        axes[1].set(xlabel="step", ylabel="PSNR from a zero initial state (dB)", title="evaluation")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / "npg_T.png", dpi=110)
        plt.close(fig)
        summary["pngs"]["T"] = str(out / "npg_T.png")
    gen = [r for r in records.values() if r["group"] == "gen"]
    images = sorted({r["image"] for r in gen})
    diffs = []
    for image in images:
        imp = records.get(f"gen-{image}-{gen[0]['filter']}-imp")
        exp = records.get(f"gen-{image}-{gen[0]['filter']}-exp")
        row = {
            "image": image,
            "implicit_1l256d": imp and round(imp["final_psnr"], 2),
            "explicit": exp and round(exp["final_psnr"], 2),
        }
        if imp and exp:
            row["difference"] = round(imp["final_psnr"] - exp["final_psnr"], 2)
            diffs.append(row["difference"])
        summary["gen"].append(row)
    if diffs:
        summary["gen_mean_difference"] = round(float(np.mean(diffs)), 2)
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = np.arange(len(summary["gen"]))
        ax.bar(xs - 0.2, [r["implicit_1l256d"] or 0 for r in summary["gen"]], 0.4, label="implicit 1L-256D")
        ax.bar(
            xs + 0.2,
            [r["explicit"] or 0 for r in summary["gen"]],
            0.4,
            label=f"explicit {_GEN_EXPLICIT_LAYERS}L-256D",
        )
        ax.set_xticks(xs, [r["image"] for r in summary["gen"]])
        ax.set(ylabel="held-out PSNR (dB)", title="generalization (train 25%, test disjoint 25%)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gen.png", dpi=110)
        plt.close(fig)
        summary["pngs"]["gen"] = str(out / "gen.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench implicit2", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_implicit2")
    p.add_argument("--size", type=int, default=256, help="camera resolution for rep/reuse/T/time")
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--t-steps", type=int, default=40, help="steps of the T=0 / T=inf runs (0: --steps); "
                   "every T is compared at this step count (the T=1 run's evaluation at that step)")
    p.add_argument("--time-rounds", type=int, default=6,
                   help="timed steps per network, alternating (time group)")
    p.add_argument("--time-after", type=int, default=2,
                   help="training steps of the implicit network before the time group's timed steps "
                        "(e.g. 100: timed where reuse has settled)")
    p.add_argument("--gen-size", type=int, default=128, help="image resolution of the generalization grid")
    p.add_argument("--gen-steps", type=int, default=150)
    p.add_argument("--filters", default="gabor,siren")
    p.add_argument("--groups", default="rep,reuse,T,gen")
    p.add_argument("--only", default="", help="comma-separated setting names to run")
    p.add_argument("--jobs", type=int, default=1, help="settings trained at once (each its own process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-models", default="", help="save every trained model under this directory")
    p.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    settings = _settings(args)
    save_dir = Path(args.save_models) if args.save_models else None
    if args.run_one:
        match = [s for s in settings if s["name"] == args.run_one]
        if not match:
            raise SystemExit(f"unknown setting {args.run_one!r}; known: {[s['name'] for s in settings]}")
        run_one(match[0], out, args.seed, save_dir)
        return 0
    todo = [s for s in settings if not (out / "runs" / f"{s['name']}.json").exists()]
    print(f"implicit2 bench: {len(settings)} settings, {len(todo)} to run, {args.jobs} at a time -> {out}")
    running: list[tuple[dict, subprocess.Popen]] = []
    failed = []
    while todo or running:
        while todo and len(running) < max(1, args.jobs):
            s = todo.pop(0)
            running.append((s, _launch(s, args)))
        time.sleep(2)
        for item in list(running):
            s, proc = item
            if proc.poll() is not None:
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (rc {proc.returncode})"
                if proc.returncode:
                    failed.append(s["name"])
                print(f"  {s['name']}: {status}", flush=True)
    records = {}
    for s in settings:
        path = out / "runs" / f"{s['name']}.json"
        if path.exists():
            records[s["name"]] = json.loads(path.read_text())
    summary = summarize(records, out)
    summary["failed"] = failed
    summary["settings"] = {
        "size": args.size,
        "steps": args.steps,
        "t_steps": _t_steps(args),
        "gen_size": args.gen_size,
        "gen_steps": args.gen_steps,
        "seed": args.seed,
        "lr": 1e-3,
        "optimizer": "Adam",
        "threads": 1,
    }
    (out / "implicit2.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("rep", "reuse", "T", "gen", "time")}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
