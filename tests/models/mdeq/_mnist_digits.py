"""Digits made by code, not picked by hand: the machine's fonts (``fc-list``) and random pen strokes,
framed as MNIST frames its digits (the ink's bounding box scaled into 20x20, centred by its centre of mass
in 28x28), light on dark, uint8. Used to check that the MNIST models read inputs the project did not make."""

from __future__ import annotations

import glob
import math
import shutil
import subprocess

import numpy as np
from PIL import Image, ImageDraw, ImageFont

CANVAS = 96  # drawing resolution before MNIST framing


def machine_fonts() -> list[str]:
    """TrueType/OpenType files the machine's fontconfig lists (fallback: /usr/share/fonts), sorted."""
    files: list[str] = []
    if shutil.which("fc-list"):
        out = subprocess.run(["fc-list", ":", "file"], capture_output=True, text=True, check=False).stdout
        files = [line.split(":")[0].strip() for line in out.splitlines() if line.strip()]
    if not files:
        files = glob.glob("/usr/share/fonts/**/*.[ot]tf", recursive=True)
    return sorted({f for f in files if f.lower().endswith((".ttf", ".otf"))})


def mnist_frame(canvas: np.ndarray) -> np.ndarray | None:
    """A light-on-dark drawing -> 28x28 uint8 as MNIST: bounding box into 20x20 (aspect kept, antialiased),
    centre of mass at the centre. None when nothing was drawn."""
    ys, xs = np.nonzero(canvas > 0)
    if len(ys) == 0:
        return None
    crop = Image.fromarray(canvas[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])
    scale = 20.0 / max(crop.size)
    size = (max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale)))
    small = np.asarray(crop.resize(size, Image.LANCZOS), dtype=np.float64)
    out = np.zeros((28, 28))
    top, left = (28 - size[1]) // 2, (28 - size[0]) // 2
    out[top : top + size[1], left : left + size[0]] = small
    mass = out.sum()
    cy, cx = (np.arange(28)[:, None] * out).sum() / mass, (np.arange(28)[None, :] * out).sum() / mass
    dy, dx = round(13.5 - cy), round(13.5 - cx)
    out = np.roll(np.roll(out, dy, axis=0), dx, axis=1)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def font_digit(path: str, digit: int, rng: np.random.Generator) -> np.ndarray | None:
    """One digit from a font file: random stroke thickening and a small random rotation."""
    try:
        font = ImageFont.truetype(path, 64)
    except OSError:
        return None
    img = Image.new("L", (CANVAS, CANVAS), 0)
    draw = ImageDraw.Draw(img)
    draw.text((CANVAS / 2, CANVAS / 2), str(digit), fill=255, font=font, anchor="mm",
              stroke_width=int(rng.integers(0, 3)), stroke_fill=255)
    img = img.rotate(float(rng.uniform(-10, 10)), resample=Image.BILINEAR)
    return mnist_frame(np.asarray(img))


def _arc(cx, cy, rx, ry, a0, a1, n=16):
    """Points of an elliptic arc, angles in degrees (0 = right, 90 = down in image coordinates)."""
    return [(cx + rx * math.cos(math.radians(a)), cy + ry * math.sin(math.radians(a)))
            for a in np.linspace(a0, a1, n)]


# Pen strokes per digit in a unit box (x right, y down); each digit is a list of polylines.
STROKES = {
    0: [_arc(0.5, 0.5, 0.3, 0.45, 0, 360, 32)],
    1: [[(0.35, 0.2), (0.55, 0.05), (0.55, 0.95)]],
    2: [_arc(0.5, 0.3, 0.3, 0.25, 190, 380) + [(0.15, 0.95), (0.85, 0.95)]],
    3: [_arc(0.5, 0.28, 0.28, 0.22, 200, 450), _arc(0.5, 0.72, 0.32, 0.24, 270, 520)],
    4: [[(0.6, 0.05), (0.1, 0.65), (0.9, 0.65)], [(0.62, 0.35), (0.62, 0.95)]],
    5: [[(0.8, 0.05), (0.25, 0.05), (0.2, 0.45)] + _arc(0.5, 0.68, 0.32, 0.27, 230, 490)],
    6: [[(0.7, 0.05)] + _arc(0.5, 0.7, 0.3, 0.25, 200, 560)],
    7: [[(0.1, 0.08), (0.9, 0.08), (0.4, 0.95)]],
    8: [_arc(0.5, 0.27, 0.24, 0.22, 0, 360, 24), _arc(0.5, 0.72, 0.3, 0.24, 0, 360, 24)],
    9: [_arc(0.5, 0.3, 0.28, 0.25, 0, 360, 24), [(0.78, 0.3), (0.7, 0.95)]],
}


def stroke_digit(digit: int, rng: np.random.Generator) -> np.ndarray | None:
    """One digit drawn as pen strokes: jittered control points, random slant, aspect and pen width."""
    slant, aspect = rng.uniform(-0.25, 0.25), rng.uniform(0.7, 1.1)
    width = int(rng.integers(5, 11))
    img = Image.new("L", (CANVAS, CANVAS), 0)
    draw = ImageDraw.Draw(img)
    span = CANVAS * 0.7
    for line in STROKES[digit]:
        jitter = rng.normal(0.0, 0.025, size=(len(line), 2)).cumsum(0) * 0.5  # a wandering hand
        pts = [((x - 0.5 + slant * (0.5 - y)) * aspect * span + CANVAS / 2 + jx * span,
                (y - 0.5) * span + CANVAS / 2 + jy * span) for (x, y), (jx, jy) in zip(line, jitter)]
        draw.line(pts, fill=255, width=width, joint="curve")
        for x, y in (pts[0], pts[-1]):  # round pen ends
            draw.ellipse((x - width / 2, y - width / 2, x + width / 2, y + width / 2), fill=255)
    return mnist_frame(np.asarray(img))


def generated_digits(per_digit_strokes: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images (N, 28, 28) uint8 light on dark, labels (N,), source (N,): 0 = font, 1 = strokes): every digit
    in every machine font, plus `per_digit_strokes` random stroke drawings per digit."""
    rng = np.random.default_rng(seed)
    images, labels, source = [], [], []
    for path in machine_fonts():
        for d in range(10):
            im = font_digit(path, d, rng)
            if im is not None:
                images.append(im), labels.append(d), source.append(0)
    for d in range(10):
        for _ in range(per_digit_strokes):
            im = stroke_digit(d, rng)
            if im is not None:
                images.append(im), labels.append(d), source.append(1)
    return np.stack(images), np.array(labels), np.array(source)
