"""The app under hostile load: a server of its own on loopback (a separate process, so its memory is measured
alone), 20 hostile requests at once (a prompt of 2,000 emoji, a 10,000x10,000 image, an empty upload, slider
values far outside the page's ranges) while a normal request is answered within 3x its usual time; memory
stays bounded, every hostile request gets a clean answer (a short message or a clamped result, never a
traceback) and the server is still up at the end."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

pytestmark = pytest.mark.app

ROOT = Path(__file__).resolve().parents[2]
MNIST = "deqzoo/mdeq-tiny-mnist"
NORMAL = (None, None, 3, MNIST, "anderson", 30, 1e-4)  # the MDEQ tab's defaults on a held-out 3
STARTUP_S = 900  # warm-up loads every checkpoint and runs every tab once; slow on a busy 2-core machine
MEMORY_GROWTH_LIMIT = 2 * 1024**3  # peak RSS during the attack minus RSS before it


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    code = f"from deqzoo_app import launch; launch(port={port}, block=True)"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + STARTUP_S
    while not _up(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the app did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(2)
    yield proc, url, log
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _hostile_requests(client, tmp_path):
    from gradio_client import handle_file

    huge = tmp_path / "huge.png"  # 100 M pixels, a few hundred kB on disk
    Image.new("1", (10_000, 10_000)).save(huge)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    emoji = "\U0001F600" * 2000  # 8 kB, 2,000 characters, 8,000 byte-level tokens
    far = 10**9
    calls = (
        [("generate", (emoji, 24, 0, "anderson", 30, 1e-3))] * 4
        + [("classify_digit", (None, handle_file(str(huge)), 0, MNIST, "anderson", 30, 1e-4))] * 3
        + [("classify_digit", (None, handle_file(str(empty)), 0, MNIST, "anderson", 30, 1e-4))]
        + [("flow_frames", ([handle_file(str(huge)), handle_file(str(huge))],))]
        + [("classify_digit", (None, None, far, MNIST, "anderson", far, -1.0))]
        + [("generate", ("def f(x):", far, -far, "anderson", far, 0.0))] * 2
        + [("ddim_compare", (far, -1, far, "anderson", -1.0))] * 2
        + [("render_inr", ("deqzoo/implicit2-isiren-camera", 1e12, -far, far, far))] * 2
        + [("ignn_chains", (far, far))] * 2
        + [("hyper_vs_anderson", (far, 1e-30, far))] * 2
    )
    assert len(calls) == 20
    return calls


def _normal(client) -> float:
    start = time.perf_counter()
    labels, _, summary, _ = client.predict(*NORMAL, api_name="/classify_digit")
    elapsed = time.perf_counter() - start
    assert labels["label"] == "3" and "held-out MNIST digits" in summary
    return elapsed


def test_hostile_requests_do_not_take_the_app_down(server, tmp_path):
    from gradio_client import Client

    proc, url, log = server
    client = Client(url, verbose=False)
    _normal(client)
    baseline = statistics.median(_normal(client) for _ in range(3))
    rss_before = _status_kb(proc.pid, "VmRSS") * 1024
    hwm_before = _status_kb(proc.pid, "VmHWM") * 1024

    attackers = [Client(url, verbose=False) for _ in range(4)]  # several sessions, as several users would
    jobs = [(name, attackers[i % 4].submit(*args, api_name=f"/{name}"))
            for i, (name, args) in enumerate(_hostile_requests(client, tmp_path))]
    time.sleep(1.0)  # the attack is queued and running
    during = _normal(client)

    answers = []
    for name, job in jobs:
        try:
            answers.append((name, "ok", job.result(timeout=600)))
        except Exception as err:  # noqa: BLE001 - the answer under test is the error's message
            answers.append((name, "error", str(err)))
    peak = max(_status_kb(proc.pid, "VmHWM") * 1024, hwm_before)
    print(f"normal request: {baseline:.2f} s alone, {during:.2f} s under attack; "
          f"RSS {rss_before / 2**30:.2f} GiB before, peak {peak / 2**30:.2f} GiB")
    for name, kind, answer in answers:
        print(f"  {name}: {kind}: {str(answer)[:160]!r}")

    assert during <= 3 * baseline + 1.0, (during, baseline)
    assert peak - rss_before <= MEMORY_GROWTH_LIMIT, (peak, rss_before)
    assert proc.poll() is None and _up(url), "the server went down"
    _normal(client)  # and still answers

    errors = {(name, text) for name, kind, text in answers if kind == "error"}
    assert not any("Traceback" in text for _, text in errors)
    emoji = [text for name, text in errors if name == "generate" and "tokens" in text]
    assert len(emoji) == 4 and all(re.search(r"8,000 tokens .*at most \d+", t) for t in emoji), errors
    huge = [text for name, text in errors if "huge.png" in text]
    assert len(huge) == 4 and all(re.search(r"above the limit|decompression bomb", t) for t in huge), errors
    assert any("empty.png" in text and "not a readable image" in text for _, text in errors), errors
    # slider values outside the page's ranges are clamped to them: real answers at the largest settings
    clamped = [answer for name, kind, answer in answers if kind == "ok"]
    assert len(clamped) == 11, answers
    texts = [str(answer) for answer in clamped]
    assert sum("64 new tokens" in t for t in texts) == 2
    assert sum("| DDIM (diffusers) | **50** | 400 |" in t for t in texts) == 2
    assert sum("512x512 render of a window 64x smaller" in t for t in texts) == 2
    assert sum("chains of length 400" in t and "budget 400" in t for t in texts) == 2
    assert sum("1000 held-out digits, budget 100, tolerance 1e-08" in t for t in texts) == 2
    assert sum("not converged" in t and "200 held-out MNIST digits" in t for t in texts) == 1
    server_log = log.read_text()
    assert "Traceback" not in server_log, server_log[-3000:]
