"""Output contracts as in transformers, checked over every head in deqzoo.models.registry, and the model-level
non-convergence policy (warn once per model by default, "ignore", "raise")."""

from __future__ import annotations

import warnings

import pytest
import torch

from deqzoo.core import DEQConvergenceError
from deqzoo.modeling_utils import DEQNonConvergenceWarning, DEQPreTrainedModel
from deqzoo.models.registry import FAMILIES

# A small config and an input builder per family; a new family must add itself here (checked below).
TINY = {
    "mdeq": ({"in_channels": 1, "branch_channels": [8, 8], "head_channels": [4, 8], "final_chansize": 16,
              "expansion_factor": 2, "num_groups": 2, "downsample_times": 1, "num_labels": 3,
              "image_size": [16, 16]},
             lambda: {"pixel_values": torch.randn(2, 1, 16, 16)}),
    "deq_transformer": ({"vocab_size": 40, "d_model": 16, "n_head": 2, "d_head": 8, "d_inner": 32},
                        lambda: {"input_ids": torch.randint(0, 40, (2, 6))}),
    "ignn": ({"in_features": 3, "hidden_size": 8, "num_labels": 2, "graph_head_hidden": 8},
             lambda: {"x": torch.randn(5, 3), "edge_index": torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])}),
}
TINY["implicit2"] = ({"hidden_size": 8, "filter_type": "gabor", "in_features": 2, "out_features": 1},
                     lambda: {"coords": torch.rand(2, 5, 2) * 2 - 1})
TINY["deq_flow"] = ({"encoder_layers": [8, 8, 8, 8], "feature_dim": 8, "context_dim": 8, "hidden_dim": 8,
                     "corr_levels": 2, "corr_radius": 1, "motion_corr_layers": [8],
                     "motion_flow_layers": [8, 8],
                     "motion_dim": 8, "flow_head_dim": 8, "mask_dim": 8},
                    lambda: {"image1": torch.rand(2, 3, 32, 32), "image2": torch.rand(2, 3, 32, 32)})
TINY["reasoner"] = ({"seq_len": 9, "vocab_size": 4, "num_labels": 4, "hidden_size": 8, "num_heads": 2,
                     "h_cycles": 2, "l_cycles": 2, "halt_max_steps": 2},
                    lambda: {"input_ids": torch.randint(0, 4, (2, 9))})
EASY_SOLVE = {"f_max_iter": 200, "f_tol": 1e-5, "on_nonconvergence": "ignore"}


# timm's class follows timm's conventions (forward returns the logits tensor); its tests:
# tests/models/mdeq/test_mdeq_timm.py
TIMM_CONVENTIONS = {"deqzoo.integrations.timm:MDEQTimm"}


def _heads():
    for fam in FAMILIES:
        for path in {**fam.models, **fam.heads}.values():
            if path not in TIMM_CONVENTIONS:
                yield pytest.param(fam, path, id=path.rsplit(":", 1)[1])


def _build(fam, path) -> tuple[DEQPreTrainedModel, dict]:
    torch.manual_seed(0)
    kwargs, inputs = TINY[fam.model_type]
    config = fam.load(fam.config)(**kwargs)
    model = fam.load(path)(config).eval()
    model.set_deq(**EASY_SOLVE)
    torch.manual_seed(1)
    return model, inputs()


def test_every_family_has_a_tiny_case():
    assert {f.model_type for f in FAMILIES} == set(TINY)


@pytest.mark.parametrize("fam,path", list(_heads()))
def test_return_dict_false_gives_the_tuple_of_the_output(fam, path):
    model, inputs = _build(fam, path)
    with torch.no_grad():
        out = model(**inputs)
        tup = model(**inputs, return_dict=False)
    assert isinstance(tup, tuple) and not isinstance(tup, dict)
    ref = out.to_tuple()
    assert len(tup) == len(ref) and len(tup) >= 2
    for a, b in zip(tup, ref):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    # the config's return_dict is the default, as in transformers
    model.config.return_dict = False
    with torch.no_grad():
        assert isinstance(model(**inputs), tuple)


@pytest.mark.parametrize("fam,path", list(_heads()))
def test_output_hidden_states(fam, path):
    model, inputs = _build(fam, path)
    with torch.no_grad():
        plain = model(**inputs)
        out = model(**inputs, output_hidden_states=True)
    assert plain.hidden_states is None
    hs = out.hidden_states
    assert isinstance(hs, tuple) and len(hs) >= 1 and all(isinstance(h, torch.Tensor) for h in hs)
    if "last_hidden_state" in out:
        assert torch.equal(hs[-1] if fam.model_type != "mdeq" else hs[0], out.last_hidden_state)
    model.config.output_hidden_states = True
    with torch.no_grad():
        assert model(**inputs).hidden_states is not None


@pytest.mark.parametrize("fam,path", list(_heads()))
def test_num_parameters_and_input_embeddings(fam, path):
    model, _ = _build(fam, path)
    params = {id(p): p for p in model.parameters()}
    assert model.num_parameters() == sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    assert model.num_parameters(only_trainable=True) == trainable
    emb = model.get_input_embeddings()
    assert isinstance(emb, torch.nn.Module)
    own = {id(p) for p in emb.parameters()}
    assert own and own <= set(params)


