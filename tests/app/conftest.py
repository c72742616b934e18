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


@pytest.fixture(scope="session")
def looped_lm_checkpoint(tmp_path_factory) -> Path:
    """A tiny randomly initialised HRM-Text with a small byte-level BPE tokenizer, saved as the looped-LM
    tab loads a checkpoint (`deqzoo_app.looped_lm`; the tab reads ``$DEQZOO_LOOPED_LM`` per request)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import HrmTextConfig, HrmTextForCausalLM, PreTrainedTokenizerFast

    from examples.looped_lm.train import EOS, split_text

    folder = tmp_path_factory.mktemp("hrm")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([split_text("train")[:20_000]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    import torch

    torch.manual_seed(0)  # initializer 0.1, not 0.02: that random H-module is near the identity (2 calls)
    cfg = HrmTextConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, head_dim=16, H_cycles=4, L_cycles=1, prefix_lm=False,
                        max_position_embeddings=64, initializer_range=0.1)  # fmt: skip
    HrmTextForCausalLM(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
