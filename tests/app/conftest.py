"""A live app on loopback for the `app` tests (gradio_client and the browser), started once per session."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_url():
    from deqzoo_app import launch

    port = _free_port()
    demo = launch(port=port, block=False)  # warm-up included: loads every checkpoint, runs every tab once
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where screenshots go (CI keeps them): $DEQZOO_TEST_ARTIFACTS or test_artifacts/app."""
    path = Path(os.environ.get("DEQZOO_TEST_ARTIFACTS", "test_artifacts")) / "app"
    path.mkdir(parents=True, exist_ok=True)
    return path