@pytest.mark.parametrize("fam,path", [p for p in _heads() if p.values[0].model_type == "deq_transformer"])
def test_output_attentions_are_causal_distributions_at_the_equilibrium(fam, path):
    model, inputs = _build(fam, path)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
        plain = model(**inputs)
    assert plain.attentions is None
    (att,) = out.attentions  # one block in f_θ
    b, q = inputs["input_ids"].shape
    assert att.shape == (b, model.config.n_head, q, q)
    torch.testing.assert_close(att.sum(-1), torch.ones(b, model.config.n_head, q))
    assert bool((att.triu(diagonal=1) == 0).all())  # no attention to the future
    # asking for attentions does not change the prediction
    key = "logits" if "logits" in out else "last_hidden_state"
    assert torch.equal(out[key], plain[key])


@pytest.mark.parametrize("cutoffs,tie", [([], True), ([], False), ([15, 30], True)])
def test_resize_token_embeddings_keeps_old_tokens(cutoffs, tie, tmp_path):
    from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM

    torch.manual_seed(0)
    cfg = DEQTransformerConfig(vocab_size=40, d_model=16, n_head=2, d_head=8, d_inner=32, cutoffs=cutoffs,
                               div_val=2 if cutoffs else 1, tie_weights=tie)
    model = DEQTransformerForCausalLM(cfg).eval()
    model.set_deq(**EASY_SOLVE)
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(45)
    assert model.config.vocab_size == 45
    with torch.no_grad():
        after = model(ids).logits
        new = model(torch.tensor([[3, 44]])).logits
    assert after.shape == (2, 6, 45) and new.shape == (1, 2, 45)
    if not cutoffs:  # plain softmax: old tokens' logits are untouched by the new rows
        torch.testing.assert_close(after[..., :40], before)
    else:  # adaptive softmax returns log-probabilities: still a distribution over the grown vocabulary
        torch.testing.assert_close(after.exp().sum(-1), torch.ones(2, 6))
    model.save_pretrained(tmp_path)
    again = DEQTransformerForCausalLM.from_pretrained(tmp_path).eval()
    again.set_deq(**EASY_SOLVE)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, after)
    if cutoffs:  # tokens are added to / removed from the last cluster only
        with pytest.raises(ValueError, match="cutoffs"):
            model.resize_token_embeddings(10)


def _mdeq(**deq):
    import deqzoo

    torch.manual_seed(0)
    model = deqzoo.create_model("mdeq-tiny-mnist").eval()
    model.set_deq(**deq)
    return model


def test_nonconvergence_warns_once_per_model_by_default():
    model, x = _mdeq(f_max_iter=2), torch.randn(2, 1, 28, 28)
    assert model.config.on_nonconvergence == "warn"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = model(x)
            model(x)
    ours = [w for w in got if issubclass(w.category, DEQNonConvergenceWarning)]
    assert not bool(out.deq_stats.converged.all())
    assert len(ours) == 1, [str(w.message) for w in ours]  # once, not again, not from the nested backbone
    msg = str(ours[0].message)
    assert "MDEQForImageClassification" in msg and "f_max_iter=2" in msg and "on_nonconvergence" in msg
    assert ours[0].filename == __file__  # points at the caller
    # another model instance warns again; a new setting re-arms the warning
    other = _mdeq(f_max_iter=2)
    with pytest.warns(DEQNonConvergenceWarning):
        with torch.no_grad():
            other(x)
    with pytest.warns(DEQNonConvergenceWarning):
        other.set_deq(f_max_iter=3)
        with torch.no_grad():
            other(x)


def test_a_reversible_deq_reports_its_residual_without_warning():
    """The reversible iteration runs its trained number of coupled steps whatever f_tol says: its residual is
    reported in deq_stats, not warned about; the same model under an adaptive solver with too small a
    budget still warns (so the exemption is the solver's, not the model's)."""
    import deqzoo
    from examples.mdeq import mnist

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist-reversible")
    x = mnist.to_pixel_values(mnist.sample_images()[0][:4], model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DEQNonConvergenceWarning)
        with torch.no_grad():
            stats = model(x).deq_stats
    assert stats.solver == "reversible" and not bool(stats.converged.all())  # above f_tol, and silent
    model.set_deq(b_mode="ift", b_mode_kwargs={}, f_solver="anderson", f_max_iter=2)
    with pytest.warns(DEQNonConvergenceWarning, match="anderson"):
        with torch.no_grad():
            model(x)


def test_converged_solves_do_not_warn_and_policies_apply():
    import deqzoo
    from examples.mdeq import mnist

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist", deq={"f_max_iter": 100})
    x = mnist.to_pixel_values(mnist.sample_images()[0][:4], model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DEQNonConvergenceWarning)
        with torch.no_grad():
            assert bool(model(x).deq_stats.converged.all())
    silent = _mdeq(f_max_iter=2, on_nonconvergence="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            silent(x)
    strict = _mdeq(f_max_iter=2, on_nonconvergence="raise")
    with pytest.raises(DEQConvergenceError) as err, torch.no_grad():
        strict(x)
    assert not bool(err.value.stats.converged.all())
    with pytest.raises(ValueError, match="on_nonconvergence"):
        strict.set_deq(on_nonconvergence="shout")


def test_policy_survives_save_and_load(tmp_path):
    import deqzoo

    model = _mdeq(on_nonconvergence="ignore")
    model.save_pretrained(tmp_path)
    loaded = deqzoo.from_pretrained(tmp_path)
    assert loaded.config.on_nonconvergence == "ignore"
    assert loaded.mdeq.deq.config.on_nonconvergence == "ignore"
    strict = deqzoo.from_pretrained(tmp_path, deq={"on_nonconvergence": "raise"})
    assert strict.config.on_nonconvergence == "raise"
