"""A held-out synthetic video with exact flow, rendered from the layers of `flow.py` (the data of
`benchmarks/deq_flow.py`'s frame-to-frame reuse runs; moved out of the installed package, which evaluates
on pairs only).

Run it to write a video's frames and its ground-truth flows (colour PNGs) into a folder, e.g. to try
`deqzoo predict deqzoo/deq-flow-cpu-synth FOLDER`:

    python examples/deq_flow/video.py --frames 8 --out video_frames

Example:
    >>> from examples.deq_flow.video import synthetic_video
    >>> frames, flows, valid = synthetic_video(3, (48, 64))
    >>> tuple(frames.shape), tuple(flows.shape), tuple(valid.shape)
    ((3, 3, 48, 64), (2, 2, 48, 64), (2, 48, 64))
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

# the scene machinery of the task's pairs: a video is rendered exactly as they are
if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_flow.flow import (
    _LFW_TRAIN,
    Map,
    _affine,
    _faces,
    _flow,
    _inverse_map,
    _Layer,
    _render,
    _texture,
)


def synthetic_video(
    num_frames: int = 12, size: tuple[int, int] = (96, 128), seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A held-out video: the camera pans (and slowly zooms/rotates) over `chelsea` while a face from the
    held-out lfw faces moves across. Returns frames (T, 3, H, W), flows (T-1, 2, H, W) and valid
    (T-1, H, W)."""
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2, got {num_frames}")
    h, w = size
    rng = np.random.default_rng([seed, 7, h, w])
    bg = _texture("chelsea")
    ht, wt = bg.shape[-2:]
    center = ((w - 1) / 2, (h - 1) / 2)
    start = np.array([wt * 0.3, ht * 0.4])
    velocity = rng.uniform(2.0, 4.0, size=2) * np.array([1.0, 0.5])
    face = _faces()[_LFW_TRAIN + int(rng.integers(200 - _LFW_TRAIN))]
    fw = face.shape[-1]
    f_start, f_velocity = np.array([w * 0.25, h * 0.3]), rng.uniform(2.5, 4.0, size=2) * np.array([1.0, 0.6])
    bg_maps, face_maps = [], []
    for t in range(num_frames):
        cam = _affine(
            1.0 / (1.0 + 0.01 * t), 0.005 * t, tuple(start + velocity * t - np.array(center)), center
        )
        bg_maps.append(cam)
        # face: frame -> face texture; 40 px wide on screen, drifting and turning slowly
        pos = f_start + f_velocity * t
        fm = _affine(fw / 40.0, 0.03 * t, (0.0, 0.0), (0.0, 0.0))
        fm[:2, 2] = np.array([(fw - 1) / 2, (fw - 1) / 2]) - fm[:2, :2] @ pos
        face_maps.append(fm)
    layers = [
        _Layer(bg, *_maps(bg_maps), None),
        _Layer(face, *_maps(face_maps), ((fw - 1) / 2, (fw - 1) / 2, fw * 0.42, fw * 0.5, 0.0)),
    ]
    frames = torch.stack([_render(layers, t, h, w) for t in range(num_frames)])
    flows, valid = zip(*[_flow(layers, t, h, w) for t in range(num_frames - 1)])
    return frames, torch.stack(flows), torch.stack(valid)


def _maps(ms: list[np.ndarray]) -> tuple[list[Map], list[Map]]:
    pairs = [_inverse_map(m) for m in ms]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def main(argv: list[str] | None = None) -> int:
    from examples.deq_flow.flow import flow_png

    parser = argparse.ArgumentParser(description="Write a synthetic video's frames and exact flows as PNGs.")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty; choose a new folder")
    frames, flows, _ = synthetic_video(args.frames, (args.height, args.width), args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    for t, frame in enumerate(frames):
        pixels = (frame.permute(1, 2, 0).numpy() * 255 + 0.5).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(args.out / f"frame{t}.png")
    for t, f in enumerate(flows):  # named apart from the frames: the folder stays a video for `predict`
        flow_png(f, args.out.parent / f"{args.out.name}_true_flow{t}_{t + 1}.png")
    print(f"wrote {len(frames)} frames to {args.out} and {len(flows)} ground-truth flows beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
