"""Fitting an Implicit² (or explicit) representation to an image: the implicit2 checkpoints' training loop.

Full-batch Adam with the original's recipe: fixed-point reuse across steps (`deqzoo.core.FixedPointCache`),
the spectral bound on W kept after every step (`deqzoo.core.SpectralProjector`), NPG with T = 1 (the model
config's backward mode). `make_cards.py` and `benchmarks/implicit2.py` use it; run it alone for a quick fit:

    python examples/implicit2/fitting.py --image camera --size 32 --steps 50
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from deqzoo.core import FixedPointCache, SpectralProjector

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _SavedBytes:
    """Bytes of the distinct tensor storages autograd saves for backward during one step (activation
    memory)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
            self.storages[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class Fitter:
    """One full-batch training run's state (Adam, the fixed-point cache, the spectral projector) and its step.

    ``step(measure_memory=False)`` takes one optimizer step and returns ``loss``, ``nfe`` (forward-solve
    f-evaluations, 0 for explicit networks), ``residual`` (the solve's relative residual), ``step_time``
    (seconds) and, when measured, ``saved_bytes`` (tensors saved for backward). `fit` loops over it; the
    bench alternates the steps of two Fitters to time them under the same machine load.

    Example:
        >>> import torch
        >>> from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
        >>> from examples.implicit2.fitting import Fitter
        >>> from examples.implicit2.images import image_data
        >>> data = image_data("camera", 8)
        >>> model = Implicit2ForSignalRepresentation(Implicit2Config(hidden_size=16, filter_type="gabor"))
        >>> record = Fitter(model, data.train_coords, data.train_values).step()
        >>> sorted(record)
        ['loss', 'nfe', 'residual', 'saved_bytes', 'step_time']
    """

    def __init__(
        self,
        model,
        coords: torch.Tensor,
        values: torch.Tensor,
        *,
        lr: float = 1e-3,
        reuse: bool = True,
        reuse_max_iter: int | None = None,
        project: bool = True,
    ):
        self.model, self.coords, self.values = model, coords, values
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        # reuse_max_iter=0 is the original's training forward: no solve once a fixed point is cached
        self.cache = FixedPointCache(hit_max_iter=reuse_max_iter) if reuse else None
        max_norm = model.config.spectral_max_norm
        self.projector = (
            SpectralProjector(model.spectral_weights(), max_norm) if project and max_norm else None
        )
        n_params = sum(p.numel() * p.element_size() for p in model.parameters())
        self.state_bytes = 4 * n_params  # weights, gradients, two Adam moments

    @torch.no_grad()
    def cold_nfe(self, tols: tuple[float, ...]) -> dict[str, int | None]:
        """f-evaluations a solve from zeros (no reuse) needs, on the current weights, to reach each relative
        tolerance in `tols` (None: not within f_max_iter): one solve to the tightest, read off its
        per-step residual trace (a fixed-point iteration stopped at tolerance t would stop there). Neither
        the cache nor the weights change."""
        model = self.model
        old_tol = model.config.deq_config.f_tol
        model.set_deq(f_tol=min(tols))
        try:
            trace = model(self.coords).deq_stats.trace.tolist()
        finally:
            model.set_deq(f_tol=old_tol)
        return {f"{t:g}": next((k + 1 for k, r in enumerate(trace) if r < t), None) for t in tols}

    @torch.no_grad()
    def returned_residual(self) -> float:
        """Relative residual ||f(z) - z|| / ||f(z)|| of the state the last step returned (the cached one),
        under the current weights: one f step from it in a forked cache, the training cache untouched."""
        if self.cache is None or not len(self.cache):
            raise RuntimeError("Fitter.returned_residual needs reuse (a cache) and one step taken")
        out = self.model(self.coords, fixed_point_cache=self.cache.fork(hit_max_iter=0))
        return float(out.deq_stats.rel_residual.max())

    def step(self, measure_memory: bool = False, measure_returned: bool = False) -> dict[str, Any]:
        model = self.model
        model.train()
        t0 = time.perf_counter()
        meter = _SavedBytes() if measure_memory else None
        hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t) if meter else nullcontext()
        with hooks:
            out = model(self.coords, self.values, fixed_point_cache=self.cache)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        stats = out.deq_stats
        record = {
            "loss": float(out.loss.detach()),
            "nfe": stats.nfe if stats is not None else 0,
            "residual": float(stats.rel_residual.max()) if stats is not None else 0.0,
            "saved_bytes": meter.total if meter else 0,
        }
        del out  # this step's graph goes now
        if measure_returned:  # before the optimizer step: the weights this step's output was computed with
            t_probe = time.perf_counter()
            record["returned_residual"] = self.returned_residual()
            t0 += time.perf_counter() - t_probe  # not part of the step's time
        self.opt.step()
        if self.projector is not None:
            self.projector.step()
        record["step_time"] = time.perf_counter() - t0
        return record


