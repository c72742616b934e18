"""Unconditional digit generation with a DDIM model on scikit-learn's digits (offline), for DEQ-DDIM.

Data: `sklearn.datasets.load_digits` (1,797 8x8 images, 0..16 grey levels), upsampled bilinearly to 16x16 and
scaled to [-1, 1]. Fixed split by a seeded permutation (seed 0): the first 1,200 images train the diffusion
model; the remaining 597 are held out. Of the held-out images, the first 397 train the independent evaluation
classifier and the last 200 test it; all 597 serve as the "real" reference for the memorization check, and the
first 16 of the classifier's test part are the inversion targets.

`evaluate(pipe)` samples 256 digits with DEQ-DDIM (T = 10, seed 0) and reports: the share the independent
classifier (`evaluator/` in the checkpoint, trained only on held-out real digits) assigns with confidence
>= 0.9, the entropy (nats, max ln 10 = 2.3026) and coverage of the predicted-class histogram, and the mean
nearest-neighbour L2 distance to the training set of the samples and of the 597 held-out real digits
(memorization check: samples should be no closer than real unseen digits).

Example:
    >>> import deqzoo
    >>> from examples.deq_ddim import ddim_digits
    >>> pipe = deqzoo.from_pretrained("model_cards/ddim-digits-16")  # doctest: +SKIP
    >>> ddim_digits.evaluate(pipe, limit=64, progress=False)["confident_share"]  # doctest: +SKIP
    0.7
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from deqzoo.predict import sample_grid
from examples.demo import DemoSummary

__all__ = [
    "RESOLUTION",
    "DigitClassifier",
    "demo",
    "evaluate",
    "load_classifier",
    "load_split",
    "sample_grid",
]

RESOLUTION = 16
_N_TRAIN, _N_CLS_TRAIN = 1200, 397
_SPLITS = ("train", "heldout", "classifier_train", "classifier_test", "inversion")


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = torch.nn.functional.interpolate(
        x, size=(RESOLUTION, RESOLUTION), mode="bilinear", align_corners=False
    )
    x = (x * 2.0 - 1.0).clamp(-1.0, 1.0)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    return x[perm].contiguous(), torch.tensor(d.target, dtype=torch.int64)[perm].contiguous()


def load_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Split name -> (images (N, 1, 16, 16) float32 in [-1, 1], labels (N,) int64); see the module docstring.

    Example:
        >>> x, y = load_split("train")
        >>> tuple(x.shape), int(y.max())
        ((1200, 1, 16, 16), 9)
    """
    x, y = _digits()
    n = len(x)
    bounds = {
        "train": (0, _N_TRAIN),
        "heldout": (_N_TRAIN, n),
        "classifier_train": (_N_TRAIN, _N_TRAIN + _N_CLS_TRAIN),
        "classifier_test": (_N_TRAIN + _N_CLS_TRAIN, n),
        "inversion": (_N_TRAIN + _N_CLS_TRAIN, _N_TRAIN + _N_CLS_TRAIN + 16),
    }
    if split not in bounds:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    lo, hi = bounds[split]
    return x[lo:hi], y[lo:hi]


class DigitClassifier(torch.nn.Module):
    """The independent evaluation classifier: a small CNN over 16x16 digits in [-1, 1] (sees no samples)."""

    def __init__(self, width: int = 32):
        super().__init__()
        c = width
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c, 2 * c, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(2 * c * 16, 10),
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_classifier(directory: str | Path) -> DigitClassifier:
    """The evaluation classifier stored in `<checkpoint>/evaluator/` (config.json + model.safetensors)."""
    from safetensors.torch import load_file

    d = Path(directory) / "evaluator"
    cfg_path, weights = d / "config.json", d / "model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{d}: the evaluation classifier (config.json, model.safetensors) is missing")
    width = json.loads(cfg_path.read_text()).get("width")
    if not isinstance(width, int) or not 1 <= width <= 256:
        raise ValueError(f"{cfg_path}: width must be an int in [1, 256], got {width!r}")
    model = DigitClassifier(width)
    model.load_state_dict(load_file(str(weights)))
    return model.eval()


def _pipe_directory(pipe) -> Path:
    path = getattr(pipe, "name_or_path", None) or getattr(pipe.config, "_name_or_path", None)
    if not path or not Path(path).is_dir():
        raise ValueError("the pipeline was not loaded from a checkpoint directory holding evaluator/")
    return Path(path)


def _samples(pipe, n: int, T: int, seed: int, progress: bool) -> tuple[torch.Tensor, list]:
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(seed)
    out, stats = [], []
    for lo in tqdm(range(0, n, 64), desc="sample", disable=not progress):
        r = pipe(batch_size=min(64, n - lo), generator=gen, num_inference_steps=T, output_type="pt")
        out.append(r.images * 2 - 1)
        stats.append(r.deq_stats)
    return torch.cat(out), stats


def _mean_nn_distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.cdist(x.flatten(1), ref.flatten(1)).min(1).values.mean())


@torch.no_grad()
def evaluate(
    pipe, *, limit: int | None = None, progress: bool = True, num_inference_steps: int = 10, seed: int = 0
) -> dict[str, float]:
    """Sample quality of a DEQ-DDIM pipeline on 256 samples (or `limit`); see the module docstring."""
    n = 256 if limit is None else int(limit)
    clf = load_classifier(_pipe_directory(pipe))
    samples, stats = _samples(pipe, n, num_inference_steps, seed, progress)
    probs = torch.softmax(clf(samples), dim=1)
    conf, pred = probs.max(1)
    hist = torch.bincount(pred, minlength=10).double() / n
    entropy = float(-(hist[hist > 0] * hist[hist > 0].log()).sum())
    train, _ = load_split("train")
    held, _ = load_split("heldout")
    return {
        "confident_share": round(float((conf >= 0.9).double().mean()), 4),
        "class_entropy": round(entropy, 4),
        "classes_covered": int((hist > 0).sum()),
        "nn_dist_samples": round(_mean_nn_distance(samples, train), 4),
        "nn_dist_heldout_real": round(_mean_nn_distance(held, train), 4),
        "mean_nfe": round(sum(s.nfe for s in stats) / len(stats), 2),
    }


def demo(pipe, output_dir: str | Path = "demo_output"):
    """Sample a grid of 16 digits (T = 10) into `output_dir` (the demo's own folder; its grid is replaced on
    every run); returns a summary line and the solve's stats."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    path, stats = sample_grid(pipe, Path(output_dir) / "ddim-digits-16_samples.png", n=16)
    return DemoSummary(f"16 digits sampled by DEQ-DDIM (T=10) -> {path}", "16 samples, T=10"), stats


