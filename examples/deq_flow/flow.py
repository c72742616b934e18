"""Optical-flow task: FlyingChairs-like pairs rendered from real photographs and the motorcycle stereo pair,
generated offline and deterministically from scikit-image's bundled images (the synthetic video the
benchmarks stream is `examples/deq_flow/video.py`, built from the same layers).

A scene is a stack of layers (a background and "chairs": elliptical pieces of other photographs), each with a
per-frame map from frame pixels to its texture's pixels and the inverse. A pixel of frame t belongs to the top
layer whose mask (an ellipse in texture coordinates, so it moves with its layer) contains it; the flow from
frame t to t+1 at x is ``inverse_{t+1}(map_t(x)) - x`` for that layer: exact, by construction, not estimated.
A pixel is valid (not occluded) when its target lies inside frame t+1 and the same layer owns it there.

Pairs: the background moves by a random affine map plus a smooth random deformation (inverted numerically to
float precision by a contractive fixed-point iteration); 1 to 3 chairs move by their own affine maps; frame 2
gets a small brightness/contrast change and noise. Training pairs use only `TRAIN_IMAGES`; held-out pairs use
only `HELD_OUT_IMAGES` (and the last 50 lfw faces), images the training never sees.

Example:
    >>> import torch
    >>> from examples.deq_flow.flow import synthetic_pair, warp
    >>> p = synthetic_pair(0, size=(64, 64), split="train")
    >>> p.image1.shape, p.flow.shape, p.valid.dtype
    (torch.Size([3, 64, 64]), torch.Size([2, 64, 64]), torch.bool)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deqzoo.models.deq_flow.modeling_deq_flow import warp  # re-exported: the data's checks use it
from deqzoo.predict import flow_png
from examples.demo import DemoSummary, save_figure

__all__ = [
    "HELD_OUT_IMAGES",
    "TRAIN_IMAGES",
    "FlowPair",
    "classical_epe",
    "classical_flow",
    "demo",
    "epe",
    "evaluate",
    "flow_png",
    "held_out_set",
    "model_flow",
    "motorcycle_pair",
    "synthetic_batch",
    "synthetic_pair",
    "warp",
]

TRAIN_IMAGES = (
    "astronaut",
    "coffee",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "brick",
    "grass",
    "gravel",
    "coins",
    "moon",
    "camera",
    "cell",
    "page",
)
HELD_OUT_IMAGES = ("chelsea", "clock", "text")
_LFW_TRAIN = 150  # lfw_subset faces [0, 150) texture training chairs; [150, 200) are held out


@dataclass
class FlowPair:
    """image1, image2: (3, H, W) float32 in [0, 1]; flow: (2, H, W) ground truth (x, y) in pixels from image1
    to image2; valid: (H, W) bool, False where the pixel is occluded or leaves the frame."""

    image1: torch.Tensor
    image2: torch.Tensor
    flow: torch.Tensor
    valid: torch.Tensor


@functools.cache
def _texture(name: str) -> torch.Tensor:
    """A bundled image as (3, H, W) float32 in [0, 1] (gray repeated)."""
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)())
    if img.dtype == np.bool_:
        img = img.astype(np.float32)
    img = img.astype(np.float32) / (255.0 if img.dtype != np.float32 or img.max() > 1.5 else 1.0)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return torch.from_numpy(np.ascontiguousarray(img[..., :3].transpose(2, 0, 1))).float().clamp(0, 1)


@functools.cache
def _faces() -> torch.Tensor:
    import skimage.data

    faces = torch.from_numpy(np.asarray(skimage.data.lfw_subset(), dtype=np.float32))  # (200, 25, 25)
    return faces[:, None].repeat(1, 3, 1, 1)


def _textures(split: str) -> list[torch.Tensor]:
    if split == "train":
        return [_texture(n) for n in TRAIN_IMAGES]
    if split == "held-out":
        return [_texture(n) for n in HELD_OUT_IMAGES]
    raise ValueError(f"split must be 'train' or 'held-out', got {split!r}")


def _chair_textures(split: str) -> list[torch.Tensor]:
    faces = _faces()
    faces = list(faces[:_LFW_TRAIN] if split == "train" else faces[_LFW_TRAIN:])
    return _textures(split) + faces


def _affine(
    scale: float, angle: float, shift: tuple[float, float], center: tuple[float, float]
) -> np.ndarray:
    """3x3 map x -> R(angle)·scale·(x - center) + center + shift (float64)."""
    c, s = math.cos(angle) * scale, math.sin(angle) * scale
    cx, cy = center
    m = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    m[:2, 2] = np.array([cx, cy]) - m[:2, :2] @ np.array([cx, cy]) + np.array(shift)
    return m


def _apply(m: np.ndarray, xy: torch.Tensor) -> torch.Tensor:
    """Apply a 3x3 affine map to (..., 2) points (float64)."""
    mt = torch.from_numpy(m).to(xy)
    return xy @ mt[:2, :2].T + mt[:2, 2]


Map = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    texture: torch.Tensor  # (3, Ht, Wt)
    to_tex: list[Map]  # per frame: frame pixel (x, y) -> texture pixel
    from_tex: list[Map]  # per frame: texture pixel -> frame pixel
    ellipse: tuple[float, float, float, float, float] | None  # (cx, cy, rx, ry, angle) in texture pixels

    def inside(self, uv: torch.Tensor) -> torch.Tensor:
        if self.ellipse is None:
            return torch.ones(uv.shape[:-1], dtype=torch.bool)
        cx, cy, rx, ry, a = self.ellipse
        d = uv - torch.tensor([cx, cy], dtype=uv.dtype)
        c, s = math.cos(a), math.sin(a)
        u, v = c * d[..., 0] + s * d[..., 1], -s * d[..., 0] + c * d[..., 1]
        return (u / rx) ** 2 + (v / ry) ** 2 <= 1.0


def _grid(h: int, w: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    return torch.stack([xs, ys], dim=-1)  # (H, W, 2) as (x, y)


def _sample(texture: torch.Tensor, uv: torch.Tensor) -> torch.Tensor:
    """Bilinear texture lookup at (H, W, 2) texture pixels (reflection outside): (3, H, W)."""
    ht, wt = texture.shape[-2:]
    norm = torch.stack([2 * uv[..., 0] / (wt - 1) - 1, 2 * uv[..., 1] / (ht - 1) - 1], dim=-1)
    return F.grid_sample(
        texture[None], norm[None].float(), mode="bilinear", padding_mode="reflection", align_corners=True
    )[0]


def _owner(layers: list[_Layer], t: int, xy: torch.Tensor) -> torch.Tensor:
    """Index of the top layer owning each point of frame t."""
    owner = torch.zeros(xy.shape[:-1], dtype=torch.long)
    for i, layer in enumerate(layers[1:], start=1):
        owner[layer.inside(layer.to_tex[t](xy))] = i
    return owner


def _render(layers: list[_Layer], t: int, h: int, w: int) -> torch.Tensor:
    xy = _grid(h, w)
    owner = _owner(layers, t, xy)
    image = torch.zeros(3, h, w)
    for i, layer in enumerate(layers):
        sel = owner == i
        if bool(sel.any()):
            image[:, sel] = _sample(layer.texture, layer.to_tex[t](xy))[:, sel]
    return image


def _flow(layers: list[_Layer], t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact flow from frame t to t+1 and its validity mask."""
    xy = _grid(h, w)
    owner = _owner(layers, t, xy)
    target = torch.zeros_like(xy)
    for i, layer in enumerate(layers):
        sel = owner == i
        if bool(sel.any()):
            target[sel] = layer.from_tex[t + 1](layer.to_tex[t](xy[sel]))
    inside = (
        (target[..., 0] >= 0) & (target[..., 0] <= w - 1) & (target[..., 1] >= 0) & (target[..., 1] <= h - 1)
    )
    valid = inside & (_owner(layers, t + 1, target) == owner)
    return (target - xy).permute(2, 0, 1).float(), valid


