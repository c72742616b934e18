"""Suite-wide settings: one thread, offline hub, private HF cache, headless matplotlib."""

import os
import tempfile

# Before anything imports huggingface_hub/transformers (they read these at import time).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="deqzoo-test-hf-"))
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
