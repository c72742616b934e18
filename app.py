"""Hugging Face Spaces entry point (`app_file: app.py`): the deqzoo app, as `deqzoo app` serves it.

Locally: `python app.py` (or `deqzoo app`) serves on 127.0.0.1:7860. On a Space, Gradio's Spaces settings
(GRADIO_SERVER_NAME) decide the address.
"""

import os

from deqzoo_app import DEFAULT_HOST, launch

if __name__ == "__main__":
    launch(host=os.environ.get("GRADIO_SERVER_NAME", DEFAULT_HOST),
           port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