def _smooth_field(rng: np.random.Generator, h: int, w: int, amplitude: float, cells: int = 4) -> torch.Tensor:
    """A smooth random displacement field (H, W, 2): bicubic upsampling of a cells x cells random grid."""
    coarse = torch.from_numpy(rng.uniform(-amplitude, amplitude, size=(1, 2, cells, cells)))
    fine = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)[0]
    return fine.permute(1, 2, 0)


def _field_at(field: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
    """Bilinear lookup of an (H, W, 2) field at (..., 2) pixel points (border-clamped), float64."""
    h, w = field.shape[:2]
    shape = xy.shape
    pts = xy.reshape(1, 1, -1, 2)
    norm = torch.stack([2 * pts[..., 0] / (w - 1) - 1, 2 * pts[..., 1] / (h - 1) - 1], dim=-1)
    out = F.grid_sample(
        field.permute(2, 0, 1)[None], norm, mode="bilinear", padding_mode="border", align_corners=True
    )
    return out[0, :, 0].T.reshape(shape)


def _deformed(m: np.ndarray, field: torch.Tensor) -> tuple[Map, Map]:
    """T(x) = M x + d(x) and its inverse by the fixed-point iteration x <- M⁻¹(y - d(x)) (contractive since
    ||M⁻¹||·Lip(d) < 1 for the fields drawn here), run to float64 rounding."""
    inv = np.linalg.inv(m)

    def fwd(xy: torch.Tensor) -> torch.Tensor:
        return _apply(m, xy) + _field_at(field, xy)

    def back(y: torch.Tensor) -> torch.Tensor:
        x = _apply(inv, y)
        for _ in range(60):
            x_new = _apply(inv, y - _field_at(field, x))
            if float((x_new - x).abs().max()) < 1e-9:
                return x_new
            x = x_new
        return x

    return fwd, back


def _compose(first: Map, second: Map) -> Map:
    return lambda xy: second(first(xy))


def _crop_map(
    rng: np.random.Generator, tex: torch.Tensor, h: int, w: int, zoom: tuple[float, float]
) -> np.ndarray:
    """Frame pixel -> texture pixel: random zoom/rotation around a random point of the texture."""
    ht, wt = tex.shape[-2:]
    scale = math.exp(rng.uniform(math.log(zoom[0]), math.log(zoom[1])))
    angle = rng.uniform(-math.pi, math.pi) if rng.uniform() < 0.3 else rng.uniform(-0.3, 0.3)
    center = (rng.uniform(0.2, 0.8) * (wt - 1), rng.uniform(0.2, 0.8) * (ht - 1))
    # frame center -> texture center, scaled and rotated
    c, s = math.cos(angle) * scale, math.sin(angle) * scale
    m = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    m[:2, 2] = np.array(center) - m[:2, :2] @ np.array([(w - 1) / 2, (h - 1) / 2])
    return m


def _motion(
    rng: np.random.Generator,
    center: tuple[float, float],
    max_shift: float,
    max_angle: float,
    max_log_scale: float,
) -> np.ndarray:
    """Frame-1 -> frame-2 affine motion about `center`."""
    return _affine(
        math.exp(rng.uniform(-max_log_scale, max_log_scale)),
        rng.uniform(-max_angle, max_angle),
        (rng.uniform(-max_shift, max_shift), rng.uniform(-max_shift, max_shift)),
        center,
    )


def _inverse_map(m: np.ndarray) -> tuple[Map, Map]:
    inv = np.linalg.inv(m)
    return (lambda xy: _apply(m, xy)), (lambda uv: _apply(inv, uv))


def synthetic_pair(
    seed: int,
    size: tuple[int, int] = (64, 64),
    split: str = "train",
    max_shift: float | None = None,
    photometric: bool = True,
) -> FlowPair:
    """One deterministic FlyingChairs-like pair (see the module docstring); `seed` selects it.

    `max_shift` bounds the translations in pixels (default: a tenth of the smaller side); `photometric=False`
    leaves out frame 2's brightness/contrast change and noise (the geometry is the same)."""
    h, w = size
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, h, w])
    textures, chairs = _textures(split), _chair_textures(split)
    shift = max_shift if max_shift is not None else min(h, w) / 10
    center = ((w - 1) / 2, (h - 1) / 2)
    # background: frame1 -> texture, and frame1 -> frame2 motion = affine + smooth deformation
    bg_tex = textures[rng.integers(len(textures))]
    a1 = _crop_map(rng, bg_tex, h, w, (0.6, 2.5))
    motion = _motion(rng, center, shift, 0.06, 0.06)
    field = _smooth_field(rng, h, w, amplitude=rng.uniform(0.0, min(h, w) / 32))
    t_fwd, t_back = _deformed(motion, field)
    a1_to, a1_from = _inverse_map(a1)
    layers = [_Layer(bg_tex, [a1_to, _compose(t_back, a1_to)], [a1_from, _compose(a1_from, t_fwd)], None)]
    for _ in range(int(rng.integers(1, 4))):
        tex = chairs[rng.integers(len(chairs))]
        ht, wt = tex.shape[-2:]
        o1 = _crop_map(rng, tex, h, w, (0.2, 1.5) if max(ht, wt) > 64 else (0.15, 0.5))
        # the chair's position in frame 1: shift the map so a random frame point lands on the texture center
        pos = (rng.uniform(0.1, 0.9) * (w - 1), rng.uniform(0.1, 0.9) * (h - 1))
        o1 = o1 @ _affine(1.0, 0.0, (center[0] - pos[0], center[1] - pos[1]), (0.0, 0.0))
        radius = min(h, w) * rng.uniform(0.12, 0.3)
        scale = float(np.sqrt(abs(np.linalg.det(o1[:2, :2]))))
        tc = _apply(o1, torch.tensor([pos], dtype=torch.float64))[0].tolist()
        ellipse = (
            tc[0],
            tc[1],
            radius * scale * rng.uniform(0.6, 1.4),
            radius * scale * rng.uniform(0.6, 1.4),
            rng.uniform(0, math.pi),
        )
        m = _motion(rng, pos, shift, 0.15, 0.1)
        o2 = o1 @ np.linalg.inv(m)
        (to1, from1), (to2, from2) = _inverse_map(o1), _inverse_map(o2)
        layers.append(_Layer(tex, [to1, to2], [from1, from2], ellipse))
    image1, image2 = _render(layers, 0, h, w), _render(layers, 1, h, w)
    gain, bias = rng.uniform(0.9, 1.1), rng.uniform(-0.05, 0.05)
    noise = torch.from_numpy(rng.normal(0.0, 0.01, size=image2.shape)).float()
    if photometric:
        image2 = (image2 * gain + bias + noise).clamp(0, 1)
    flow, valid = _flow(layers, 0, h, w)
    return FlowPair(image1, image2, flow, valid)


