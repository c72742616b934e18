"""`deqzoo app`: a Gradio app with a tab per model family, on the embedded checkpoints, offline.

A program of the repository that uses the library (like a Hugging Face Space: `app.py` beside this folder),
not part of the installed package; `deqzoo app` runs it from the root of a clone. Every tab shows what its
family is for and what test-time compute buys (solver, iteration budget, tolerance -> accuracy, NFE and wall
time). The computations live in `deqzoo_app.families` (plain functions, no Gradio); `deqzoo_app.ui` lays
them out. Gradio is an optional dependency: ``pip install -e ".[app]"``.

Example:
    >>> from deqzoo_app import gradio_missing_message
    >>> "deqzoo[app]" in gradio_missing_message()
    True
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "MAX_UPLOAD", "build_app", "gradio_missing_message", "launch"]

DEFAULT_HOST = "127.0.0.1"  # loopback only: the app is a local demo, never exposed by default
DEFAULT_PORT = 7860
MAX_UPLOAD = "8mb"  # Gradio rejects larger uploads before they reach the app
# Requests run at once on different tabs (each tab has its own models; one request per tab at a time, as a
# model's solver settings are per request) and wait in Gradio's queue beyond that; a full queue answers
# at once.
QUEUE_SIZE = 64


def gradio_missing_message() -> str:
    return ('deqzoo app needs Gradio, which is in the "app" extra: pip install "deqzoo[app]" '
            '(from a clone: pip install -e ".[app]")')


def _offline_env() -> None:
    # set before gradio is imported: gradio reads these at import time
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # embedded checkpoints only, no network


def build_app(warm_up: bool = True) -> Any:
    """The app as a `gradio.Blocks` (not launched). `warm_up` loads every checkpoint and runs each tab once,
    so the first click is as fast as the next."""
    if importlib.util.find_spec("gradio") is None:
        raise ImportError(gradio_missing_message())
    _offline_env()
    from PIL import Image

    from .families import MAX_IMAGE_PIXELS
    from .ui import build

    # Gradio decodes the drawing pad's images itself, before the app sees them: with PIL's limit at the app's,
    # an image of more than twice MAX_IMAGE_PIXELS is refused from its header there too (PIL's default lets
    # 178 M pixels through)
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

    return build(warm_up=warm_up)


def launch(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, warm_up: bool = True,
           block: bool = True) -> Any:
    """Build and serve the app on host:port (no share link, analytics off); returns the Blocks."""
    demo = build_app(warm_up=warm_up)
    from .ui import theme

    demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)
    demo.launch(server_name=host, server_port=port, share=False, max_file_size=MAX_UPLOAD,
                prevent_thread_lock=not block, show_error=True, quiet=not block, theme=theme(),
                ssr_mode=False)
    return demo
