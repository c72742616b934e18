"""Long, resumable fits of `camera` (issue #32): one network per process, its whole state saved every K steps.

The networks are the implicit2 bench's representation settings (`benchmarks/implicit2.py`, the embedded
cards' runs): the same data (`examples.implicit2.images.image_data("camera", size)`), seed, initialisation,
input scale, optimizer (full-batch Adam, lr 1e-3) and training step (`examples.implicit2.fitting.Fitter`:
fixed-point reuse with a tolerance-checked solve, NPG T = 1, the spectral projection after every step):

    siren-imp-1l256d   iSIREN 1L-256D (the card implicit2-isiren-camera)
    gabor-imp-1l256d   Gabor-iMFN 1L-256D (the card implicit2-igabor-mfn-camera)
    siren-exp-4l256d   explicit SIREN 4L-256D (the twin trained the same steps)
    gabor-exp-4l256d   explicit Gabor MFN 4L-256D

    python -m examples.implicit2.train_long train siren-imp-1l256d --steps 5000 --out runs/siren-imp-1l256d
    python -m examples.implicit2.train_long plot runs/* --out psnr_vs_step.png

``train`` resumes from OUT/latest when OUT holds a run of the same network, size, seed and learning rate (a
different one is an error: nothing in OUT is overwritten by another run), so rerunning the same command (or
one with a larger --steps) continues; SIGTERM / Ctrl-C save the state of the last finished step and exit.
A resumed run equals an uninterrupted one (tests/examples/test_implicit2_train_long.py).

OUT holds:
- ``run.json``: the network and its settings (checked on resume);
- ``state-NNNNNN/`` (the latest only; ``latest`` names it, replaced atomically after the folder is
  complete): ``config.json`` + ``model.safetensors`` (a `save_pretrained` checkpoint: `from_pretrained`
  loads it), ``optimizer.safetensors`` (Adam's moments and step counts), ``trainer.safetensors`` (the
  fixed-point cache's state, the spectral projector's power-iteration vectors, torch's RNG state) and
  ``trainer.json`` (step, Adam's hyperparameters, the history); no pickle anywhere;
- ``psnr.json``: PSNR (dB, every pixel, from a zero initial state: the task's `psnr` on `values_at`, what
  `deqzoo eval` computes) against step, every --eval-every steps and at step 0 and the last step, with the
  evaluation solve's f-evaluations, the training loss/f-evaluations per step and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.implicit2 import _build, paper_input_scale

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.implicit2.fitting import Fitter

NETWORKS: dict[str, dict[str, Any]] = {
    "siren-imp-1l256d": {"filter": "siren", "implicit": True, "layers": 1, "width": 256},
    "gabor-imp-1l256d": {"filter": "gabor", "implicit": True, "layers": 1, "width": 256},
    "siren-exp-4l256d": {"filter": "siren", "implicit": False, "layers": 4, "width": 256},
    "gabor-exp-4l256d": {"filter": "gabor", "implicit": False, "layers": 4, "width": 256},
}
CACHE_KEY = "default"  # the key Implicit2Model stores its fixed point under (its forward's default)
_STATE_RE = re.compile(r"^state-(\d{6})$")
# what must match for a resume; a run.json written before a key existed holds its default
_RUN_DEFAULTS = {"input_scale_factor": 1.0}
_RUN_KEYS = ("network", "image", "size", "seed", "lr", "input_scale_factor")


def setting(network: str, size: int, image: str = "camera", input_scale_factor: float = 1.0
            ) -> dict[str, Any]:
    """The bench's representation setting of `network` (`benchmarks.implicit2._settings`, group rep), its
    input scale (the filters' frequency scale) times `input_scale_factor`: 1 is the original's frequencies per
    pixel; the iSIREN card's run uses 4 (at the original's, iSIREN plateaus near 27 dB at 256²: README,
    section 6)."""
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; choose one of {sorted(NETWORKS)}")
    if not (isinstance(input_scale_factor, (int, float)) and 0 < input_scale_factor < 1e3):
        raise ValueError(f"input_scale_factor must be a number in (0, 1000), got {input_scale_factor!r}")
    net = NETWORKS[network]
    return {"name": f"rep-{network}", "group": "rep", **net, "T": 1, "reuse": True,
            "input_scale": paper_input_scale(net["filter"], size) * input_scale_factor, "image": image,
            "size": size, "split": "full"}


# ---------------------------------------------------------------------------------------------------------
# state <-> safetensors + json


def _json_dump_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Adam's state_dict split into tensors (``state.<param index>.<name>``) and JSON-able param groups."""
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().clone().contiguous()
               for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    for i, st in sd["state"].items():
        extra = [k for k, v in st.items() if not isinstance(v, torch.Tensor)]
        if extra:  # Adam keeps only tensors per parameter; anything else would be lost silently
            raise TypeError(f"optimizer state of parameter {i} has non-tensor entries {extra}")
    return tensors, sd["param_groups"]


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                   groups: list[dict[str, Any]], where: Path) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"state\.(\d+)\.(\w+)", key)
        if m is None:
            raise ValueError(f"{where}: unexpected tensor {key!r} (expected state.<index>.<name>)")
        state.setdefault(int(m.group(1)), {})[m.group(2)] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in groups]
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise ValueError(f"{where}: optimizer state does not fit this network: {e}") from e


