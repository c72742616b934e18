"""`deqzoo bench deq-ddim`: DEQ-DDIM sampling and inversion against diffusers' DDIMPipeline, a ParaDiGMS-style
Picard sampler (DDIMParallelScheduler, the StableDiffusionParadigmsPipeline loop on a UNet2DModel) and
sequential-backprop inversion, side by side in one run; writes JSON and a PNG.

    deqzoo bench deq-ddim --out bench_output/deq_ddim.json  # T in 10 25 50 100, 16 inversions at T=25, 150 s
    deqzoo bench deq-ddim --quick --out bench_output/deq_ddim.json    # T in 10 25, 4 inversions at T=10, 60 s

Sampling, per T: wall time, UNet image evaluations, sequential depth (batched chain evaluations) and the max
abs error of the final image against DDIMPipeline's, per iteration for the two parallel methods ("equal
tolerance" = the first iteration whose error is <= 1e-3). Inversion: MSE against wall time for DDIM ODE
inversion, DEQ-DDIM (Anderson warm start + phantom gradient, tau = 0.1) from the equilibrium start (the
inverse chain solved as one fixed point) and from the ODE inversion (the paper's start), and Adam through
the sequential chain from each start; times to the sequential baseline's final MSE, as ratios.

The timed sampling runs record nothing per iteration (a readout would synchronise every step); the error per
iteration comes from a second, untimed run of the same method. ``--device cuda`` runs everything on the GPU
(the same CPU-drawn x_T, moved there) and synchronises before each clock read.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CHECKPOINT = "model_cards/ddim-digits-16"
MATCH = 1e-3


def _paradigms(unet, scheduler_config, x_T, T: int, tolerance: float, parallel: int, on_iter=None):
    """The ParaDiGMS Picard loop of StableDiffusionParadigmsPipeline (ODE branch) for a UNet2DModel."""
    from diffusers import DDIMParallelScheduler

    sched = DDIMParallelScheduler.from_config(scheduler_config)
    sched.set_timesteps(T)
    ts = sched.timesteps  # on the host for the variances, on the images' device for the UNet
    B = x_T.shape[0]
    buf = torch.stack([x_T] * (T + 1))
    inv_var = 1.0 / torch.tensor([sched._get_variance(ts[j]) for j in range(T)] + [0])
    ts = ts.to(x_T.device)
    inv_var = inv_var[:, None].to(x_T.device) / x_T[0].numel()
    begin, end, calls, images = 0, min(parallel, T), 0, 0
    while begin < T:
        n = end - begin
        block = buf[begin:end]
        t_vec = ts[begin:end, None].repeat(1, B)
        out = unet(block.flatten(0, 1), t_vec.flatten(0, 1)).sample
        calls, images = calls + 1, images + n * B
        den = sched.batch_step_no_noise(
            model_output=out, timesteps=t_vec.flatten(0, 1), sample=block.flatten(0, 1)
        ).reshape(block.shape)
        new = buf[begin][None] + torch.cumsum(den - block, dim=0)
        err = torch.linalg.norm((new - buf[begin + 1 : end + 1]).reshape(n, B, -1), dim=-1).pow(2)
        ratio = torch.nn.functional.pad(err * inv_var[begin + 1 : end + 1], (0, 0, 0, 1), value=1e9)
        ind = int(torch.argmax(torch.max(ratio > tolerance**2, dim=1).values.int()))
        buf[begin + 1 : end + 1] = new
        begin = begin + min(1 + ind, parallel)
        end = min(begin + parallel, T)
        if on_iter is not None:
            on_iter(buf[-1])
    return buf[-1], calls, images


def _clock(device: torch.device) -> float:
    """Wall seconds once the device has finished what was queued (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def bench_sampling(pipe, T: int, batch: int, seed: int = 0) -> dict:
    from diffusers import DDIMPipeline, DDIMScheduler

    device = pipe.unet.device
    x_T = torch.randn(pipe._image_shape(batch), generator=torch.Generator().manual_seed(seed)).to(device)
    ref_pipe = DDIMPipeline(unet=pipe.unet, scheduler=DDIMScheduler.from_config(pipe.scheduler.config))
    ref_pipe.set_progress_bar_config(disable=True)
    t0 = _clock(device)
    gen = torch.Generator().manual_seed(seed)  # DDIMPipeline draws x_T itself: the same draw as x_T above
    ref = ref_pipe(batch_size=batch, generator=gen, num_inference_steps=T, output_type="pt").images * 2 - 1
    t_seq = _clock(device) - t0
    ref = ref.to(device)
    row = {"T": T, "batch": batch, "ddim_pipeline": {"seconds": t_seq, "unet_images": T * batch, "depth": T}}
    with torch.no_grad():
        errs: list[float] = []
        chain = pipe.chain(T)
        t0 = _clock(device)
        Z, stats = pipe.solve_chain(chain, x_T)
        t_deq = _clock(device) - t0
        pipe.solve_chain(chain, x_T, on_iterate=lambda Z: errs.append(float((Z[:, -1] - ref).abs().max())))
        final = float((Z[:, -1].clamp(-1, 1) - ref).abs().max())
        row["deq_ddim"] = {
            "seconds": t_deq,
            "unet_images": chain.unet_images,
            "depth": stats.nfe,
            "solver": stats.solver,
            "safeguard_nfe": stats.extra.get("safeguard_nfe", 0),
            "max_abs_error": final,
            "error_per_iteration": errs,
            "residual_trace": stats.trace.tolist(),
            "iterations_to_match": next((i + 1 for i, e in enumerate(errs) if e <= MATCH), None),
        }
        perrs: list[float] = []
        t0 = _clock(device)
        out, calls, images = _paradigms(pipe.unet, pipe.scheduler.config, x_T, T, tolerance=1e-3, parallel=T)
        t_par = _clock(device) - t0
        _paradigms(pipe.unet, pipe.scheduler.config, x_T, T, tolerance=1e-3, parallel=T,
                   on_iter=lambda x: perrs.append(float((x - ref).abs().max())))  # fmt: skip
        row["paradigms_picard"] = {
            "seconds": t_par,
            "unet_images": images,
            "depth": calls,
            "tolerance": 1e-3,
            "max_abs_error": float((out.clamp(-1, 1) - ref).abs().max()),
            "error_per_iteration": perrs,
            "iterations_to_match": next((i + 1 for i, e in enumerate(perrs) if e <= MATCH), None),
        }
    row["deq_over_ddim_time"] = t_deq / t_seq
    return row


def _sequential_backprop(pipe, chain, x_start, target, budget: float, lr: float, t_offset: float) -> list:
    """Adam on x_T through the T-step sequential chain for `budget` seconds: [(seconds, mean mse)]."""
    from deqzoo.pipelines.deq_ddim.pipeline_deq_ddim import _mse01

    param = torch.nn.Parameter(x_start.clone())
    opt = torch.optim.Adam([param], lr=lr)
    pipe.unet.requires_grad_(False)
    hist, t0 = [], time.perf_counter()
    try:
        while time.perf_counter() - t0 < budget:
            out = chain.sequential(param)[:, -1]
            loss = ((out - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            hist.append((t_offset + time.perf_counter() - t0, float(_mse01(out.detach(), target).mean())))
    finally:
        pipe.unet.requires_grad_(True)
    return hist


INVERSION_METHODS = {
    "deq_ddim": "DEQ-DDIM (equilibrium start + phantom)",
    "deq_ddim_ode_start": "DEQ-DDIM (ODE start + phantom, the paper)",
    "sequential_backprop": "sequential backprop (ODE start)",
    "sequential_backprop_equilibrium_start": "sequential backprop (equilibrium start)",
}


def bench_inversion(pipe, T: int, n: int, budget: float, lrs: list[float]) -> dict:
    """Inversion of n held-out digits at T steps, each method and Adam learning rate for `budget` wall
    seconds, one after another: DDIM ODE inversion; DEQ-DDIM from the equilibrium start (the inverse chain
    solved as one fixed point, the default) and from the ODE inversion (the paper's start), both then Adam
    with phantom gradients through the fixed point; sequential backprop from the ODE inversion (the baseline)
    and from the same equilibrium start (so the two gradient phases compare from one point). Each method is
    reported at its best learning rate (lowest final MSE); every run is kept."""
    from deqzoo.pipelines.deq_ddim.pipeline_deq_ddim import _mse01
    from examples.deq_ddim.ddim_digits import load_split

    x, _ = load_split("inversion")
    target = x[:n].to(pipe.unet.device)
    images01 = (target + 1) / 2
    chain = pipe.chain(T)
    t0 = time.perf_counter()
    with torch.no_grad():
        x_ode = chain.invert_ode(target)
        rec = chain.sequential(x_ode)[:, -1]
    t_ode = time.perf_counter() - t0
    ode = {"seconds": t_ode, "mse": float(_mse01(rec, target).mean())}
    runs: dict[str, dict[str, dict]] = {key: {} for key in INVERSION_METHODS}
    for lr in lrs:
        for key, init in (("deq_ddim", "equilibrium"), ("deq_ddim_ode_start", "ode")):
            out = pipe.invert(
                images01, num_inference_steps=T, steps=10_000, lr=lr, time_budget=budget, init=init
            )
            runs[key][str(lr)] = {"history": out.history, "final_mse": float(out.mse.mean())}
        seq = [(t_ode, ode["mse"])] + _sequential_backprop(pipe, chain, x_ode, target, budget, lr, t_ode)
        runs["sequential_backprop"][str(lr)] = {"history": seq, "final_mse": min(m for _, m in seq)}
        # the same gradient baseline from DEQ-DDIM's equilibrium start (the start's time included)
        eq = pipe.invert(images01, num_inference_steps=T, steps=0, init="equilibrium")
        t_eq = eq.history[-1][0]
        seq = [(t_eq, float(eq.init_mse.mean()))] + _sequential_backprop(
            pipe, chain, eq.latents, target, budget - t_eq, lr, t_eq
        )
        runs["sequential_backprop_equilibrium_start"][str(lr)] = {
            "history": seq,
            "final_mse": min(m for _, m in seq),
        }
    best = {key: min(by_lr.items(), key=lambda kv: kv[1]["final_mse"]) for key, by_lr in runs.items()}
    result = {
        "T": T,
        "images": n,
        "budget_seconds": budget,
        "lrs": lrs,
        "ddim_ode_inversion": ode,
        **{key: {"lr": float(lr), **run, "runs": runs[key]} for key, (lr, run) in best.items()},
    }

    def time_to(history, level):
        return next((t for t, m in history if m <= level), None)

    def at(history, seconds):
        return min((m for t, m in history if t <= seconds), default=None)

    seq_final = result["sequential_backprop"]["final_mse"]
    times = {key: time_to(result[key]["history"], seq_final) for key in INVERSION_METHODS}
    base = times["sequential_backprop"]
    result["time_to_sequential_final_mse"] = {
        **times,
        **{f"ratio_{key}": (times[key] / base) if times[key] and base else None for key in INVERSION_METHODS},
    }
    result["best_mse_at_seconds"] = {
        str(s): {key: at(result[key]["history"], s) for key in INVERSION_METHODS}
        for s in (budget / 10, budget / 4, budget / 2, budget)
    }
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["sampling"]:
        ax[0].semilogy(
            range(1, len(row["deq_ddim"]["error_per_iteration"]) + 1),
            [max(e, 1e-8) for e in row["deq_ddim"]["error_per_iteration"]],
            label=f"DEQ-DDIM T={row['T']}",
        )
        ax[0].semilogy(
            range(1, len(row["paradigms_picard"]["error_per_iteration"]) + 1),
            [max(e, 1e-8) for e in row["paradigms_picard"]["error_per_iteration"]],
            "--",
            label=f"ParaDiGMS Picard T={row['T']}",
        )
    ax[0].axhline(MATCH, color="k", lw=0.5)
    ax[0].set(
        xlabel="parallel iteration (batched UNet call)",
        ylabel="max |x0 - DDIMPipeline x0|",
        title="sampling: error vs sequential",
    )
    ax[0].legend(fontsize=7)
    inv = result["inversion"]
    for key, label in INVERSION_METHODS.items():
        h = inv[key]["history"]
        # steps: an MSE is known only once its step (or the equilibrium start) has finished
        ax[1].plot([t for t, _ in h], [m for _, m in h], drawstyle="steps-post",
                   label=f"{label}, lr {inv[key]['lr']:g}")
    ode = inv["ddim_ode_inversion"]
    ax[1].scatter([ode["seconds"]], [ode["mse"]], color="k", label="DDIM ODE inversion")
    ax[1].set(
        xlabel="wall seconds",
        ylabel="reconstruction MSE",
        yscale="log",
        title=f"inversion, {inv['images']} held-out digits, T={inv['T']}",
    )
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench deq-ddim", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_output/deq_ddim.json"))
    p.add_argument("--checkpoint", default=CHECKPOINT)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds per inversion run")
    p.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05], help="Adam learning rates")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--Ts", type=int, nargs="+", default=None, help="sampling steps (default 10 25 50 100)")
    p.add_argument("--sampling-from", type=Path, default=None,
                   help="take the sampling rows from this earlier JSON (inversion only)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.solvers import check_device
    from deqzoo.pipelines.deq_ddim import DEQDDIMPipeline

    check_device(args.device, "deqzoo bench deq-ddim")
    pipe = DEQDDIMPipeline.from_pretrained(args.checkpoint).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    Ts = args.Ts or ([10, 25] if args.quick else [10, 25, 50, 100])
    batch = args.batch or (2 if args.quick else 4)
    result = {"checkpoint": args.checkpoint, "threads": 1, "device": args.device, "sampling": []}
    if args.sampling_from is not None:
        result["sampling"] = json.loads(args.sampling_from.read_text())["sampling"]
        result["sampling_from"] = str(args.sampling_from)
    for T in Ts if args.sampling_from is None else []:
        result["sampling"].append(bench_sampling(pipe, T, batch))
        print(json.dumps({k: v for k, v in result["sampling"][-1].items()}, default=str)[:600], flush=True)
    result["inversion"] = bench_inversion(
        pipe,
        10 if args.quick else 25,
        4 if args.quick else 16,
        args.budget or (60.0 if args.quick else 150.0),
        args.lrs,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