def fit(
    model,
    coords: torch.Tensor,
    values: torch.Tensor,
    steps: int,
    *,
    lr: float = 1e-3,
    reuse: bool = True,
    reuse_max_iter: int | None = None,
    project: bool = True,
    cold_tols: tuple[float, ...] = (),
    cold_at: tuple[int, ...] = (),
    measure_returned: bool = False,
    eval_every: int = 25,
    eval_at: tuple[int, ...] = (),
    eval_fn=None,
    memory_step: int = 5,
    progress: bool = True,
    desc: str = "fit",
) -> dict[str, Any]:
    """Full-batch Adam on (coords, values) for `steps` steps (a `Fitter`); returns the history.

    History: per step ``loss``, ``nfe`` (forward-solve f-evaluations, implicit models), ``residual`` (the
    solve's relative residual at its returned iterate) and ``step_time`` (seconds); every `eval_every`
    steps, at the steps in `eval_at` and at the end, ``eval`` = (step, eval_fn(model)) when eval_fn is given;
    ``saved_bytes`` = tensors saved for backward at step `memory_step`; ``state_bytes`` = parameters,
    gradients and Adam moments. `reuse_max_iter` is the solver budget on a reuse hit (0: the original's
    training forward, no solve; see `deqzoo.core.FixedPointCache`). Before each step in `cold_at`,
    ``cold_nfe`` gets (step, `Fitter.cold_nfe(cold_tols)`): the f-evaluations a solve from zeros would need
    at that step's weights (the without-reuse count, measured on the same weights). `measure_returned`
    adds ``returned_residual`` per step: the residual of the state each step returned, under that step's
    weights (`Fitter.returned_residual`; needs reuse).
    """
    from tqdm.auto import tqdm

    fitter = Fitter(model, coords, values, lr=lr, reuse=reuse, reuse_max_iter=reuse_max_iter,
                    project=project)
    hist: dict[str, Any] = {"loss": [], "nfe": [], "residual": [], "step_time": [], "eval": [],
                            "cold_nfe": [], "saved_bytes": 0, "state_bytes": fitter.state_bytes}
    for step in tqdm(range(1, steps + 1), desc=desc, disable=not progress, mininterval=5):
        if cold_tols and step in cold_at:
            hist["cold_nfe"].append((step, fitter.cold_nfe(cold_tols)))
        record = fitter.step(measure_memory=step == memory_step, measure_returned=measure_returned)
        if step == memory_step:
            hist["saved_bytes"] = record["saved_bytes"]
        if measure_returned:
            hist.setdefault("returned_residual", []).append(record["returned_residual"])
        for key in ("loss", "nfe", "residual", "step_time"):
            hist[key].append(record[key])
        if eval_fn is not None and (step % eval_every == 0 or step == steps or step in eval_at):
            model.eval()
            hist["eval"].append((step, eval_fn(model)))
    model.eval()
    return hist


def main(argv: list[str] | None = None) -> int:
    from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
    from examples.implicit2.images import image_data, psnr

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", default="camera")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    data = image_data(args.image, args.size)
    model = Implicit2ForSignalRepresentation(Implicit2Config(out_features=data.train_values.shape[-1]))
    fit(model, data.train_coords, data.train_values, args.steps, lr=args.lr)
    values, _ = model.values_at(data.test_coords)
    score = psnr(values, data.test_values)
    print(f"{args.image} {args.size}x{args.size}, {args.steps} steps: PSNR {score:.2f} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
