"""Embedded Implicit² checkpoints: the card's numbers are what `deqzoo eval` computes, and renders work."""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
CARDS = [ROOT / "model_cards" / n for n in ("implicit2-isiren-camera", "implicit2-igabor-mfn-camera")]


@pytest.mark.parametrize("card", CARDS, ids=lambda p: p.name)
def test_checkpoint_matches_its_card_and_renders_at_2x(card, tmp_path):
    if not card.is_dir():
        pytest.skip("embedded checkpoint not built yet")
    from PIL import Image

    from deqzoo.hub.cards import card_metrics, read_model_card
    from deqzoo.models.implicit2 import Implicit2ForSignalRepresentation
    from deqzoo.predict import render_signal as predict
    from examples.implicit2.images import evaluate

    model = Implicit2ForSignalRepresentation.from_pretrained(card)
    metrics = evaluate(model, progress=False)
    meta, body = read_model_card(card)
    assert metrics == card_metrics(meta)
    assert meta["deqzoo_task"] == "implicit2" and "deqzoo eval" in body
    size = model.config.task_specific_params["implicit2"]["size"]
    out = tmp_path / "r.png"
    predict(model, f"2x:{out}")
    img = Image.open(out)
    assert img.size == (2 * size, 2 * size)
    # the 2x render, downsampled, is the fitted image (PSNR well above a flat image's)
    from examples.implicit2.images import load_image, psnr

    arr = torch.tensor(list(img.getdata()), dtype=torch.float32).reshape(2 * size, 2 * size) / 255
    down = torch.nn.functional.avg_pool2d(arr[None, None], 2)[0, 0]
    target = load_image("camera", size)[:, :, 0]
    flat = torch.full_like(target, float(target.mean()))
    assert psnr(down * 2 - 1, target * 2 - 1) > psnr(flat * 2 - 1, target * 2 - 1) + 5
