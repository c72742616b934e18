"""Every app endpoint through gradio_client against the live app (no browser): real outputs checked against
what the checkpoints' cards and the models say, and bad inputs answered with the library's clear errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.app

MNIST = "deqzoo/mdeq-tiny-mnist"


@pytest.fixture(scope="module")
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in {text!r}"
    return float(match.group(1))


def test_classify_digit_each_example_and_budget(client):
    for digit in (0, 3, 7):
        labels, _, summary, _ = client.predict(None, None, digit, MNIST, "anderson", 30, 1e-4,
                                               api_name="/classify_digit")
        assert labels["label"] == str(digit)
    assert _number(r"accuracy ([\d.]+)%", summary.split("held-out")[1]) >= 95.0  # card: 97.8% on 1,000
    _, _, starved, _ = client.predict(None, None, 3, MNIST, "fixed_point", 1, 1e-6,
                                      api_name="/classify_digit")
    assert "not converged" in starved and "1 f-evaluations" in starved


def test_classify_uploaded_dark_on_light_digit(client, tmp_path):
    # a digit drawn dark on white paper, larger than MNIST: the app inverts and centres it as MNIST was made
    from gradio_client import handle_file

    from deqzoo_app.families import sample_digit

    big = Image.fromarray(255 - sample_digit(7)).resize((200, 200), Image.BICUBIC)
    path = tmp_path / "seven.png"
    big.save(path)
    labels, _, _, _ = client.predict(None, handle_file(str(path)), 0, MNIST, "anderson", 30, 1e-4,
                                     api_name="/classify_digit")
    assert labels["label"] == "7"


def test_generate_reports_nfe_per_token(client):
    tokens, _, summary = client.predict("The for statement is used to", 8, 0, "anderson", 30, 1e-3,
                                        api_name="/generate")
    pieces = tokens["value"] if isinstance(tokens, dict) else tokens
    generated = [p for p in pieces if (p.get("class_or_confidence") if isinstance(p, dict) else p[1])]
    assert len(generated) == 8
    nfes = [int(str(p["class_or_confidence"] if isinstance(p, dict) else p[1]).split()[1]) for p in generated]
    assert all(1 <= n <= 30 for n in nfes)
    assert "8 new tokens" in summary


def test_flow_example_recovers_known_motion_and_reuse_saves_steps(client):
    *_, summary = client.predict(api_name="/flow_example")
    rows = [r for r in summary.splitlines() if re.match(r"\| \d-\d", r)]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[5]) < 1.5  # EPE with reuse, px, against the true (-3, -2) motion
    found = re.search(r"(\d+) f-evaluations solving.*?(\d+) starting", summary, re.S)
    zero, reuse = (int(x) for x in found.groups())
    assert reuse < zero


def test_render_inr_matches_fitted_pixels_at_zoom_one(client):
    render, reference, summary = client.predict("deqzoo/implicit2-isiren-camera", 1, 0, 0, 64,
                                                api_name="/render_inr")
    a = np.asarray(Image.open(render).convert("L"), dtype=np.float64) / 255
    b = np.asarray(Image.open(reference).convert("L"), dtype=np.float64) / 255
    psnr = 10 * np.log10(1 / np.mean((a - b) ** 2))
    assert psnr > 18, psnr  # card: 26.0 dB on all 256x256 pixels; here 64x64 nearest samples of them
    assert "f-evaluations" in summary


def test_ddim_compare_counts_depth(client):
    _, _, summary = client.predict(10, 0, 2, "anderson", 1e-3, api_name="/ddim_compare")
    assert "| DDIM (diffusers) | **10** | 20 |" in summary
    depth = int(re.search(r"DEQ-DDIM \(anderson\) \| \*\*(\d+)\*\*", summary).group(1))
    assert 1 <= depth <= 11
    assert _number(r"samplers ([\d.e+-]+)", summary) < 0.05


def test_ignn_chains_needs_the_budget_to_reach_the_far_end(client):
    *_, full = client.predict(100, 140, api_name="/ignn_chains")
    assert "accuracy 100.0% over all nodes" in full
    *_, short = client.predict(100, 10, api_name="/ignn_chains")
    # 10 fixed-point steps move the label at most 10 hops: the far end of a 100-node chain is a coin toss
    assert _number(r"([\d.]+)% at the far end", short) <= 75.0


def test_hypersolver_race(client):
    _, table = client.predict(30, 1e-4, 50, api_name="/hyper_vs_anderson")
    assert "| Anderson (anderson) |" in table and "| hypersolver (anderson) |" in table
    assert "learned initializer" in table


def test_bad_inputs_get_clear_errors(client, tmp_path):
    from gradio_client import handle_file

    with pytest.raises(Exception, match="no frames"):
        client.predict([], api_name="/flow_frames")
    cmyk = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (32, 32), (0, 0, 0, 255)).save(cmyk)
    with pytest.raises(Exception, match="image mode 'CMYK'"):
        client.predict(None, handle_file(str(cmyk)), 0, MNIST, "anderson", 30, 1e-4,
                       api_name="/classify_digit")
    bomb = tmp_path / "wide.png"
    Image.new("1", (20000, 20000)).save(bomb)  # a few kB on disk, 400 M pixels decoded
    with pytest.raises(Exception, match="wide.png.*(above the limit|decompression bomb)"):
        client.predict(None, handle_file(str(bomb)), 0, MNIST, "anderson", 30, 1e-4,
                       api_name="/classify_digit")
    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\x89PNG" + bytes(9 * 1024 * 1024))  # above the app's 8 MB upload limit
    with pytest.raises(Exception, match=r"(?i)size|large|exceed"):
        client.predict(None, handle_file(str(huge)), 0, MNIST, "anderson", 30, 1e-4,
                       api_name="/classify_digit")
    with pytest.raises(Exception, match="frame 'b.png' is 40x30"):
        a, b = tmp_path / "a.png", tmp_path / "b.png"
        Image.new("RGB", (64, 64)).save(a)
        Image.new("RGB", (40, 30)).save(b)
        client.predict([handle_file(str(a)), handle_file(str(b))], api_name="/flow_frames")