def synthetic_batch(
    seeds: list[int] | range,
    size: tuple[int, int] = (64, 64),
    split: str = "train",
    max_shift: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked pairs: image1, image2 (B, 3, H, W), flow (B, 2, H, W), valid (B, H, W); `max_shift` as in
    `synthetic_pair`."""
    pairs = [synthetic_pair(int(s), size, split, max_shift=max_shift) for s in seeds]
    return tuple(torch.stack([getattr(p, k) for p in pairs]) for k in ("image1", "image2", "flow", "valid"))


def motorcycle_pair(scale: float = 0.25) -> FlowPair:
    """scikit-image's Middlebury `motorcycle` stereo pair, resized by `scale`: flow from the left to the right
    image is (-disparity, 0); valid where the ground-truth disparity is finite."""
    import skimage.data

    left, right, disp = skimage.data.stereo_motorcycle()
    h, w = disp.shape
    size = (max(1, round(h * scale)), max(1, round(w * scale)))

    def resize(img: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(img.astype(np.float32) / 255.0).permute(2, 0, 1)[None]
        return F.interpolate(t, size=size, mode="bilinear", antialias=True, align_corners=False)[0].clamp(
            0, 1
        )

    d = torch.from_numpy(np.asarray(disp, dtype=np.float32))
    finite = torch.isfinite(d)
    # nearest sampling of the disparity (no blending across depth edges), scaled with the image
    iy = torch.linspace(0, h - 1, size[0]).round().long()
    ix = torch.linspace(0, w - 1, size[1]).round().long()
    d_small, ok = d[iy][:, ix] * (size[1] / w), finite[iy][:, ix]
    flow = torch.stack([-torch.where(ok, d_small, torch.zeros_like(d_small)), torch.zeros_like(d_small)])
    return FlowPair(resize(left), resize(right), flow, ok)


def epe(flow: torch.Tensor, gt: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Mean end-point error over valid pixels (all pixels when `valid` is None)."""
    err = torch.linalg.vector_norm(flow - gt, dim=-3)
    if valid is None:
        return float(err.mean())
    return float(err[valid.bool()].mean()) if bool(valid.any()) else float("nan")


# ------------------------------------------------------------------------------------------------------------
# evaluation, baselines, demo, predict

HELD_OUT_PAIRS = 100  # held-out synthetic pairs scored by `evaluate` (seeds 0..99 of the held-out split)
EVAL_SIZE = (64, 64)
MOTORCYCLE_SCALE = 0.25


def held_out_set(n: int = HELD_OUT_PAIRS, size: tuple[int, int] = EVAL_SIZE, max_shift: float | None = None):
    """The held-out evaluation pairs: image1, image2 (N, 3, H, W), flow (N, 2, H, W), valid (N, H, W);
    `max_shift` as in `synthetic_pair` (default: the pairs every card scores)."""
    return synthetic_batch(range(n), size, "held-out", max_shift=max_shift)


def _gray_u8(image: torch.Tensor) -> np.ndarray:
    return (image.mean(0).numpy() * 255.0 + 0.5).clip(0, 255).astype(np.uint8)


def classical_flow(method: str, image1: torch.Tensor, image2: torch.Tensor) -> torch.Tensor:
    """OpenCV's flow between two (3, H, W) images in [0, 1] on grayscale: "farneback"
    (calcOpticalFlowFarneback, OpenCV's documented example parameters) or "dis" (DISOpticalFlow, MEDIUM
    preset); "zero" is the zero flow. Returns (2, H, W)."""
    if method == "zero":
        return torch.zeros(2, *image1.shape[-2:])
    import cv2

    a, b = _gray_u8(image1), _gray_u8(image2)
    if method == "farneback":
        flow = cv2.calcOpticalFlowFarneback(a, b, None, 0.5, 3, 15, 3, 5, 1.2, 0)
    elif method == "dis":
        flow = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM).calc(a, b, None)
    else:
        raise ValueError(f"unknown classical method {method!r}; choose zero, farneback or dis")
    return torch.from_numpy(np.ascontiguousarray(flow.transpose(2, 0, 1))).float()


