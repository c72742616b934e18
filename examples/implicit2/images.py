"""Implicit-representation tasks (Implicit², Huang, Bai & Kolter 2021) on scikit-image's bundled images.

- Representation: fit one image on its full pixel grid; PSNR on the same pixels.
- Generalization: fit on 25% of the pixels (even rows and columns of the grid) and measure PSNR on a disjoint
  25% (odd rows and columns), as the original does on its Natural and Text sets.

Images are center-cropped to a square, resized (anti-aliased) to ``size`` x ``size`` and mapped to [-1, 1]
(2·intensity - 1, as the original); coordinates are the grid over [-1, 1]² (x = column, y = row). PSNR is the
original's: on intensities clamped to [0, 1]. Training is full-batch Adam with the original's recipe:
fixed-point reuse across steps (`deqzoo.core.FixedPointCache`), the spectral bound on W kept after every step
(`deqzoo.core.SpectralProjector`), NPG with T = 1 (the model config's backward mode): `examples/implicit2/
fitting.py` (training is not part of the installed package).

No audio clip ships with the installed packages (scipy.datasets downloads on demand), so there is no
audio task.

A checkpoint names its image in ``config.task_specific_params["implicit2"]`` (image, size, split); `evaluate`,
`demo` and `predict` read it there.

Example:
    >>> from examples.implicit2.images import image_data
    >>> data = image_data("camera", 32, "generalization")
    >>> data.train_coords.shape, data.train_values.shape, data.test_coords.shape
    (torch.Size([256, 2]), torch.Size([256, 1]), torch.Size([256, 2]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deqzoo.core import SolverStats
from deqzoo.predict import save_png, signal_settings
from examples.demo import DemoSummary

__all__ = [
    "IMAGES",
    "ImageData",
    "demo",
    "evaluate",
    "image_data",
    "load_image",
    "psnr",
    "signal_settings",
]

# scikit-image's bundled images (no download); the generalization table runs over all of them
IMAGES: dict[str, str] = {
    "camera": "gray",
    "astronaut": "rgb",
    "coffee": "rgb",
    "chelsea": "rgb",
    "rocket": "rgb",
    "text": "gray",
}
SPLITS = ("full", "generalization")


def load_image(name: str, size: int) -> torch.Tensor:
    """A bundled image as a (size, size, C) float tensor in [0, 1] (center square crop, anti-aliased resize).

    Example:
        >>> load_image("camera", 16).shape
        torch.Size([16, 16, 1])
    """
    if name not in IMAGES:
        raise ValueError(f"unknown image {name!r}; bundled images: {sorted(IMAGES)}")
    if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= 2048:
        raise ValueError(f"image size must be an integer in [2, 2048], got {size!r}")
    import skimage.data
    from skimage.transform import resize

    img = getattr(skimage.data, name)()
    img = img.astype(np.float64) / 255.0
    if img.ndim == 2:
        img = img[:, :, None]
    h, w = img.shape[:2]
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    img = img[top : top + s, left : left + s]
    if s != size:
        img = resize(img, (size, size), anti_aliasing=True, order=3)
    return torch.from_numpy(np.clip(img, 0.0, 1.0)).float()


@dataclass
class ImageData:
    """Coordinates (N, 2) and values (N, C) in [-1, 1] for training and for measuring PSNR."""

    name: str
    size: int
    split: str
    image: torch.Tensor  # (size, size, C) in [0, 1]
    train_coords: torch.Tensor
    train_values: torch.Tensor
    test_coords: torch.Tensor
    test_values: torch.Tensor


def image_data(name: str, size: int, split: str = "full") -> ImageData:
    """The task's data: ``split="full"`` trains and tests on every pixel; ``"generalization"`` trains on the
    even rows/columns and tests on the odd ones (disjoint quarters of the grid)."""
    from deqzoo.models.implicit2 import coordinate_grid

    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    img = load_image(name, size)
    c = img.shape[-1]
    grid = coordinate_grid((size, size)).reshape(size, size, 2)
    values = img * 2 - 1
    if split == "full":
        tc, tv = grid.reshape(-1, 2), values.reshape(-1, c)
        return ImageData(name, size, split, img, tc, tv, tc, tv)
    tr, te = (slice(0, None, 2), slice(0, None, 2)), (slice(1, None, 2), slice(1, None, 2))
    return ImageData(
        name,
        size,
        split,
        img,
        grid[tr].reshape(-1, 2),
        values[tr].reshape(-1, c),
        grid[te].reshape(-1, 2),
        values[te].reshape(-1, c),
    )


def psnr(values: torch.Tensor, target: torch.Tensor) -> float:
    """PSNR in dB of signals in [-1, 1], on intensities clamped to [0, 1] (the original's metric)."""
    a = ((values.detach().double() + 1) / 2).clamp(0, 1)
    b = ((target.detach().double() + 1) / 2).clamp(0, 1)
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else -10.0 * math.log10(mse)


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """PSNR (dB) of the representation on its task's test pixels (all pixels for a representation checkpoint)
    from a zero initial state, and the forward solve's f-evaluations; `limit` scores only the first N
    pixels."""
    s = signal_settings(model)
    data = image_data(s["image"], int(s["size"]), s["split"])
    coords, target = data.test_coords, data.test_values
    if limit is not None:
        coords, target = coords[:limit], target[:limit]
    model.eval()
    values, stats = model.values_at(coords)
    result = {"psnr": round(psnr(values, target), 2)}
    if stats:
        result["nfe"] = float(max(st.nfe for st in stats))
    return result


def demo(model, output_dir: str | Path = "demo_output") -> tuple[str, SolverStats]:
    """Render the representation at twice its fitted resolution into `output_dir` (the demo's own folder; its
    render is replaced on every run) and report the PSNR at the fitted resolution; returns (summary line, the
    2x render's solve statistics)."""
    s = signal_settings(model)
    size = int(s["size"])
    data = image_data(s["image"], size, s["split"])
    values, stats = model.eval().values_at(data.test_coords)
    render_values, render_stats = model.sample((2 * size, 2 * size))  # the grid over coordinate_range
    image = ((render_values + 1) / 2).clamp(0, 1)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(getattr(model, "name_or_path", "") or "implicit2").name
    path = out_dir / f"{name}_{2 * size}x{2 * size}.png"
    save_png(image, path)
    score = psnr(values, data.test_values)
    summary = DemoSummary(
        f"{s['image']} ({s['split']}, {size}x{size}): PSNR {score:.2f} dB; "
        f"rendered at 2x ({2 * size}x{2 * size}) to {path}",
        f"PSNR {score:.2f} dB",
    )
    st = (render_stats or [None])[0]
    if st is None:  # explicit networks have no solve
        st = SolverStats.no_solve()
    return summary, st


