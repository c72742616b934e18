"""examples/deq_flow/video.py: the synthetic video's flows are exact (moved out of the package with its
test, from tests/models/deq_flow/test_flow_task.py)."""

from __future__ import annotations

import pytest
import torch

from examples.deq_flow.flow import warp
from examples.deq_flow.video import main, synthetic_video


def warp_error(image1, image2, f, valid):
    """Mean error of frame 2 warped back by `f`, on valid and on invalid pixels (as the task's tests)."""
    back = warp(image2[None], f[None])[0]
    err = (back - image1).abs().mean(0)
    return float(err[valid].mean()), float(err[~valid].mean()) if bool((~valid).any()) else float("nan")


def test_video_flows_are_exact():
    frames, flows, valid = synthetic_video(5, (96, 128))
    assert frames.shape == (5, 3, 96, 128) and flows.shape == (4, 2, 96, 128)
    for t in range(4):
        err, _ = warp_error(frames[t], frames[t + 1], flows[t], valid[t])
        zero, _ = warp_error(frames[t], frames[t + 1], torch.zeros_like(flows[t]), valid[t])
        assert err < 0.2 * zero
    with pytest.raises(ValueError, match="num_frames"):
        synthetic_video(1)


def test_main_writes_a_video_folder_and_keeps_a_users_folder(tmp_path):
    out = tmp_path / "video"
    assert main(["--frames", "3", "--height", "24", "--width", "32", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["frame0.png", "frame1.png", "frame2.png"]
    assert sorted(p.name for p in tmp_path.glob("video_true_flow*.png")) == ["video_true_flow0_1.png",
                                                                            "video_true_flow1_2.png"]
    with pytest.raises(SystemExit):  # an existing, non-empty folder is refused, not written into
        main(["--frames", "2", "--out", str(out)])