def classical_epe(method: str, image1, image2, flow, valid) -> float:
    """Mean EPE of a classical method over a batch (per-pair flows, pixels pooled over valid pixels)."""
    preds = torch.stack([classical_flow(method, a, b) for a, b in zip(image1, image2)])
    return epe(preds, flow, valid)


@torch.no_grad()
def model_flow(
    model, image1: torch.Tensor, image2: torch.Tensor, batch_size: int = 25, converged: list | None = None
) -> tuple[torch.Tensor, list[int]]:
    """The model's flow over a batch in chunks; returns (flow (N, 2, H, W), NFE per chunk). A `converged`
    list receives one bool per pair: its forward solve ended below the tolerance (DEQ-Flow only)."""
    model.eval()
    flows, nfes = [], []
    for i in range(0, image1.shape[0], batch_size):
        out = model(image1[i : i + batch_size], image2[i : i + batch_size])
        flows.append(out.flow)
        nfes.append(out.deq_stats.nfe if out.deq_stats is not None else model.config.num_flow_updates)
        if converged is not None and out.deq_stats is not None:
            converged.extend(bool(c) for c in out.deq_stats.converged)
    return torch.cat(flows), nfes


def evaluate(
    model,
    *,
    limit: int | None = None,
    progress: bool = True,
    baselines: bool = True,
    max_shift: float | None = None,
    size: tuple[int, int] = EVAL_SIZE,
) -> dict[str, float]:
    """End-point error (pixels, valid pixels) on the held-out synthetic pairs and on the motorcycle stereo
    pair (flow = -disparity at 1/4 resolution), the forward solve's mean f-evaluations and (DEQ-Flow) the
    fraction of solves that ended below the tolerance, and (with `baselines`) the zero flow, Farneback and DIS
    on the same pairs. `limit` scores the first N held-out pairs; `max_shift` draws them with larger (or
    smaller) translations and `size` at another size (`synthetic_pair`), the motorcycle pair unchanged."""
    from tqdm import tqdm

    n = HELD_OUT_PAIRS if limit is None else max(1, min(int(limit), HELD_OUT_PAIRS))
    steps = tqdm(total=2 + (3 if baselines else 0), desc="flow eval", disable=not progress, leave=False)
    image1, image2, flow, valid = held_out_set(n, tuple(size), max_shift=max_shift)
    converged: list[bool] = []
    pred, nfes = model_flow(model, image1, image2, converged=converged)
    result = {"epe_held_out": epe(pred, flow, valid), "nfe_held_out": float(np.mean(nfes))}
    if converged:  # DEQ-Flow: the fraction of pairs whose solve ended below its tolerance
        result["converged_held_out"] = float(np.mean(converged))
    steps.update()
    moto = motorcycle_pair(MOTORCYCLE_SCALE)
    converged = []
    m_pred, m_nfe = model_flow(model, moto.image1[None], moto.image2[None], converged=converged)
    result["epe_motorcycle"] = epe(m_pred[0], moto.flow, moto.valid)
    result["nfe_motorcycle"] = float(m_nfe[0])
    if converged:
        result["converged_motorcycle"] = float(converged[0])
    steps.update()
    if baselines:
        for method in ("zero", "farneback", "dis"):
            result[f"{method}_epe_held_out"] = classical_epe(method, image1, image2, flow, valid)
            result[f"{method}_epe_motorcycle"] = epe(
                classical_flow(method, moto.image1, moto.image2), moto.flow, moto.valid
            )
            steps.update()
    steps.close()
    return {k: round(v, 4) for k, v in result.items()}


