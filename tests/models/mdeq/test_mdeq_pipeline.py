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
from deqzoo.tasks import mnist

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
    line = mnist.predict(model, str(path))
    assert line.startswith(f"{int(logits.argmax())} (top-3 probabilities: {int(logits.argmax())} ")
    assert f"{float(probs.max()):.4f}" in line and "solve converged" in line
    with pytest.raises(FileNotFoundError, match="no image file"):
        mnist.predict(model, str(tmp_path / "missing.png"))
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        mnist.predict(model, str(tmp_path / "bad.png"))