def trainer_tensors(fitter: Fitter, coords: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The fixed-point cache's stored state, the projector's power-iteration vectors and torch's RNG state."""
    tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
    counters: dict[str, int] = {}
    cache = fitter.cache
    if cache is not None:
        model = fitter.model
        x = model.implicit2.check_coordinates(coords)  # the key input the model's forward stores under
        default = x.new_zeros((*x.shape[:-1], model.config.hidden_size))
        hits, misses = cache.hits, cache.misses
        z = cache.initial(CACHE_KEY, default, key_input=x)  # a copy of the stored state (public API)
        cache.hits, cache.misses = hits, misses  # reading it is not a use
        if z is not default:
            tensors["cache.z"] = z.contiguous()
        counters = {"cache_hits": hits, "cache_misses": misses}
    if fitter.projector is not None:
        # SpectralProjector keeps its warm-start vectors in `_u` (no public state_dict yet): without them a
        # resumed projector would restart from 100 power iterations and the run would drift from the
        # uninterrupted one
        for i, u in enumerate(fitter.projector._u):
            if u is not None:
                tensors[f"projector.u.{i}"] = u.detach().clone().contiguous()
    return tensors, counters


def load_trainer(fitter: Fitter, coords: torch.Tensor, tensors: dict[str, torch.Tensor],
                 counters: dict[str, int], where: Path) -> None:
    model = fitter.model
    z = tensors.get("cache.z")
    if z is not None:
        if fitter.cache is None:
            raise ValueError(f"{where}: holds a fixed-point cache but this run has no reuse")
        x = model.implicit2.check_coordinates(coords)
        want = (*x.shape[:-1], model.config.hidden_size)
        if tuple(z.shape) != want:
            raise ValueError(f"{where}: cache.z has shape {tuple(z.shape)}, this network's state {want}")
        fitter.cache.store(CACHE_KEY, z, key_input=x)
    if fitter.cache is not None:
        fitter.cache.hits = int(counters.get("cache_hits", 0))
        fitter.cache.misses = int(counters.get("cache_misses", 0))
    if fitter.projector is not None:
        us = fitter.projector._u  # see trainer_tensors
        for i, w in enumerate(fitter.projector.weights):
            u = tensors.get(f"projector.u.{i}")
            if u is not None and tuple(u.shape) != (w.shape[0],):
                raise ValueError(
                    f"{where}: projector.u.{i} has shape {tuple(u.shape)}, expected ({w.shape[0]},)")
            us[i] = u
    torch.set_rng_state(tensors["rng"])


def latest_state(out: Path) -> Path | None:
    """OUT/latest's state folder, or None for a new run (an unfinished state-* folder is never read)."""
    pointer = out / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not _STATE_RE.match(name) or not (out / name).is_dir():
        raise ValueError(f"{pointer} names {name!r}, not a state-NNNNNN folder in {out}")
    return out / name


def save_state(out: Path, fitter: Fitter, coords: torch.Tensor, step: int, history: dict[str, Any]) -> Path:
    """Write state-<step>/ completely, then point OUT/latest at it (atomic replace), then remove the older
    state folders this program wrote: an interruption at any point leaves a readable latest state."""
    final = out / f"state-{step:06d}"
    tmp = out / f"{final.name}.tmp"
    if tmp.exists():  # a save of ours interrupted earlier
        shutil.rmtree(tmp)
    tmp.mkdir()
    fitter.model.save_pretrained(tmp, safe_serialization=True)
    opt_tensors, groups = optimizer_tensors(fitter.opt)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    tr_tensors, counters = trainer_tensors(fitter, coords)
    save_file(tr_tensors, str(tmp / "trainer.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps(
        {"step": step, "param_groups": groups, "counters": counters, "history": history}))
    if final.exists():  # the same step saved before (a rerun with the same --steps): ours, replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(out / "latest", final.name)
    for p in out.iterdir():
        m = _STATE_RE.match(p.name)
        if m and p.is_dir() and p != final:
            shutil.rmtree(p)
    return final


def load_state(state: Path, fitter: Fitter, coords: torch.Tensor) -> tuple[int, dict[str, Any]]:
    """Restore weights, Adam, the cache, the projector and the RNG from `state`; returns (step, history)."""
    for f in ("model.safetensors", "optimizer.safetensors", "trainer.safetensors", "trainer.json"):
        if not (state / f).is_file():
            raise ValueError(f"{state}: missing {f}; the state folder is incomplete")
    weights = load_file(str(state / "model.safetensors"))
    missing, unexpected = fitter.model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"{state / 'model.safetensors'}: does not fit this network "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    meta = json.loads((state / "trainer.json").read_text())
    load_optimizer(fitter.opt, load_file(str(state / "optimizer.safetensors")), meta["param_groups"],
                   state / "optimizer.safetensors")
    load_trainer(fitter, coords, load_file(str(state / "trainer.safetensors")), meta.get("counters", {}),
                 state / "trainer.safetensors")
    return int(meta["step"]), meta["history"]


# ---------------------------------------------------------------------------------------------------------
# training


@torch.no_grad()
def evaluate_psnr(model, data) -> tuple[float, float | None]:
    """PSNR (dB) over every pixel from a zero initial state and the solve's f-evaluations: what
    `examples.implicit2.images.evaluate` computes (unrounded)."""
    from examples.implicit2.images import psnr

    model.eval()
    values, stats = model.values_at(data.test_coords)
    return psnr(values, data.test_values), (float(max(s.nfe for s in stats)) if stats else None)


def _new_history() -> dict[str, Any]:
    return {"loss": [], "nfe": [], "residual": [], "step_time": [], "eval": []}


def _write_psnr(out: Path, run: dict[str, Any], history: dict[str, Any], step: int) -> None:
    evals = history["eval"]
    _json_dump_atomic(out / "psnr.json", {
        **run, "step": step, "train_seconds": sum(history["step_time"]),
        "eval_steps": [e[0] for e in evals], "psnr": [e[1] for e in evals], "eval_nfe": [e[2] for e in evals],
        "loss": history["loss"], "nfe": history["nfe"],
    })


def _resumed_model(state: Path, built):
    """The network a run continues with: its own saved config (the recipe it started with, e.g. its solver
    tolerance), not what today's defaults would build; a difference is reported."""
    from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation

    if not (state / "config.json").is_file():
        raise ValueError(f"{state}: missing config.json; the state folder is incomplete")
    saved = Implicit2Config.from_pretrained(str(state))
    if saved.deq_config != built.config.deq_config:
        print(f"note: resuming with the run's own solver settings {saved.deq_config} (today's defaults "
              f"would build {built.config.deq_config})", file=sys.stderr)
    return Implicit2ForSignalRepresentation(saved)


class _StopFlag:
    """Set by SIGTERM / SIGINT: the loop saves after the step in progress and exits."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:
        self.signal = signum


def train(network: str, out: Path, steps: int, *, size: int = 256, image: str = "camera", seed: int = 0,
          lr: float = 1e-3, save_every: int = 50, eval_every: int = 50, progress: bool = True,
          stop_after: int | None = None, input_scale_factor: float = 1.0) -> dict[str, Any]:
    """Train `network` to `steps` total steps in `out`, resuming from out/latest. `stop_after`: return
    after this many steps of this call (saved; what an interruption does, for tests). Returns psnr.json's
    content."""
    from tqdm.auto import tqdm

    from examples.implicit2.images import image_data

    for name, v in (("steps", steps), ("save_every", save_every), ("eval_every", eval_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    run = {"network": network, "image": image, "size": size, "seed": seed, "lr": lr,
           "input_scale_factor": float(input_scale_factor)}
    s = setting(network, size, image, input_scale_factor)
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    if run_file.exists():
        old = json.loads(run_file.read_text())
        diff = {k: (old.get(k, _RUN_DEFAULTS.get(k)), run[k]) for k in _RUN_KEYS
                if old.get(k, _RUN_DEFAULTS.get(k)) != run[k]}
        if diff:
            raise ValueError(f"{out} holds another run ({run_file}: {diff} as (there, asked)); "
                             "choose another --out")
    elif any(out.iterdir()):
        raise ValueError(f"{out} is not empty and holds no run.json; choose an empty or new folder")
    else:
        _json_dump_atomic(run_file, {**run, "setting": s})

    data = image_data(image, size)
    model = _build(s, data, seed)
    state = latest_state(out)
    if state is not None:
        model = _resumed_model(state, model)
    fitter = Fitter(model, data.train_coords, data.train_values, lr=lr, reuse=s["reuse"])
    if state is not None:
        start, history = load_state(state, fitter, data.train_coords)
    else:
        start, history = 0, _new_history()
        history["eval"].append([0, *evaluate_psnr(model, data)])
    if start >= steps:
        _write_psnr(out, run, history, start)
        return json.loads((out / "psnr.json").read_text())

    stop = _StopFlag()
    old_handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(total=steps, initial=start, desc=network, disable=not progress, mininterval=10, ascii=True,
               dynamic_ncols=False, ncols=100)
    step = start
    try:
        while step < steps:
            rec = fitter.step()
            step += 1
            for key in ("loss", "nfe", "residual", "step_time"):
                history[key].append(rec[key])
            bar.update(1)
            if step % eval_every == 0 or step == steps:
                score, enfe = evaluate_psnr(model, data)
                history["eval"].append([step, score, enfe])
                bar.set_postfix(psnr=f"{score:.2f}")
                bar.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {network} step {step}: PSNR {score:.3f} dB "
                          f"(eval f-evals {enfe}), train f-evals {rec['nfe']}, "
                          f"{sum(history['step_time']) / 60:.1f} min trained", file=sys.stderr)
                _write_psnr(out, run, history, step)
            done_here = step - start
            halt = stop.signal is not None or (stop_after is not None and done_here >= stop_after)
            if step % save_every == 0 or step == steps or halt:
                save_state(out, fitter, data.train_coords, step, history)
                _write_psnr(out, run, history, step)
            if halt:
                if stop.signal is not None:
                    bar.write(f"{network}: signal {stop.signal}, saved at step {step}; rerun to resume",
                              file=sys.stderr)
                break
    finally:
        bar.close()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    return json.loads((out / "psnr.json").read_text())


# ---------------------------------------------------------------------------------------------------------
# curves


def plot(runs: list[Path], out: Path, target: float = 32.0) -> list[dict[str, Any]]:
    """PSNR against step of every run folder (their psnr.json) in one PNG; returns one summary per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        path = run / "psnr.json"
        if not path.is_file():
            raise ValueError(f"{run}: no psnr.json (not a train_long.py run folder)")
        r = json.loads(path.read_text())
        net = NETWORKS.get(r["network"], {})
        factor = r.get("input_scale_factor", 1.0)  # psnr.json written before the option: the original's
        label = r["network"] + (f", input scale x{factor:g}" if factor != 1 else "")
        colors = ("C0", "C2") if net.get("filter") == "siren" else ("C1", "C3")  # (original's scale, other)
        color = colors[factor != 1]
        ax.plot(r["eval_steps"], r["psnr"], "-" if net.get("implicit") else "--", color=color, label=label)
        reached = next((st for st, p in zip(r["eval_steps"], r["psnr"]) if p >= target), None)
        rows.append({"run": str(run), "network": r["network"], "input_scale_factor": factor,
                     "step": r["step"],
                     "psnr": r["psnr"][-1] if r["psnr"] else None, "best_psnr": max(r["psnr"], default=None),
                     f"first_step_at_{target:g}dB": reached, "train_minutes": r["train_seconds"] / 60})
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("PSNR (dB), every pixel")
    ax.set_title("camera 256², full-batch Adam lr 1e-3 (solid: implicit 1L, dashed: explicit 4L)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (or resume) one network")
    t.add_argument("network", choices=sorted(NETWORKS))
    t.add_argument("--out", type=Path, required=True,
                   help="the run folder (created; resumed if it holds this run)")
    t.add_argument("--steps", type=int, default=5000, help="total steps (the original's 5000)")
    t.add_argument("--size", type=int, default=256)
    t.add_argument("--image", default="camera")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--input-scale-factor", type=float, default=1.0,
                   help="the filters' frequency scale times this (1: the original's per pixel)")
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--threads", type=int, default=1, help="torch threads (1: leave the machine to others)")
    q = sub.add_parser("plot", help="PSNR-vs-step curve of several run folders")
    q.add_argument("runs", type=Path, nargs="+")
    q.add_argument("--out", type=Path, required=True, help="the PNG to write")
    q.add_argument("--target", type=float, default=32.0)
    args = p.parse_args(argv)
    if args.cmd == "plot":
        for row in plot(args.runs, args.out, args.target):
            print(json.dumps(row))
        return 0
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would fill the progress log at every save
    try:
        r = train(args.network, args.out, args.steps, size=args.size, image=args.image, seed=args.seed,
                  lr=args.lr, save_every=args.save_every, eval_every=args.eval_every,
                  input_scale_factor=args.input_scale_factor)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.network}: step {r['step']}, PSNR {r['psnr'][-1]:.3f} dB at step {r['eval_steps'][-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