def colour_key(size: int = 101) -> torch.Tensor:
    """The colour wheel of `flow_to_image` (uint8 (3, size, size)): the pixel at offset (dx, dy) from the
    centre has the colour of the flow (dx, dy) (image axes: y down) scaled so the rim is the largest flow;
    white outside the disk. A flow image coloured together with the wheel's rim reads off it directly."""
    from torchvision.utils import flow_to_image

    axis = torch.linspace(-1.0, 1.0, size)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    inside = x**2 + y**2 <= 1.0
    field = torch.stack([x, y]) * inside  # zero outside: the largest flow is the rim's, 1
    rgb = flow_to_image(field)
    rgb[:, ~inside] = 255
    return rgb


def _to_hwc(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) float in [0, 1] or uint8 -> (H, W, 3) for imshow."""
    arr = image.detach().cpu()
    if arr.dtype != torch.uint8:
        arr = (arr.float().clamp(0, 1) * 255 + 0.5).to(torch.uint8)
    return arr.permute(1, 2, 0).numpy()


def flow_figure(pair: FlowPair | None, image1: torch.Tensor, image2: torch.Tensor, pred: torch.Tensor,
                title: str):
    """The demo's flow figure (a matplotlib Figure): both input frames, the ground truth (when `pair` has
    one; black where it is not valid), the predicted flow with its EPE, and the colour key. Ground truth and
    prediction are coloured together by torchvision's flow_to_image (one scale: the larger of their largest
    flows), and the key's rim is that largest flow, in pixels."""
    from matplotlib.figure import Figure
    from torchvision.utils import flow_to_image

    pred = pred.detach().float().cpu()
    flows = [pred]
    if pair is not None:
        truth = torch.where(pair.valid[None], pair.flow, torch.zeros_like(pair.flow))
        flows.insert(0, truth)
    stacked = torch.stack(flows)
    rgb = flow_to_image(stacked)  # one normalisation for the whole batch: comparable colours
    scale = float(torch.linalg.vector_norm(stacked, dim=1).max())
    panels = [("frame 1", _to_hwc(image1)), ("frame 2", _to_hwc(image2))]
    if pair is not None:
        truth_rgb = rgb[0].clone()
        truth_rgb[:, ~pair.valid] = 0
        panels.append(("ground truth (black: none)", _to_hwc(truth_rgb)))
        panels.append((f"predicted, EPE {epe(pred, pair.flow, pair.valid):.2f} px", _to_hwc(rgb[-1])))
    else:
        panels.append(("predicted", _to_hwc(rgb[-1])))
    h, w = image1.shape[-2:]
    fig = Figure(figsize=(2.6 * (len(panels) + 0.8), 2.6 * h / w + 1.0), layout="constrained")
    widths = [1.0] * len(panels) + [0.6 * h / w]
    axes = fig.subplots(1, len(panels) + 1, gridspec_kw={"width_ratios": widths})
    for ax, (name, image) in zip(axes, panels):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(name, fontsize="small")
        ax.set_axis_off()
    key = axes[-1]
    key.imshow(_to_hwc(colour_key()), extent=(-scale, scale, scale, -scale))
    key.set_title(f"colour key\n(rim = {scale:.1f} px)", fontsize="small")
    key.set_xlabel("x flow (px)", fontsize="x-small")
    key.set_ylabel("y flow (px, down)", fontsize="x-small")
    key.tick_params(labelsize="x-small")
    fig.suptitle(title, fontsize="medium")
    return fig


