"""The Looped LM tab in a real browser (Playwright driving Debian's chromium, headless, against the app on
loopback, as `test_app_browser.py`): the generated tokens appear shaded by their f calls within 10 s, the
compute slider lowers every token's budget, and no console error. Runs the clone's trained checkpoint
(model_cards/hrm-text-tiny-pydoc) when there is one, else conftest's tiny random HRM-Text."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
_ABSENT = (f"{CHROMIUM} is absent: the looped-LM browser test needs Debian's chromium (`bash .ci/browser` "
           "as root, or `sudo apt-get install chromium`)")
_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = [pytest.mark.app,
              pytest.mark.skipif(not _IN_CI and not Path(CHROMIUM).exists(), reason=_ABSENT)]  # fmt: skip


@pytest.fixture(scope="module")
def page(app_url, looped_lm_checkpoint):
    from playwright.sync_api import sync_playwright

    from deqzoo_app import looped_lm

    if not Path(CHROMIUM).exists():  # reached only in CI (see pytestmark): fail rather than skip there
        pytest.fail(_ABSENT + "; CI=true, so the browser test fails rather than skips")
    mp = pytest.MonkeyPatch()
    if looped_lm.model_dir() is None:  # the tab reads the variable per request
        mp.setenv(looped_lm.ENV, str(looped_lm_checkpoint))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.console_errors = []
        page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
        page.on("pageerror", lambda e: page.console_errors.append(str(e)))
        page.goto(app_url, wait_until="networkidle")
        page.get_by_role("tab", name="Looped LM").click()
        yield page
        browser.close()
    mp.undo()


def _generate(page, budget: int) -> tuple[list[int], float]:
    """Press the button and wait for the summary of a run with this f-call budget; (f calls per token read
    from the page, seconds). (Waiting for any change is not enough: Gradio's progress text changes it.)"""
    start = time.perf_counter()
    page.get_by_role("button", name="Generate with the looped LM", exact=True).click()
    page.locator("#looped-summary").get_by_text(f"budget {budget} f calls per token").first.wait_for(
        timeout=10_000
    )
    elapsed = time.perf_counter() - start
    nfes = [int(n) for n in page.locator("#looped-text .looped-token").evaluate_all(
        "spans => spans.map(s => s.dataset.nfe)")]  # fmt: skip
    return nfes, elapsed


def test_tokens_shaded_by_their_f_calls_and_the_compute_slider(page, artifacts):
    from deqzoo_app import looped_lm

    own = looped_lm._load(str(looped_lm.model_dir()))[0].config.H_cycles
    nfes, elapsed = _generate(page, own)
    page.screenshot(path=str(artifacts / "looped_lm.png"), full_page=True)
    assert elapsed < 10.0, f"looped LM tab: {elapsed:.1f} s"
    assert len(nfes) == 24 and all(1 <= n <= own for n in nfes), nfes  # default: 24 tokens, 1x the own loop
    colours = page.locator("#looped-text .looped-token").evaluate_all(
        "spans => spans.map(s => getComputedStyle(s).backgroundColor)")  # fmt: skip
    assert all(c.startswith("rgb") and c != "rgba(0, 0, 0, 0)" for c in colours), colours
    summary = page.locator("#looped-summary").inner_text()
    mean = float(re.search(r"mean ([\d.]+) f calls per token", summary).group(1))
    assert mean == pytest.approx(sum(nfes) / len(nfes), abs=0.006)
    # the compute slider: half the own loop per token (its number box, as a user types into it)
    box = page.locator("input[type=number][aria-label*='compute']")
    box.fill("0.5")
    box.press("Tab")  # the slider takes the typed value when the box loses focus
    nfes, _ = _generate(page, round(0.5 * own))
    page.screenshot(path=str(artifacts / "looped_lm_half_compute.png"), full_page=True)
    assert len(nfes) == 24 and max(nfes) <= round(0.5 * own), nfes
    assert page.console_errors == [], page.console_errors
