"""Fast checks of the app that need neither Gradio nor a model (default suite)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

from deqzoo_app import families as F


def test_app_without_gradio_names_the_extra(monkeypatch, capsys):
    from deqzoo.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gradio" else real(name, *a))
    assert main(["app"]) == 2
    assert 'pip install "deqzoo[app]"' in capsys.readouterr().err


def test_app_outside_a_clone_says_it_ships_with_the_repository(monkeypatch, tmp_path, capsys):
    # what an installed wheel gives (deqzoo_app/ is not in it; tests/hub/test_wheel.py runs the wheel's): the
    # clone is found from the package's location, so the package is placed outside one
    import deqzoo
    from deqzoo.cli import main

    installed = tmp_path / "site-packages" / "deqzoo"
    installed.mkdir(parents=True)
    monkeypatch.setattr(deqzoo, "__file__", str(installed / "__init__.py"))
    assert main(["app"]) == 2
    err = capsys.readouterr().err
    assert "ships with the deqzoo repository" in err and 'pip install -e ".[app]"' in err


def test_drawn_digit_becomes_mnist_like():
    # a dark bar on white paper, off-centre: inverted to light-on-dark, scaled into 20x20, centred by mass
    paper = np.full((200, 300), 255, np.uint8)
    paper[20:120, 30:50] = 0
    digit = F.digit_from_input(paper)
    assert digit.shape == (28, 28) and digit.dtype == np.uint8
    assert digit[0].max() == 0 and digit[:, 0].max() == 0  # dark border
    rows, cols = np.nonzero(digit > 50)
    assert rows.max() - rows.min() + 1 <= 21
    assert abs(rows.mean() - 13.5) <= 1.5 and abs(cols.mean() - 13.5) <= 1.5


def test_blank_drawing_is_refused():
    with pytest.raises(ValueError, match="blank"):
        F.digit_from_input(np.full((50, 50, 4), 0, np.uint8))


def test_read_image_checks_before_decoding(tmp_path):
    cmyk = tmp_path / "c.jpg"
    Image.new("CMYK", (8, 8)).save(cmyk)
    with pytest.raises(ValueError, match="c.jpg.*mode 'CMYK'"):
        F.read_image(cmyk)
    junk = tmp_path / "j.png"
    junk.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="j.png.*not a readable image"):
        F.read_image(junk)
    big = tmp_path / "big.png"
    big.write_bytes(bytes(F.MAX_IMAGE_BYTES + 1))
    with pytest.raises(ValueError, match="big.png.*bytes, above the limit"):
        F.read_image(big)
    with pytest.raises(ValueError, match="no frames"):
        F.flow_frames([])


def test_numbers_from_callers_that_bypass_the_page_are_clamped_to_its_ranges():
    # Gradio refuses a value outside a slider's range; a direct caller of the functions gets the range's edge
    assert F.clamp_int(10**12, "new_tokens", "new tokens") == F.LIMITS["new_tokens"][1]
    assert F.clamp_int(-5, "ddim_steps", "steps T") == F.LIMITS["ddim_steps"][0]
    assert F.clamp_float(1e-30, "tol", "tolerance") == F.LIMITS["tol"][0]
    assert F.clamp_float(float("inf"), "zoom", "zoom") == F.LIMITS["zoom"][1]
    for bad in (float("nan"), "many", None, True):
        with pytest.raises(ValueError, match="new tokens must be a number"):
            F.clamp_int(bad, "new_tokens", "new tokens")


def test_prompt_is_counted_in_tokens_before_any_solve():
    with pytest.raises(ValueError, match=r"8,000 tokens \(2,000 characters\).*at most 256"):
        F.generate_text("\U0001F600" * 2000, 8)
    with pytest.raises(ValueError, match="prompt is empty"):
        F.generate_text("   ", 8)
