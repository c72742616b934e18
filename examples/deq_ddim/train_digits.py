"""Train a small DDPM noise-prediction UNet2DModel on sklearn digits (16x16) on CPU; export a diffusers repo.

The result is a standard diffusers repository (model_index.json naming `DDIMPipeline`, unet/, scheduler/ with
a `DDIMScheduler`) holding the EMA weights, loadable by stock diffusers and by `deqzoo.DEQDDIMPipeline`.

    nohup env PYTHONPATH=$PWD python examples/deq_ddim/train_digits.py --work outputs/ddim-digits \
        --out outputs/ddim-digits/repo --max-steps 1520 --schedule-steps 4000 --minutes 1000 \
        > outputs/ddim-digits.log 2>&1 &

(The embedded checkpoint's run was started with `--max-steps 4000 --minutes 72` and stopped by the time budget
at step 1520; the command above replays exactly those 1520 steps.)

Resumable: the work folder holds `resume.safetensors` (model, EMA, optimizer moments, RNG) and `resume.json`
(step, elapsed seconds); rerunning the same command continues where it stopped. The data split is
`examples.deq_ddim.ddim_digits.load_split("train")` (1,200 images); the seed fixes init, batches and noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_ddim.ddim_digits import RESOLUTION, load_split

UNET_CONFIG = dict(
    sample_size=RESOLUTION,
    in_channels=1,
    out_channels=1,
    layers_per_block=1,
    block_out_channels=(32, 64, 64),
    down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    norm_num_groups=8,
)
# cosine schedule: the linear one destroys a 16x16 image too early in the chain (Nichol & Dhariwal 2021)
SCHEDULE = dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon")


def _flat_optimizer_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = torch.as_tensor(v).clone()
    return out


def _load_optimizer_state(opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        _, i, k = key.split(".", 2)
        state.setdefault(int(i), {})[k] = v
    sd["state"] = state
    opt.load_state_dict(sd)


def export(ema: torch.nn.Module, out: Path) -> None:
    """Write the EMA UNet + DDIMScheduler as a diffusers repository (only the files diffusers writes)."""
    from diffusers import DDIMPipeline, DDIMScheduler

    DDIMPipeline(unet=ema, scheduler=DDIMScheduler(**SCHEDULE)).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="folder for resumable state")
    p.add_argument("--out", type=Path, required=True, help="diffusers repository to write")
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="horizon of the cosine learning-rate decay (default: --max-steps)")
    p.add_argument("--minutes", type=float, default=70.0, help="wall-clock budget over all resumed runs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    from diffusers import DDPMScheduler, UNet2DModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, _ = load_split("train")
    model = UNet2DModel(**UNET_CONFIG)
    ema = UNet2DModel(**UNET_CONFIG)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    noise_sched = DDPMScheduler(**SCHEDULE)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)

    args.work.mkdir(parents=True, exist_ok=True)
    rs, rj = args.work / "resume.safetensors", args.work / "resume.json"
    step, elapsed, losses = 0, 0.0, []
    if rs.exists() and rj.exists():
        flat = load_file(str(rs))
        model.load_state_dict({k[6:]: v for k, v in flat.items() if k.startswith("model.")})
        ema.load_state_dict({k[4:]: v for k, v in flat.items() if k.startswith("ema.")})
        _load_optimizer_state(opt, {k: v for k, v in flat.items() if k.startswith("opt.")})
        gen.set_state(flat["rng"])
        meta = json.loads(rj.read_text())
        step, elapsed, losses = meta["step"], meta["elapsed"], meta["losses"]
        print(f"resumed at step {step} ({elapsed / 60:.1f} min)", flush=True)
    print(f"UNet2DModel {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    def save() -> None:
        flat = {f"model.{k}": v for k, v in model.state_dict().items()}
        flat |= {f"ema.{k}": v for k, v in ema.state_dict().items()}
        flat |= _flat_optimizer_state(opt)
        flat["rng"] = gen.get_state()
        save_file(flat, str(rs) + ".tmp")
        Path(str(rs) + ".tmp").replace(rs)
        rj.write_text(
            json.dumps({"step": step, "elapsed": elapsed, "losses": losses, "args": vars(args)}, default=str)
        )
        export(ema, args.out)

    budget = args.minutes * 60
    bar = tqdm(total=args.max_steps, initial=step, mininterval=10, desc="train")
    run_loss, t_last = 0.0, time.time()
    while step < args.max_steps and elapsed < budget:
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        horizon = args.schedule_steps or args.max_steps
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))) * 0.9 + 0.1
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(x_train), (args.batch_size,), generator=gen)
        x0 = x_train[idx]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, SCHEDULE["num_train_timesteps"], (args.batch_size,), generator=gen)
        loss = torch.nn.functional.mse_loss(model(noise_sched.add_noise(x0, noise, t), t).sample, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        run_loss += loss.item()
        now = time.time()
        elapsed += now - t_last
        t_last = now
        bar.update(1)
        if step % args.save_every == 0 or step == args.max_steps or elapsed >= budget:
            losses.append([step, run_loss / (step % args.save_every or args.save_every)])
            bar.set_postfix(loss=f"{losses[-1][1]:.4f}", min=f"{elapsed / 60:.1f}")
            run_loss = 0.0
            save()
    bar.close()
    save()
    print(
        f"done: step {step}, {elapsed / 60:.1f} min, "
        f"last loss {losses[-1][1] if losses else float('nan'):.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
