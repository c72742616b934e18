"""The implicit2 task: data splits, PSNR, fitting with reuse/projection, evaluate/predict/demo."""

import math

import pytest
import torch

from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
from deqzoo.predict import render_signal
from examples.implicit2 import images as task


def test_generalization_split_is_two_disjoint_quarters_of_the_grid():
    data = task.image_data("camera", 16, "generalization")
    assert data.train_coords.shape == (64, 2) and data.test_coords.shape == (64, 2)
    train = {tuple(c) for c in data.train_coords.tolist()}
    test = {tuple(c) for c in data.test_coords.tolist()}
    assert not train & test
    full = task.image_data("camera", 16, "full")
    img = full.image
    # train pixels are the even rows/columns of the image, test the odd ones, values in [-1, 1]
    torch.testing.assert_close(data.train_values.reshape(8, 8, 1), img[::2, ::2] * 2 - 1)
    torch.testing.assert_close(data.test_values.reshape(8, 8, 1), img[1::2, 1::2] * 2 - 1)
    rgb = task.image_data("astronaut", 8)
    assert rgb.train_values.shape == (64, 3) and float(rgb.train_values.abs().max()) <= 1


def test_bad_image_names_sizes_and_splits_are_errors():
    with pytest.raises(ValueError, match="unknown image 'lena'"):
        task.load_image("lena", 16)
    with pytest.raises(ValueError, match="size"):
        task.load_image("camera", 10**6)
    with pytest.raises(ValueError, match="split"):
        task.image_data("camera", 8, "half")


def test_psnr_matches_its_definition():
    target = torch.zeros(100, 1)
    values = torch.full((100, 1), 0.2)  # intensities 0.5 vs 0.6: mse 0.01 -> 20 dB
    assert task.psnr(values, target) == pytest.approx(20.0)
    assert task.psnr(target, target) == math.inf
    assert task.psnr(torch.full((4, 1), 5.0), torch.ones(4, 1)) == math.inf  # clamped as the original


def _tiny(filter_type="gabor", implicit=True, image="camera", size=16, split="full"):
    torch.manual_seed(0)
    cfg = Implicit2Config(
        filter_type=filter_type,
        implicit=implicit,
        hidden_size=32,
        input_scale=32.0,
        task_specific_params={"implicit2": {"image": image, "size": size, "split": split}},
    )
    return Implicit2ForSignalRepresentation(cfg)


def test_predict_writes_a_png_at_2x_and_never_overwrites(tmp_path):
    from PIL import Image

    model = _tiny(size=8)
    out = tmp_path / "r.png"
    msg = render_signal(model, f"2x:{out}")
    assert "16x16" in msg and Image.open(out).size == (16, 16)
    out.write_bytes(b"user file")
    render_signal(model, f"3x5:{out}")
    assert out.read_bytes() == b"user file"  # untouched; the render went next to it
    assert Image.open(tmp_path / "r-1.png").size == (5, 3)
    for bad in ("huge", "0x5", f"2x:{tmp_path / 'a.jpg'}"):
        with pytest.raises(ValueError):
            render_signal(model, bad)


def test_evaluate_needs_the_task_settings():
    model = Implicit2ForSignalRepresentation(Implicit2Config(hidden_size=8))
    with pytest.raises(ValueError, match="task_specific_params"):
        task.evaluate(model)


def test_demo_renders_at_twice_the_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary, stats = task.demo(_tiny(size=8).eval(), output_dir=tmp_path / "out")
    assert "16x16" in summary and stats.nfe >= 1
    assert (tmp_path / "out" / "implicit2_16x16.png").exists()
    assert not (tmp_path / "demo_output").exists()  # only the folder it was given
    summary, stats = task.demo(_tiny(size=8, implicit=False).eval(), output_dir=tmp_path / "out")
    assert stats.nfe == 0
