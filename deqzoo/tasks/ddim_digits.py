"""Unconditional digit generation with a DDIM diffusion model on scikit-learn's digits (offline), for DEQ-DDIM.

Data: `sklearn.datasets.load_digits` (1,797 8x8 images, 0..16 grey levels), upsampled bilinearly to 16x16 and
scaled to [-1, 1]. Fixed split by a seeded permutation (seed 0): the first 1,200 images train the diffusion
model; the remaining 597 are held out. Of the held-out images, the first 397 train the independent evaluation
classifier and the last 200 test it; all 597 serve as the "real" reference for the memorization check, and the
first 16 of the classifier's test part are the inversion targets.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

__all__ = ["RESOLUTION", "load_split"]

RESOLUTION = 16
_N_TRAIN, _N_CLS_TRAIN = 1200, 397
_SPLITS = ("train", "heldout", "classifier_train", "classifier_test", "inversion")


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = torch.nn.functional.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bilinear", align_corners=False)
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
    """The independent evaluation classifier: a small CNN over 16x16 digits in [-1, 1] (never sees samples)."""

    def __init__(self, width: int = 32):
        super().__init__()
        c = width
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Dropout(0.3), torch.nn.Linear(2 * c * 16, 10),
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
