"""DEQ-Transformer model behaviour: variants, memory, head, generation cache, gradients, save/load."""

import pytest
import torch

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM

TIGHT = {"f_solver": "anderson", "f_max_iter": 150, "f_tol": 1e-10, "f_stop_mode": "rel"}


def _tiny(**kw) -> DEQTransformerForCausalLM:
    torch.manual_seed(0)
    cfg = DEQTransformerConfig(vocab_size=40, d_model=16, n_head=2, d_head=8, d_inner=24, tgt_len=8,
                               mem_len=16, deq=kw.pop("deq", TIGHT), **kw)
    model = DEQTransformerForCausalLM(cfg).double().eval()
    with torch.no_grad():  # larger random weights than the init: non-trivial, and Anderson still converges
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "emb" in name else 0.2)
    return model


@pytest.mark.parametrize("kw", [{}, {"pre_lnorm": True}])
def test_memory_matches_full_context(kw):
    """Causality makes the joint fixed point of a sequence equal, position by position, to solving it in two
    segments where the second attends to the first's equilibria (the memory) - an independent check of mems.
    (The torchdeq variant's memory is checked against TorchDEQ's own outputs in the conversion tests.)"""
    model = _tiny(**kw)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        a = model(ids[:, :6])
        b = model(ids[:, 6:], past_key_values=a.past_key_values)
    assert full.deq_stats.all_converged and b.deq_stats.all_converged
    seg = torch.cat([a.logits, b.logits], 1)
    assert torch.allclose(seg, full.logits, atol=1e-7)
    assert b.past_key_values.seen == 10 and b.past_key_values.z_hist.shape[1] == 10


def test_memory_is_truncated_to_mem_len():
    model = _tiny(deq={"f_max_iter": 5})
    with torch.no_grad():
        out = model(torch.randint(0, 40, (1, 20)))
    assert out.past_key_values.z_hist.shape == (1, 16, 16) and out.past_key_values.u_hist.shape == (1, 16, 48)


def test_adaptive_head_is_a_distribution_and_loss_matches():
    model = _tiny(cutoffs=[10, 25], div_val=2, d_embed=16, tie_projs=[False, True, True])
    ids = torch.randint(0, 40, (2, 7))
    out = model(ids, labels=ids)
    assert torch.allclose(out.logits.exp().sum(-1), torch.ones(2, 7, dtype=torch.float64), atol=1e-9)
    manual = -out.logits[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    assert torch.allclose(out.loss, manual)


def test_explicit_variant_has_no_solver_and_untied_layers():
    deq = _tiny()
    exp = _tiny(explicit_layers=2)
    assert not hasattr(exp.model, "deq") and len(exp.model.layers) == 2
    first, second = (layer.blocks[0].pos_ff.ff1_net.weight for layer in exp.model.layers)
    assert first is not second and not torch.equal(first, second)
    out = exp(torch.randint(0, 40, (1, 5)))
    assert out.deq_stats.nfe == 2
    assert sum(p.numel() for p in exp.parameters()) > sum(p.numel() for p in deq.parameters())


def test_training_gradients_and_jacobian_regularizer():
    model = _tiny(jac_reg_weight=0.5, deq={"f_max_iter": 20, "b_max_iter": 20, "jac_reg_samples": 1})
    model.train()
    ids = torch.randint(0, 40, (2, 6))
    out = model(ids, labels=ids)
    assert out.jac_loss is not None and out.jac_loss.requires_grad and float(out.jac_loss.detach()) > 0
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, plain + 0.5 * out.jac_loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_generate_reuse_same_tokens_fewer_nfe():
    model = _tiny(deq={"f_solver": "anderson", "f_max_iter": 60, "f_tol": 1e-8, "f_stop_mode": "rel"})
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(3))
    runs = {}
    for reuse in (True, False):
        model.config.fixed_point_reuse = reuse
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        runs[reuse] = (out.sequences, out.past_key_values.total_nfe, out.past_key_values.nfe)
    assert torch.equal(runs[True][0], runs[False][0])
    assert len(runs[True][2]) == 8  # prompt + 7 incremental steps (the last token is not fed back)
    assert runs[True][1] < runs[False][1]


def test_generate_equals_full_recompute():
    """Greedy generate() with memory picks the same tokens as re-running the whole sequence each step."""
    model = _tiny()
    ids = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(5))
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


def test_beam_search_scores_equal_full_recompute():
    """Beam search reorders the memory of equilibria with its beams (transformers calls the cache's
    reorder_cache): each returned score is the sum of its new tokens' log-probabilities recomputed from
    scratch over the whole sequence (length_penalty=0)."""
    model = _tiny()
    ids = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(7))
    out = model.generate(ids, max_new_tokens=4, num_beams=3, num_return_sequences=3, do_sample=False,
                         length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        logp = model(out.sequences).logits.log_softmax(-1)
    new = out.sequences[:, 4:]
    ref = logp[:, 3:-1].gather(-1, new[..., None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(out.sequences_scores.to(ref.dtype), ref, rtol=1e-6, atol=1e-6)


def test_save_load_roundtrip_and_bad_input(tmp_path):
    from transformers import AutoModelForCausalLM

    import deqzoo  # noqa: F401 - registers the Auto classes

    model = _tiny(variant="torchdeq", n_block=2, deq={"f_max_iter": 6}).float()
    model.save_pretrained(tmp_path)
    __import__("deqzoo").register()  # stock transformers code: families registered explicitly
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is DEQTransformerForCausalLM and loaded.config.n_block == 2
    ids = torch.randint(0, 40, (1, 5))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)
    with pytest.raises(ValueError, match="must lie in"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="n_head"):
        DEQTransformerConfig(d_model=16, n_head=3, d_head=8)
    with pytest.raises(ValueError, match="variant"):
        DEQTransformerConfig(variant="xl")