def demo(model, output_dir: str | Path = "demo_output"):
    """Flow of one held-out pair and of the motorcycle stereo pair, each written as a figure (frames, ground
    truth, prediction, colour key; `flow_figure`) into `output_dir` (replaced on every run); returns (summary
    line with the EPEs as its metric, the motorcycle solve's statistics: `SolverStats.no_solve()` for the
    explicit RAFT twin)."""
    from deqzoo.core import SolverStats

    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = synthetic_pair(0, EVAL_SIZE, "held-out")
    moto = motorcycle_pair(MOTORCYCLE_SCALE)
    model.eval()
    with torch.no_grad():
        syn = model(pair.image1[None], pair.image2[None])
        out = model(moto.image1[None], moto.image2[None])
    name = Path(str(getattr(model, "name_or_path", "") or "deq-flow")).name
    syn_epe, moto_epe = epe(syn.flow[0], pair.flow, pair.valid), epe(out.flow[0], moto.flow, moto.valid)
    p1 = save_figure(flow_figure(pair, pair.image1, pair.image2, syn.flow[0],
                                 f"{name}: held-out synthetic pair"), out_dir / f"{name}_held_out_flow.png")
    p2 = save_figure(flow_figure(moto, moto.image1, moto.image2, out.flow[0],
                                 f"{name}: motorcycle stereo pair (1/4 res)"),
                     out_dir / f"{name}_motorcycle_flow.png")
    stats = out.deq_stats if out.deq_stats is not None else SolverStats.no_solve()  # the explicit twin
    summary = (
        f"held-out pair EPE {syn_epe:.2f} px -> {p1}; motorcycle "
        f"(1/4 res) disparity EPE {moto_epe:.2f} px -> {p2}"
    )
    return DemoSummary(summary, f"EPE {syn_epe:.2f} px held-out, {moto_epe:.2f} px motorcycle"), stats


