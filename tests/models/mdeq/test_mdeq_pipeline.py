"""Embedded MNIST checkpoints: card numbers reproduce, stock pipeline on raw PIL images, processor, task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, pipeline

import deqzoo
from deqzoo.hub import read_model_card, resolve
from deqzoo.hub.cards import card_metrics
from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor
from deqzoo.predict import classify_image
from examples.mdeq import mnist

torch.set_num_threads(1)
IDS = ["deqzoo/mdeq-tiny-mnist", "deqzoo/lipschitz-mdeq-tiny-mnist"]


def _card(model_id: str) -> dict[str, float]:
    meta, _ = read_model_card(resolve(model_id))
    return card_metrics(meta)


def test_split_is_fixed_and_balanced():
    xtr, ytr = mnist.load_split("train")
    xte, yte = mnist.load_split("test")
    assert xtr.shape == (4000, 28, 28) and xte.shape == (1000, 28, 28)
    assert np.bincount(ytr).tolist() == [400] * 10 and np.bincount(yte).tolist() == [100] * 10
    train_keys = {im.tobytes() for im in xtr}
    assert not any(im.tobytes() in train_keys for im in xte[:200])


def test_plain_checkpoint_reproduces_its_card_and_meets_the_target():
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    metrics = mnist.evaluate(model, progress=False)
    card = _card("deqzoo/mdeq-tiny-mnist")
    assert metrics == {k: card[k] for k in ("accuracy", "converged", "mean_nfe")}
    # the flagship's target: >= 95% of held-out images converge within the budget, accuracy >= 0.975
    assert metrics["accuracy"] >= 0.975 and metrics["converged"] >= 0.95


def test_lipschitz_card_reports_fewer_iterations_at_the_same_tolerance():
    plain, lip = (deqzoo.from_pretrained(i) for i in IDS)
    assert plain.config.deq["f_tol"] == lip.config.deq["f_tol"]
    assert plain.config.deq["f_stop_mode"] == lip.config.deq["f_stop_mode"]
    assert _card(IDS[1])["mean_nfe"] < _card(IDS[0])["mean_nfe"]
    sub = mnist.evaluate(lip, limit=200, progress=False)  # re-measured on a subset
    assert sub["mean_nfe"] < plain.config.deq["f_max_iter"] and sub["accuracy"] >= 0.9


@pytest.mark.parametrize("model_id", IDS)
def test_stock_pipeline_on_raw_pil_images_matches_deqzoo_eval(model_id):
    directory = resolve(model_id)
    __import__("deqzoo").register()  # stock transformers code: families registered explicitly
    clf = pipeline("image-classification", model=str(directory))
    assert isinstance(clf.image_processor, MDEQImageProcessor)
    x, y = mnist.load_split("test")
    order = np.argsort(np.arange(len(y)) % 100, kind="stable")[:100]  # the subset evaluate(limit=100) uses
    images = [Image.fromarray(im, mode="L") for im in x[order]]
    preds = [int(r[0]["label"]) for r in clf(images)]
    pipe_acc = round(float(np.mean(np.array(preds) == y[order])), 4)
    model = deqzoo.from_pretrained(model_id)
    assert pipe_acc == mnist.evaluate(model, limit=100, progress=False)["accuracy"]
    # batched inference un-batches the outputs (deq_stats included) and gives the same predictions
    batched = [int(r[0]["label"]) for r in clf(images[:12], batch_size=4)]
    assert batched == preds[:12]
    # an RGB, 2x larger copy is converted back to the same 28x28 grayscale input (up to resampling)
    rgb = images[0].convert("RGB").resize((56, 56), Image.NEAREST)
    assert clf(rgb)[0]["label"] == clf(images[0])[0]["label"]


def test_processor_round_trip_and_conversions(tmp_path):
    proc = AutoImageProcessor.from_pretrained(resolve("deqzoo/mdeq-tiny-mnist"))
    assert isinstance(proc, MDEQImageProcessor) and proc.num_channels == 1
    proc.save_pretrained(tmp_path)
    again = AutoImageProcessor.from_pretrained(tmp_path)
    im = Image.fromarray(np.uint8(np.arange(28 * 28).reshape(28, 28) % 256), mode="L")
    a = proc(im, return_tensors="pt")["pixel_values"]
    assert torch.equal(a, again(im, return_tensors="pt")["pixel_values"])
    expected = (np.asarray(im, dtype=np.float64) / 255 - 0.1307) / 0.3081
    assert a.shape == (1, 1, 28, 28) and np.allclose(a[0, 0].numpy(), expected, atol=1e-5)
    rgb = proc(Image.merge("RGB", [im, im, im]), return_tensors="pt")["pixel_values"]
    assert torch.allclose(rgb, a, atol=1e-5)  # RGB of a gray image -> the same luminance
    arr = proc(np.asarray(im)[..., None], return_tensors="pt")["pixel_values"]  # numpy (H, W, 1)
    assert torch.allclose(arr, a, atol=1e-5)
    arr3 = proc(np.repeat(np.asarray(im)[None], 3, axis=0), return_tensors="pt")["pixel_values"]  # (3, H, W)
    assert torch.allclose(arr3, a, atol=1e-3)
    with pytest.raises(ValueError, match="num_channels"):
        MDEQImageProcessor(num_channels=2)


def test_task_demo_and_predict(tmp_path):
    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
    summary, stats = mnist.demo(model)
    assert "correct" in summary and stats.nfe >= 1
    x, y = mnist.sample_images()
    path = tmp_path / "digit.png"
    Image.fromarray(x[3], mode="L").save(path)
    logits = model(mnist.to_pixel_values(x[3:4], model)).logits[0]
    probs = logits.softmax(-1)
    line = classify_image(model, str(path))
    assert line.startswith(f"{int(logits.argmax())} (top-3 probabilities: {int(logits.argmax())} ")
    assert f"{float(probs.max()):.4f}" in line and "solve converged" in line
    with pytest.raises(FileNotFoundError, match="no image file"):
        classify_image(model, str(tmp_path / "missing.png"))
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        classify_image(model, str(tmp_path / "bad.png"))


# --- inputs as people give them: polarity, RGB / RGBA, digits the project did not make (issue 31) ---

def _accuracy(model, images: np.ndarray, labels: np.ndarray, mode: str, **proc_kwargs) -> float:
    proc = MDEQImageProcessor.from_config(model.config)
    preds = []
    for s in range(0, len(labels), 100):
        batch = images[s : s + 100]
        if mode in ("inverted", "inverted_rgb"):  # black ink on white paper, as a paint program gives
            batch = 255 - batch
        pil = [Image.fromarray(a, mode="L") for a in batch]
        if mode in ("rgb", "inverted_rgb"):
            pil = [im.convert("RGB") for im in pil]
        if mode == "rgba":  # black ink whose alpha is the stroke, on a transparent background
            pil = [Image.fromarray(np.dstack([np.zeros((*a.shape, 3), np.uint8), a]), "RGBA") for a in batch]
        pixels = proc(pil, return_tensors="pt", **proc_kwargs)["pixel_values"].float()
        with torch.no_grad():
            preds.append(model(pixel_values=pixels).logits.argmax(-1).numpy())
    return float((np.concatenate(preds) == labels).mean())


MODES = ("inverted", "rgb", "inverted_rgb", "rgba")


@pytest.fixture(scope="module")
def made_by_code():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("_mnist_digits.py")
    spec = importlib.util.spec_from_file_location("_mnist_digits", path)
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    generated_digits, machine_fonts = digits.generated_digits, digits.machine_fonts

    if not machine_fonts():
        pytest.skip("no fonts on this machine (fc-list)")
    return generated_digits()


@pytest.mark.parametrize("model_id", IDS)
def test_either_polarity_and_any_mode_classify_as_the_originals(model_id, made_by_code):
    model = deqzoo.from_pretrained(model_id).eval()
    x, y = mnist.load_split("test")
    order = np.argsort(np.arange(len(y)) % 100, kind="stable")[:500]  # a class-balanced half of held-out
    sets = {"mnist": (x[order], y[order])}
    images, labels, source = made_by_code
    sets["fonts"] = images[source == 0], labels[source == 0]
    sets["strokes"] = images[source == 1], labels[source == 1]
    for name, (ims, labs) in sets.items():
        base = _accuracy(model, ims, labs, "original")
        for mode in MODES:
            assert abs(_accuracy(model, ims, labs, mode) - base) <= 0.01, (name, mode)
        # the models read digits drawn by code (fonts: 0.79-0.80, pen strokes 0.97-0.99 when measured)
        assert base >= {"mnist": 0.95, "fonts": 0.7, "strokes": 0.9}[name], (name, base)
    # without the inversion, dark-on-light digits are misread: the option is what makes the difference
    ims, labs = sets["mnist"]
    assert _accuracy(model, ims, labs, "inverted", do_invert=False) < 0.5


def test_do_invert_option_and_border_rule(tmp_path):
    from deqzoo.models.mdeq.image_processing_mdeq import has_light_background

    proc = AutoImageProcessor.from_pretrained(resolve("deqzoo/mdeq-tiny-mnist"))
    assert proc.do_invert is None  # the cards' default: decided per image from its border
    x, _ = mnist.load_split("test")
    assert not any(has_light_background(im[None]) for im in x)  # no held-out MNIST digit is inverted by it
    light, dark = x[0], 255 - x[0]
    as_pixels = lambda im, **kw: proc(Image.fromarray(im, "L"), return_tensors="pt", **kw)["pixel_values"]  # noqa: E731
    assert torch.equal(as_pixels(dark), as_pixels(light))
    plain = ((torch.from_numpy(dark) / 255 - 0.1307) / 0.3081)[None, None]
    assert torch.allclose(as_pixels(dark, do_invert=False), plain, atol=1e-6)
    assert torch.equal(as_pixels(light, do_invert=True), as_pixels(dark, do_invert=False))
    config = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").config
    forced = MDEQImageProcessor.from_config(config, do_invert=False)
    forced.save_pretrained(tmp_path)
    again = AutoImageProcessor.from_pretrained(tmp_path)
    assert again.do_invert is False and torch.equal(again(Image.fromarray(dark, "L"), return_tensors="pt")[
        "pixel_values"], as_pixels(dark, do_invert=False))
    # float arrays in [0, 1] invert as 1 - x; 2-D arrays and tensors are one grayscale image
    unit = proc(dark.astype(np.float32) / 255, do_rescale=False, return_tensors="pt")["pixel_values"]
    assert torch.allclose(unit, as_pixels(light), atol=1e-5)
    assert torch.equal(proc(torch.from_numpy(dark), return_tensors="pt")["pixel_values"], as_pixels(light))
    # an RGB model never inverts unless asked
    rgb = MDEQImageProcessor(num_channels=3, size={"height": 28, "width": 28})
    paper = np.full((28, 28, 3), 240, np.uint8)
    assert float(rgb(paper, return_tensors="pt")["pixel_values"].mean()) > 0.8
    with pytest.raises(ValueError, match="do_invert"):
        MDEQImageProcessor(num_channels=1, do_invert="auto")


def test_loading_the_processor_prints_no_backend_notice():
    import subprocess
    import sys

    code = ("import deqzoo, transformers; from deqzoo.hub import resolve; deqzoo.register(); "
            "p = transformers.AutoImageProcessor.from_pretrained(str(resolve('deqzoo/mdeq-tiny-mnist'))); "
            "print(type(p).__name__, p.backend)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["MDEQImageProcessor", "torchvision"]
    assert "backend is not available" not in run.stderr + run.stdout
