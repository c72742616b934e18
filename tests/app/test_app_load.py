"""The app under hostile load: a server of its own on loopback (a separate process, so its memory is measured
alone), 20 hostile requests at once (a prompt of 2,000 emoji, a 10,000x10,000 image, an empty upload, slider
values far outside the page's ranges) while a normal request is answered within 3x its usual time; memory
stays bounded, every hostile request gets a short message naming what is wrong (never a traceback, never a
server path) and the server is still up at the end. (Gradio itself refuses values outside a slider's range;
the app's functions clamp to the same ranges for callers that bypass Gradio: test_app_offline.py.)"""

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
        # slider values far outside the page's ranges (Gradio refuses them before the app's own clamping)
        + [("classify_digit", (None, None, 3, MNIST, "anderson", far, -1.0))]
        + [("generate", ("def f(x):", far, 0, "anderson", far, 0.0))] * 2
        + [("ddim_compare", (far, 0, far, "anderson", -1.0))] * 2
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

    assert all(kind == "error" for _, kind, _ in answers), answers
    errors = [(name, text) for name, _, text in answers]
    assert not any("Traceback" in text or "/tmp/" in text for _, text in errors), errors
    emoji = [text for name, text in errors[:4]]
    assert all(re.search(r"8,000 tokens .*at most \d+", t) for t in emoji), emoji
    huge = [text for name, text in errors[4:7] + errors[8:9]]
    assert all(re.search(r"huge.png.*(above the limit|decompression bomb)", t) for t in huge), huge
    assert "empty.png' is not a readable image" in errors[7][1], errors[7]
    ranges = [text for name, text in errors[9:]]
    assert all(re.search(r"greater than maximum value|less than minimum value", t) for t in ranges), ranges
    # the app prints no traceback; Gradio logs one for each value it refuses from a slider's range itself
    server_log = log.read_text()
    raised = re.findall(r"^([\w.]+(?:Error|Exception)): (.*)$", server_log, re.M)
    range_refusal = r"'Value \S+ is (greater than maximum|less than minimum) value"
    assert all(kind == "gradio.exceptions.Error" and re.match(range_refusal, text)
               for kind, text in raised), raised
    assert "deqzoo_app" not in server_log, server_log[-3000:]
