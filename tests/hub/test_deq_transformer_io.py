"""DEQ-Transformer I/O conformance with transformers (issue 37): the non-persistent positional buffer is
rebuilt when a model is materialised from meta, transformers' generic config names, shift_labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM


def _config(**overrides):
    return DEQTransformerConfig(vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32,
                                deq={"f_max_iter": 40, "f_tol": 1e-6}, **overrides)


def test_inv_freq_is_rebuilt_by_init_weights_after_meta_materialisation(tmp_path):
    torch.manual_seed(0)
    model = DEQTransformerForCausalLM(_config()).eval()
    expected = model.model.pos_emb.inv_freq.clone()
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        skeleton = DEQTransformerForCausalLM(_config())
    skeleton.to_empty(device="cpu")
    skeleton.model.pos_emb.inv_freq.fill_(float("nan"))  # what an uninitialised buffer may hold
    skeleton._init_weights(skeleton.model.pos_emb)
    torch.testing.assert_close(skeleton.model.pos_emb.inv_freq, expected, rtol=0, atol=0)
    loaded = DEQTransformerForCausalLM.from_pretrained(tmp_path)  # transformers' loader builds on meta
    torch.testing.assert_close(loaded.model.pos_emb.inv_freq, expected, rtol=0, atol=0)
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_generic_config_names_map_to_the_families_own():
    config = _config()
    assert config.num_attention_heads == 2 and config.hidden_size == 16
    config.num_attention_heads = 4
    assert config.n_head == 4


def test_shift_labels_are_used_as_given():
    torch.manual_seed(0)
    model = DEQTransformerForCausalLM(_config()).eval()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = ids[:, 1:]
    out = model(ids, shift_labels=shifted)
    reference = F.cross_entropy(out.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(model(ids, labels=ids).loss, reference)  # the same loss the usual way
    other = torch.randint(0, 50, ids.shape, generator=torch.Generator().manual_seed(3))
    assert not torch.allclose(model(ids, shift_labels=other).loss, reference)
