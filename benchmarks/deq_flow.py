"""DEQ-Flow vs its explicit RAFT twin: training-step memory and time at 12 and 24 update iterations, and
frame-to-frame fixed-point reuse along a synthetic video.

Memory, each configuration in a fresh subprocess (1 thread, seeded random pairs; the CPU preset at batch 4 of
64x64, and the original's B size at batch 1 of 192x192), with and without transformers' activation
checkpointing of the encoders (``--checkpointing off on``; per residual block, the same setting for both):
- ``step_peak_mb``: the peak of live tensor bytes over one whole training step (forward and backward: weights,
  gradients, saved activations, recomputation and transients), from the profiler's memory timeline.
- ``graph_mb``: the bytes of every tensor autograd saves for the backward pass during the forward (unique
  storages, parameters excluded), recorded by `torch.autograd.graph.saved_tensors_hooks`, and
  ``graph_by_part_mb``: the same split by the part that saved it (encoders, correlation, update block,
  upsampler, other). Plus ``param_mb`` (weights and gradients); ``peak_mb = param_mb + graph_mb``.
- ``rss_growth_mb``: growth of the process's peak resident set (``ru_maxrss``) over one training step, from
  just after a warm-up step on a 4x smaller batch (or the smallest image size), so the interpreter, torch,
  weights and thread pools are not counted.
DEQ-Flow runs its training recipe (forward solve without a graph, one-step phantom gradient) with one
supervised state and with 3 fixed-point-correction states, the latter also with the two-stage backward
(``two_stage``: `deqzoo.models.deq_flow.two_stage_backward`, encoders once, one state's graph at a time; the
graphs are built inside the backward, so ``graph_mb`` does not apply and only the step peak and RSS
measure it); RAFT backpropagates through every update (RAFT's sequence loss). Time is the median of 3
steps.

Reuse: a trained DEQ-Flow estimates the flow along `synthetic_video` (held-out photo, camera pan and a moving
face; 4 videos, seeds 0-3) pair by pair, starting each solve from zero or from the previous pair's fixed point
(each of `estimate_sequence`'s reuse modes: as is, flow forward-interpolated, RAFT's warm start, the whole
state warped with the content); NFE per pair, EPE against the exact flow.

    deqzoo bench deq-flow                      # -> bench_output/deq_flow/deq_flow_bench.json (+ PNG)
    deqzoo bench deq-flow --quick              # cpu scale, batch 2, at most 8 frames
    deqzoo bench deq-flow --no-training        # reuse only (the embedded checkpoint, its tolerance 5e-3)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import child_env

__all__ = [
    "enable_checkpointing",
    "first_within",
    "main",
    "measure_training",
    "reuse_along_video",
    "reuse_at_equal_accuracy",
    "reuse_budget_held_out",
    "reuse_start_residual",
    "step_peak_bytes",
]

DEFAULT_CHECKPOINT = "deqzoo/deq-flow-cpu-synth"


SCALES = {
    # name: (DEQ-Flow preset, batch, image side): the CPU preset as trained here, and the original's B size
    "cpu": ("deq-flow-cpu-synth", 4, 64),
    "b": ("deq-flow-b", 1, 192),
}


def _build(kind: str, preset: str, overrides: dict | None = None):
    """The preset (DEQ-Flow) or its explicit twin: the same config with implicit=False (same parameters);
    `overrides` change config fields of both alike (a wider update block, for example)."""
    from deqzoo.models.deq_flow import ARCHITECTURES, DEQFlowConfig, DEQFlowForOpticalFlow

    config = {**ARCHITECTURES[preset]["config"], **(overrides or {})}
    if kind != "deq-flow":
        config["implicit"] = False
    return DEQFlowForOpticalFlow(DEQFlowConfig(**config))


# which part of the model saved a tensor for backward: top-level children by name, plus the correlation
# pyramid's methods and the upsampler (methods the model calls directly, not modules)
_PARTS = {
    "feature_encoder": "encoders",
    "context_encoder": "encoders",
    "attention": "update block",
    "update_block": "update block",
    "mask_predictor": "upsampler",
}
PARTS = ("encoders", "correlation", "update block", "upsampler", "other")


@contextlib.contextmanager
def saved_by_part(model, exclude: set[int]):
    """Record {storage pointer: (bytes, part)} of every tensor autograd saves in this block (first saver
    wins), the part being the innermost labelled module or method running when it was saved."""
    import torch

    label = ["other"]
    saved: dict[int, tuple[int, str]] = {}
    handles, patched = [], []

    def push(part):
        return lambda *_: label.append(part)

    def pop(*_):  # a forward hook's non-None return would replace the module's output
        label.pop()

    for child, part in _PARTS.items():
        module = getattr(model, child, None)
        if module is not None:
            handles.append(module.register_forward_pre_hook(push(part)))
            handles.append(module.register_forward_hook(pop))

    def labelled(fn, part):
        def run(*args, **kwargs):
            label.append(part)
            try:
                return fn(*args, **kwargs)
            finally:
                label.pop()

        return run

    for owner, name, part in (
        (model, "build_pyramid", "correlation"),
        (model, "index_pyramid", "correlation"),
        (model, "upsample", "upsampler"),
        (model, "_encoder", "encoders"),  # under checkpointing: the block inputs the checkpoints keep
    ):
        setattr(owner, name, labelled(getattr(owner, name), part))  # instance attribute shadows the method
        patched.append((owner, name))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude and st.device.type == "cpu":
            saved.setdefault(st.data_ptr(), (st.nbytes(), label[-1]))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        for h in handles:
            h.remove()
        for owner, name in patched:
            delattr(owner, name)


def enable_checkpointing(model) -> None:
    """transformers' activation checkpointing (``activation_checkpointing_enable``, named
    ``gradient_checkpointing_enable`` before transformers 5.x deprecated that name)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def step_peak_bytes(step) -> int:
    """Peak of the live tensor bytes over one call of `step()` (forward and backward: weights, gradients,
    saved activations, recomputation and transients), from the profiler's memory timeline."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # export_memory_timeline: deprecated for CUDA users
        path = Path(tmp) / "memory.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return int(max(sum(row) for row in sizes))


def measure_training(
    kind: str,
    iters: int,
    *,
    preset: str = "deq-flow-cpu-synth",
    batch: int = 4,
    size: int = 64,
    n_states: int = 1,
    seed: int = 0,
    repeats: int = 3,
    checkpointing: bool = False,
    two_stage: bool = False,
    config: dict | None = None,
) -> dict:
    """One configuration in this process: saved-graph bytes (by part), parameter bytes, the step's tensor
    peak, peak RSS growth, step time. `checkpointing`: the encoders' activation checkpointing (transformers'
    ``gradient_checkpointing_enable``), on for both models alike. `two_stage`: DEQ-Flow's backward by
    `deqzoo.models.deq_flow.two_stage_backward` (saved-graph bytes are then None). `config`: config fields
    changed from the preset's, for both models alike (recorded in the row)."""
    import torch

    from deqzoo.models.deq_flow import two_stage_backward

    if two_stage and kind != "deq-flow":
        raise ValueError("two_stage applies to deq-flow only (RAFT's updates chain)")

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = _build(kind, preset, config).train()
    if checkpointing:
        enable_checkpointing(model)
    if model.config.implicit:
        model.set_deq(f_max_iter=iters, n_states=n_states, on_nonconvergence="ignore")
    else:
        model.config.num_flow_updates = iters
    gen = torch.Generator().manual_seed(seed)

    def batch_of(n: int, side: int):
        return (
            torch.rand(n, 3, side, side, generator=gen),
            torch.rand(n, 3, side, side, generator=gen),
            torch.randn(n, 2, side, side, generator=gen) * 3,
        )

    def step(a, b, gt):
        model.zero_grad(set_to_none=False)
        if two_stage:
            two_stage_backward(model, a, b, gt)
            return
        out = model(a, b, flow_gt=gt)
        out.loss.backward()

    # warm-up on a smaller problem: gradients allocated, kernels and pools initialised, below the step's peak
    warm = (max(1, batch // 4), size) if batch >= 4 else (batch, model.config.min_image_size)
    step(*batch_of(*warm))
    data = batch_of(batch, size)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    graph_bytes = by_part = None
    if two_stage:
        step(*data)
    else:
        with saved_by_part(model, params) as saved:
            model.zero_grad(set_to_none=False)
            out = model(*data[:2], flow_gt=data[2])
        graph_bytes = sum(n for n, _ in saved.values())
        by_part = {part: sum(n for n, p in saved.values() if p == part) / 2**20 for part in PARTS}
        out.loss.backward()
        del out
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB -> MiB (Linux)
    step_peak = step_peak_bytes(lambda: step(*data))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(*data)
        times.append(time.perf_counter() - t0)
    param_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + gradients
    return {
        "model": kind,
        "preset": preset,
        "config": config or {},
        "iterations": iters,
        "n_states": n_states if kind == "deq-flow" else iters,
        "checkpointing": checkpointing,
        "two_stage": two_stage,
        "batch": batch,
        "size": size,
        "graph_mb": None if two_stage else graph_bytes / 2**20,
        "graph_by_part_mb": by_part,
        "param_mb": param_bytes / 2**20,
        "peak_mb": None if two_stage else (graph_bytes + param_bytes) / 2**20,
        "step_peak_mb": step_peak / 2**20,
        "rss_growth_mb": rss_growth,
        "step_seconds": statistics.median(times),
    }


def _subprocess(
    kind: str,
    iters: int,
    preset: str,
    batch: int,
    size: int,
    n_states: int,
    repeats: int,
    checkpointing: bool,
    two_stage: bool = False,
) -> dict:
    code = (
        "import json, sys; from benchmarks.deq_flow import measure_training; "
        f"print(json.dumps(measure_training({kind!r}, {iters}, preset={preset!r}, batch={batch}, "
        f"size={size}, n_states={n_states}, repeats={repeats}, checkpointing={checkpointing}, "
        f"two_stage={two_stage})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"deq-flow bench subprocess ({kind}, {iters}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def reuse_along_video(
    model, *, frames: int = 12, size: tuple[int, int] = (96, 128), seeds: Sequence[int] = (0,)
) -> dict:
    """NFE and EPE per pair along `synthetic_video` (one video per seed), cold (zero start) and with each
    reuse mode of `estimate_sequence` (`REUSE_MODES`); ``reuse`` is the library's default mode ("warp") and
    ``default_reuse`` what ``reuse=True`` does for this checkpoint (``config.sequence_reuse``; "none": no
    reuse, every pair from zero).

    Each run's ``nfe``/``epe`` are per pair, averaged over the videos; ``nfe_ratio`` is the mean NFE with
    reuse over the pairs that have a previous one (all videos pooled) / the same without; ``per_video``
    holds each video's own ratio and EPE change."""
    import torch

    from deqzoo.models.deq_flow.modeling_deq_flow import DEFAULT_REUSE, REUSE_MODES
    from examples.deq_flow.flow import epe
    from examples.deq_flow.video import synthetic_video

    runs: dict = {mode: [] for mode in (False, *REUSE_MODES)}
    for seed in seeds:
        video, flows, valid = synthetic_video(frames, size, seed)
        for mode in runs:
            with torch.no_grad():
                preds, stats = model.estimate_sequence(video, reuse=mode)
            runs[mode].append(
                {
                    "nfe": [int(s.nfe) for s in stats],
                    "epe": [epe(p, f, v) for p, f, v in zip(preds, flows, valid)],
                    "converged": [bool(s.converged.all()) for s in stats],
                }
            )

    def pooled(key: str, videos: list[dict], first: int = 0) -> float:
        return statistics.mean(x for v in videos for x in v[key][first:])

    cold_runs = runs.pop(False)
    result: dict = {"modes": {}, "cold": _per_pair(cold_runs)}
    for mode, videos in runs.items():
        r = _per_pair(videos)
        # the first pair has nothing to reuse: ratios over the pairs that do
        r["nfe_ratio"] = pooled("nfe", videos, 1) / pooled("nfe", cold_runs, 1)
        r["nfe_ratio_all_pairs"] = r["mean_nfe"] / result["cold"]["mean_nfe"]
        r["epe_change"] = r["mean_epe"] / result["cold"]["mean_epe"] - 1
        r["per_video"] = [
            {
                "seed": seed,
                "nfe_ratio": pooled("nfe", [v], 1) / pooled("nfe", [c], 1),
                "epe_change": pooled("epe", [v]) / pooled("epe", [c]) - 1,
            }
            for seed, v, c in zip(seeds, videos, cold_runs)
        ]
        r["description"] = REUSE_MODES[mode]
        result["modes"][mode] = r
    warm = result["reuse"] = dict(result["modes"][DEFAULT_REUSE], mode=DEFAULT_REUSE)
    result["default_reuse"] = model.config.sequence_reuse
    result["nfe_ratio"], result["nfe_ratio_all_pairs"] = warm["nfe_ratio"], warm["nfe_ratio_all_pairs"]
    result["epe_change"] = warm["epe_change"]
    result["frames"], result["size"], result["seeds"] = frames, list(size), list(seeds)
    return result


EQUAL_ACCURACY_BUDGETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24)


def first_within(
    curve: Sequence[dict], target: float, video_targets: Sequence[float] | None = None
) -> dict | None:
    """The cheapest point of an accuracy-vs-cost curve (dicts with ``mean_nfe`` and ``mean_epe``, any order)
    whose EPE is at most `target` and, with `video_targets`, whose every video (``per_video[i]["epe"]``) is
    at most its own target; None if no point reaches them.

    Example:
        >>> curve = [{"mean_nfe": n, "mean_epe": e} for n, e in ((8, 1.0), (2, 3.0), (4, 1.5))]
        >>> first_within(curve, 1.6)["mean_nfe"], first_within(curve, 0.5)
        (4, None)
    """

    def reaches(p: dict) -> bool:
        if p["mean_epe"] > target:
            return False
        return video_targets is None or all(
            v["epe"] <= t for v, t in zip(p["per_video"], video_targets, strict=True)
        )

    reached = [p for p in curve if reaches(p)]
    return min(reached, key=lambda p: p["mean_nfe"]) if reached else None


def reuse_at_equal_accuracy(
    model,
    *,
    frames: int = 12,
    size: tuple[int, int] = (96, 128),
    seeds: Sequence[int] = (0,),
    modes: Sequence[str | bool] = (False, "warp", "forward_interpolate"),
    budgets: Sequence[int] = EQUAL_ACCURACY_BUDGETS,
    slack: float = 0.02,
) -> dict:
    """Mean NFE at equal accuracy along `synthetic_video`: each mode streams every video with a per-pair
    budget (``estimate_sequence(num_flow_updates=k)``: the first pair gets the full budget, every later
    pair at most k solver steps, still stopping at the tolerance), for each k in `budgets`. NFE and EPE are
    means over the pairs after the first (all videos pooled). The reference is the solve without reuse at
    the model's own settings (its f_max_iter and tolerance, no per-pair cap); the target EPE is
    (1 + slack) x the reference's, pooled and for every video against its own reference. For each mode,
    ``at_target`` is the cheapest budget whose EPE reaches the target (pooled and in every video), with
    ``nfe_ratio`` = its NFE / the reference's and ``nfe_ratio_vs_cold_at_target`` = its NFE / that of the
    cheapest budget at which the solve without reuse itself reaches the target."""
    from examples.deq_flow.video import synthetic_video

    videos = [synthetic_video(frames, size, seed) for seed in seeds]
    reference = _stream_point(model, videos, False, None)
    target = (1 + slack) * reference["mean_epe"]
    video_targets = [(1 + slack) * v["epe"] for v in reference["per_video"]]
    result: dict = {"reference": reference, "target_epe": target, "slack": slack, "modes": {}}
    for mode in modes:
        curve = [_stream_point(model, videos, mode, k) for k in budgets]
        hit = first_within(curve, target, video_targets)
        result["modes"]["none" if mode is False else mode] = {"curve": curve, "at_target": hit}
    cold_hit = result["modes"].get("none", {}).get("at_target")
    for r in result["modes"].values():
        hit = r["at_target"]
        r["nfe_ratio_vs_cold_at_target"] = (
            None if hit is None or cold_hit is None else hit["mean_nfe"] / cold_hit["mean_nfe"]
        )
        if hit is None:
            r["nfe_ratio"] = r["epe_change"] = None
        else:  # pooled, and each video at the pooled operating point against its own reference
            r.update(_against(hit, reference, seeds))
    result.update(frames=frames, size=list(size), seeds=list(seeds), budgets=list(budgets))
    return result


def _stream_point(model, videos: list, mode: str | bool, budget: int | None) -> dict:
    """One point of the accuracy-vs-cost curve: every video streamed by ``estimate_sequence(reuse=mode,
    num_flow_updates=budget)``; mean NFE and EPE over the pairs after the first, pooled and per video."""
    import torch

    from examples.deq_flow.flow import epe

    per_video = []
    for video, flows, valid in videos:
        with torch.no_grad():
            preds, stats = model.estimate_sequence(video, reuse=mode, num_flow_updates=budget)
        per_video.append(
            {
                "nfe": [int(s.nfe) for s in stats[1:]],
                "epe": [epe(p, f, v) for p, f, v in zip(preds[1:], flows[1:], valid[1:])],
            }
        )
    point = {key: statistics.mean(x for v in per_video for x in v[key]) for key in ("nfe", "epe")}
    return {
        "budget": budget,
        "mean_nfe": point["nfe"],
        "mean_epe": point["epe"],
        "per_video": [
            {"nfe": statistics.mean(v["nfe"]), "epe": statistics.mean(v["epe"])} for v in per_video
        ],
    }


def reuse_budget_held_out(
    model,
    budgets: dict[str, int],
    *,
    frames: int = 12,
    size: tuple[int, int] = (96, 128),
    seeds: Sequence[int] = (4, 5, 6, 7),
) -> dict:
    """The equal-accuracy budgets, chosen on some videos (`reuse_at_equal_accuracy`), checked on videos that
    did not choose them: for each mode its budget's mean NFE and EPE against no reuse at the model's own
    settings on the same fresh videos (``nfe_ratio``, ``epe_change``, pooled and per video)."""
    from examples.deq_flow.video import synthetic_video

    videos = [synthetic_video(frames, size, seed) for seed in seeds]
    reference = _stream_point(model, videos, False, None)
    result: dict = {"reference": reference, "seeds": list(seeds), "modes": {}}
    for mode, budget in budgets.items():
        point = _stream_point(model, videos, mode, budget)
        result["modes"][mode] = {"point": point, **_against(point, reference, seeds)}
    return result


def _against(point: dict, reference: dict, seeds: Sequence[int]) -> dict:
    """NFE ratio and EPE change of a curve point against the reference, pooled and per video."""
    return {
        "nfe_ratio": point["mean_nfe"] / reference["mean_nfe"],
        "epe_change": point["mean_epe"] / reference["mean_epe"] - 1,
        "per_video": [
            {"seed": seed, "nfe_ratio": v["nfe"] / r["nfe"], "epe_change": v["epe"] / r["epe"] - 1}
            for seed, v, r in zip(seeds, point["per_video"], reference["per_video"])
        ],
    }


def reuse_start_residual(
    model, *, frames: int = 12, size: tuple[int, int] = (96, 128), seeds: Sequence[int] = (0,)
) -> dict:
    """Where the reused start's residual comes from: along `synthetic_video` (pairs after the first), the
    relative residual ||f(z0) - z0|| / ||f(z0)|| of the `"warp"` start, split into its hidden-state and
    flow parts (each part's norm over the whole ||f(z0)||), and the same with oracle starts: the previous
    fixed point warped along the true motion, and that hidden state with the true flow of this pair."""
    import torch
    import torch.nn.functional as F
    from torchvision.models.optical_flow._utils import make_coords_grid

    from deqzoo.models.deq_flow.modeling_deq_flow import (
        _next_start,
        forward_interpolate,
        warp,
    )
    from examples.deq_flow.video import synthetic_video

    def residual(f, state) -> list[float]:
        fz = f(state)
        den = sum(a.pow(2).sum() for a in fz)
        parts = [(a - b).pow(2).sum() for a, b in zip(fz, state)]
        return [float((sum(parts) / den).sqrt()), *(float((p / den).sqrt()) for p in parts)]

    rows: dict[str, list[list[float]]] = {"warp": [], "true_motion": [], "true_motion_and_flow": []}
    with torch.no_grad():
        for seed in seeds:
            video, flows, _ = synthetic_video(frames, size, seed)
            previous = None
            for t in range(len(video) - 1):
                start = None if previous is None else _next_start(previous, "warp")
                out = model(video[t][None], video[t + 1][None], initial_state=start, return_dict=True)
                if previous is not None:
                    feats = model.features(video[t][None], video[t + 1][None])
                    bsz, _, h8, w8 = feats.context.shape
                    coords0 = make_coords_grid(bsz, h8, w8).to(feats.context)
                    f = model.update_fn(feats.context, coords0, feats.pyramid)
                    moved = forward_interpolate(F.avg_pool2d(flows[t - 1][None], 8) / 8)  # true motion
                    hidden = warp(previous[0], -moved)
                    rows["warp"].append(residual(f, start))
                    rows["true_motion"].append(residual(f, (hidden, warp(previous[1], -moved))))
                    rows["true_motion_and_flow"].append(
                        residual(f, (hidden, F.avg_pool2d(flows[t][None], 8) / 8))
                    )
                previous = out.fixed_point
    return {
        name: dict(zip(("rel_residual", "hidden_part", "flow_part"), map(statistics.mean, zip(*r))))
        for name, r in rows.items()
    }


def _per_pair(videos: list[dict]) -> dict:
    """Per-pair means over the videos (NFE, EPE), all-pairs means and every solve's convergence."""
    r = {key: [statistics.mean(pair) for pair in zip(*(v[key] for v in videos))] for key in ("nfe", "epe")}
    r["mean_nfe"], r["mean_epe"] = statistics.mean(r["nfe"]), statistics.mean(r["epe"])
    r["converged"] = [all(pair) for pair in zip(*(v["converged"] for v in videos))]
    r["solves_converged"] = sum(c for v in videos for c in v["converged"])
    r["solves"] = sum(len(v["converged"]) for v in videos)
    return r


def summarize(rows: list[dict], iterations: list[int]) -> dict[str, float]:
    """Growth from the fewest to the most iterations and DEQ-Flow / RAFT at the fewest, per preset and
    encoder-checkpointing setting, for the step's tensor peak (``step_peak``) and weights + saved graph
    (``saved``)."""
    lo, hi = min(iterations), max(iterations)
    out: dict[str, float] = {}
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for ckpt in dict.fromkeys(r["checkpointing"] for r in rows if r["preset"] == preset):

            def peak(kind, iters, states=None, key="step_peak_mb", two=False, preset=preset, ckpt=ckpt):
                return next(
                    r[key]
                    for r in rows
                    if r["preset"] == preset
                    and r["checkpointing"] == ckpt
                    and r["model"] == kind
                    and r["iterations"] == iters
                    and (states is None or r["n_states"] == states)
                    and r.get("two_stage", False) == two
                )

            tag = f"{preset}, encoder checkpointing {'on' if ckpt else 'off'}"
            for key, name in (("step_peak_mb", "step_peak"), ("peak_mb", "saved")):
                raft_lo = peak("raft", lo, key=key)
                out[f"{tag}: {name} raft_growth_{lo}_to_{hi}"] = peak("raft", hi, key=key) / raft_lo - 1
                for states in (1, 3):
                    s = f"{states}_state{'s' if states > 1 else ''}"
                    out[f"{tag}: {name} deq_growth_{lo}_to_{hi}_{s}"] = (
                        peak("deq-flow", hi, states, key) / peak("deq-flow", lo, states, key) - 1
                    )
                    deq_lo = peak("deq-flow", lo, states, key)
                    out[f"{tag}: {name} deq_over_raft_at_{lo}_{s}"] = deq_lo / raft_lo
            two_rows = [r for r in rows if r.get("two_stage") and r["preset"] == preset]
            if two_rows and any(r["checkpointing"] == ckpt for r in two_rows):
                two_lo, two_hi = (peak("deq-flow", i, 3, two=True) for i in (lo, hi))
                out[f"{tag}: step_peak deq_growth_{lo}_to_{hi}_3_states_two_stage"] = two_hi / two_lo - 1
                raft_lo = peak("raft", lo)
                out[f"{tag}: step_peak deq_over_raft_at_{lo}_3_states_two_stage"] = two_lo / raft_lo
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    rows, video = report["training"], report.get("reuse")
    equal = (video or {}).get("equal_accuracy")
    panels = [
        part for part, present in (("memory", rows), ("reuse", video), ("equal", equal)) if present
    ] or ["memory"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    settings = sorted({(r["preset"], r["checkpointing"]) for r in rows})
    for preset, ckpt in settings:
        for kind, states, two, marker in (
            ("deq-flow", 1, False, "o"),
            ("deq-flow", 3, False, "s"),
            ("deq-flow", 3, True, "D"),
            ("raft", None, False, "^"),
        ):
            sel = [
                r
                for r in rows
                if r["preset"] == preset
                and r["checkpointing"] == ckpt
                and r["model"] == kind
                and (states is None or r["n_states"] == states)
                and r.get("two_stage", False) == two
            ]
            if not sel:
                continue
            label = f"{preset}{', enc. ckpt' if ckpt else ''}: " + (
                kind
                if states is None
                else f"{kind} ({states} state{'s' if states > 1 else ''}{', two-stage' if two else ''})"
            )
            style = marker + ("--" if ckpt else "-")
            ax["memory"].plot(
                [r["iterations"] for r in sel], [r["step_peak_mb"] for r in sel], style, label=label
            )
    if rows:
        ax["memory"].set_yscale("log")
        ax["memory"].legend(fontsize=6)
        ax["memory"].set_xlabel("update iterations")
        ax["memory"].set_ylabel("training-step tensor peak (MiB)")
    if video:
        runs = {"cold": video["cold"], **video.get("modes", {"reuse": video["reuse"]})}
        for (key, run), style in zip(runs.items(), ("o-", "s-", "^-", "v-", "d-")):
            ax["reuse"].plot(
                range(1, len(run["nfe"]) + 1),
                run["nfe"],
                style,
                label=f"{key}: mean NFE {run['mean_nfe']:.1f}, EPE {run['mean_epe']:.3f}",
            )
        ax["reuse"].set_xlabel("frame pair")
        videos = len(video.get("seeds", [0]))
        ax["reuse"].set_ylabel("forward NFE" + (f" (mean of {videos} videos)" if videos > 1 else ""))
        ax["reuse"].legend(fontsize=7)
    if equal:
        for (mode, run), style in zip(equal["modes"].items(), ("o-", "D-", "s-", "^-")):
            curve = sorted(run["curve"], key=lambda p: p["mean_nfe"])
            ax["equal"].plot(
                [p["mean_nfe"] for p in curve],
                [p["mean_epe"] for p in curve],
                style,
                label=f"reuse={mode}" if mode != "none" else "no reuse",
            )
        ref = equal["reference"]
        ax["equal"].axhline(equal["target_epe"], color="grey", ls=":", lw=1, label="no reuse's EPE + 2%")
        ax["equal"].plot([ref["mean_nfe"]], [ref["mean_epe"]], "k*", ms=10, label="no reuse, own settings")
        ax["equal"].set_yscale("log")
        lo = min(p["mean_epe"] for run in equal["modes"].values() for p in run["curve"])
        hi = max(p["mean_epe"] for run in equal["modes"].values() for p in run["curve"])
        ax["equal"].set_yticks(
            [t for t in (1, 1.2, 1.5, 2, 3, 4, 6, 8) if lo * 0.9 <= t <= hi * 1.1] or [lo, hi]
        )
        ax["equal"].yaxis.set_major_formatter(ScalarFormatter())
        ax["equal"].yaxis.set_minor_formatter(NullFormatter())
        ax["equal"].set_xlabel("mean NFE per pair (per-pair budget k)")
        ax["equal"].set_ylabel("mean EPE (pairs after the first)")
        ax["equal"].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deqzoo bench deq-flow", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_output/deq_flow"))
    p.add_argument(
        "--scales",
        nargs="+",
        default=sorted(SCALES),
        choices=sorted(SCALES),
        help="cpu: deq-flow-cpu-synth, batch 4 of 64x64; b: the original's B size, batch 1 of 192x192",
    )
    p.add_argument("--iterations", type=int, nargs="+", default=[12, 24])
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument(
        "--checkpointing",
        nargs="+",
        type=lambda v: {"off": False, "on": True}[v],
        default=[False, True],
        metavar="{off,on}",
        help="encoder activation checkpointing settings to measure (both models under each)",
    )
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="trained DEQ-Flow for the reuse part")
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--videos", type=int, default=4, help="synthetic videos (seeds 0..N-1) for the reuse part")
    p.add_argument("--solver", default="fixed_point", help="forward solver for the reuse part")
    p.add_argument("--max-iter", type=int, default=24, help="f_max_iter for the reuse part")
    p.add_argument("--tol", type=float, default=5e-3, help="f_tol (relative) for the reuse part (the card's)")
    p.add_argument("--quick", action="store_true", help="cpu scale, batch 2, 1 timed step, <= 8 frames")
    p.add_argument("--no-reuse", action="store_true", help="skip the reuse part")
    p.add_argument("--no-training", action="store_true", help="skip the training-memory part")
    args = p.parse_args(argv)
    scales = {k: SCALES[k] for k in (["cpu"] if args.quick else args.scales)}
    if args.quick:
        scales = {"cpu": ("deq-flow-cpu-synth", 2, 64)}
        args.frames, args.repeats, args.videos = min(args.frames, 8), 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, batch, size in [] if args.no_training else scales.values():
        for ckpt in args.checkpointing:
            for iters in args.iterations:
                rows.append(_subprocess("raft", iters, preset, batch, size, 0, args.repeats, ckpt))
                for states in (1, 3):
                    rows.append(
                        _subprocess("deq-flow", iters, preset, batch, size, states, args.repeats, ckpt)
                    )
                rows.append(
                    _subprocess("deq-flow", iters, preset, batch, size, 3, args.repeats, ckpt, two_stage=True)
                )
    report: dict = {"training": rows, "method": __doc__.split("\n\n")[1]}
    report["summary"] = summarize(rows, args.iterations)
    if not args.no_reuse:
        import torch

        import deqzoo

        torch.set_num_threads(1)
        model = deqzoo.from_pretrained(
            args.checkpoint,
            deq={
                "f_solver": args.solver,
                "f_max_iter": args.max_iter,
                "f_tol": args.tol,
                "on_nonconvergence": "ignore",
            },
        ).eval()
        report["reuse"] = reuse_along_video(model, frames=args.frames, seeds=range(args.videos))
        report["reuse"].update(
            checkpoint=args.checkpoint, solver=args.solver, max_iter=args.max_iter, tol=args.tol
        )
        budgets = [k for k in EQUAL_ACCURACY_BUDGETS if k <= args.max_iter]
        report["reuse"]["equal_accuracy"] = reuse_at_equal_accuracy(
            model,
            frames=args.frames,
            seeds=range(args.videos),
            budgets=budgets[::3] + budgets[-1:] if args.quick else budgets,
        )
        chosen = {
            mode: r["at_target"]["budget"]
            for mode, r in report["reuse"]["equal_accuracy"]["modes"].items()
            if mode != "none" and r["at_target"] is not None
        }
        held_out = range(args.videos, 2 * args.videos)
        report["reuse"]["equal_accuracy"]["held_out"] = reuse_budget_held_out(
            model, chosen, frames=args.frames, seeds=held_out
        )
        report["reuse"]["start_residual"] = reuse_start_residual(
            model, frames=args.frames, seeds=range(args.videos)
        )
    path = args.out / "deq_flow_bench.json"
    path.write_text(json.dumps(report, indent=1))
    _plot(report, args.out / "deq_flow_bench.png")
    for r in rows:
        graph = "two-stage" if r.get("two_stage") else f"weights+graph {r['peak_mb']:7.1f}"
        print(
            f"{r['preset']:12s} {r['model']:9s} ckpt={'on ' if r['checkpointing'] else 'off'} "
            f"iters={r['iterations']:3d} states={r['n_states']:3d}  step peak {r['step_peak_mb']:7.1f} MiB "
            f"({graph}, rss growth {r['rss_growth_mb']:7.1f})  "
            f"step {r['step_seconds']:.2f}s"
        )
    for k, v in report["summary"].items():
        print(f"{k}: {v:.3f}")
    if "reuse" in report:
        r = report["reuse"]
        default = r.get("default_reuse", r["reuse"]["mode"])
        if default == "none":
            print("reuse=True for this checkpoint: none (config.sequence_reuse), every pair from zero")
        for mode, w in r["modes"].items():
            print(
                f"reuse {mode}{' (default)' if mode == default else ''}: mean NFE "
                f"{r['cold']['mean_nfe']:.2f} -> {w['mean_nfe']:.2f} "
                f"(ratio {w['nfe_ratio']:.3f} over pairs 2..), "
                f"mean EPE {r['cold']['mean_epe']:.4f} -> {w['mean_epe']:.4f} "
                f"({100 * w['epe_change']:+.2f}%); "
                "per video " + ", ".join(f"{v['nfe_ratio']:.3f}" for v in w["per_video"])
            )
        eq = r["equal_accuracy"]
        print(
            f"equal accuracy (EPE <= {eq['target_epe']:.4f}, {100 * eq['slack']:.0f}% above the solve "
            f"without reuse at its own settings: NFE {eq['reference']['mean_nfe']:.2f}, EPE "
            f"{eq['reference']['mean_epe']:.4f}; pooled and in every video):"
        )
        for mode, m in eq["modes"].items():
            hit = m["at_target"]
            print(
                f"  {mode}: "
                + (
                    "never reaches it"
                    if hit is None
                    else f"budget {hit['budget']}, mean NFE {hit['mean_nfe']:.2f} (ratio {m['nfe_ratio']:.3f}"
                    + (
                        ""
                        if m["nfe_ratio_vs_cold_at_target"] is None
                        else f", {m['nfe_ratio_vs_cold_at_target']:.3f} of the cheapest no-reuse budget"
                    )
                    + f"), EPE {hit['mean_epe']:.4f} ({100 * m['epe_change']:+.2f}%)"
                )
            )
        held = eq.get("held_out")
        if held:
            ref = held["reference"]
            print(
                f"held-out videos (seeds {', '.join(map(str, held['seeds']))}), the budgets above against "
                f"no reuse at its own settings (NFE {ref['mean_nfe']:.2f}, EPE {ref['mean_epe']:.4f}):"
            )
            for mode, m in held["modes"].items():
                print(
                    f"  {mode}: budget {m['point']['budget']}, mean NFE {m['point']['mean_nfe']:.2f} "
                    f"(ratio {m['nfe_ratio']:.3f}), EPE {m['point']['mean_epe']:.4f} "
                    f"({100 * m['epe_change']:+.2f}%); "
                    "per video " + ", ".join(f"{100 * v['epe_change']:+.1f}%" for v in m["per_video"])
                )
        for start, v in r["start_residual"].items():
            print(
                f"start residual ({start}): {v['rel_residual']:.3f} (hidden {v['hidden_part']:.3f}, "
                f"flow {v['flow_part']:.4f})"
            )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
