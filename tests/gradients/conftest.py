"""Tiny float64 models of every registered family, for the gradient-trust suite.

Each builder returns ``(model, inputs, loss_fn)``: ``inputs`` is a dict of the model's keyword inputs whose
floating-point tensors may be made to require grad, ``loss_fn(model, inputs)`` a scalar built from the main
output with fixed random weights (so every output entry matters)."""

import pytest
import torch

from deqzoo.models.registry import FAMILIES


def _weighted(t: torch.Tensor) -> torch.Tensor:
    w = torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
    return (t * w).sum()


def mdeq():
    from deqzoo.models.mdeq import MDEQConfig, MDEQForImageClassification
    from deqzoo.models.mdeq.configuration_mdeq import ARCHITECTURES

    torch.manual_seed(0)
    model = MDEQForImageClassification(MDEQConfig(**ARCHITECTURES["mdeq-tiny-mnist"]["config"])).double()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, {"pixel_values": x}, lambda m, i: _weighted(m(**i).logits)


def deq_transformer():
    from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM

    torch.manual_seed(0)
    cfg = DEQTransformerConfig(vocab_size=40, d_model=16, n_head=2, d_head=8, d_inner=24, tgt_len=6,
                               mem_len=0)
    model = DEQTransformerForCausalLM(cfg).double()
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "use_cache": False}, lambda m, i: _weighted(m(**i).logits)


def ignn():
    from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ei = torch.randint(0, 12, (2, 30), generator=g)
    w = torch.rand(30, generator=g, dtype=torch.float64) + 0.5
    x = torch.randn(12, 4, generator=g, dtype=torch.float64)
    model = IGNNForNodeClassification(IGNNConfig(in_features=4, hidden_size=6, num_labels=3, dropout=0.0))
    return model.double(), {"x": x, "edge_index": ei, "edge_weight": w}, lambda m, i: _weighted(m(**i).logits)


def implicit2():
    from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation, coordinate_grid

    torch.manual_seed(0)
    model = Implicit2ForSignalRepresentation(Implicit2Config(hidden_size=16, in_features=2, out_features=3))
    coords = coordinate_grid([6, 6]).double()
    return model.double(), {"coords": coords}, lambda m, i: _weighted(m(**i).values)


def deq_flow():
    from deqzoo.models.deq_flow import DEQFlowConfig, DEQFlowForOpticalFlow

    torch.manual_seed(0)
    small = {"encoder_layers": [8, 8, 12, 16], "feature_dim": 16, "context_dim": 12, "hidden_dim": 12,
             "corr_levels": 2, "corr_radius": 2, "motion_corr_layers": [16, 12], "motion_flow_layers": [8, 8],
             "motion_dim": 12, "flow_head_dim": 16, "mask_dim": 16}
    model = DEQFlowForOpticalFlow(DEQFlowConfig(**small)).double()
    g = torch.Generator().manual_seed(1)
    a = torch.rand(1, 3, 32, 32, generator=g, dtype=torch.float64) * 255
    b = torch.roll(a, 1, dims=3)
    return model, {"image1": a, "image2": b}, lambda m, i: _weighted(m(**i).flow)


def reasoner():
    """A TRM core in its "deq" gradient mode (one cycle as the fixed-point map); its input is the token
    embeddings (inputs_embeds), so the input's gradient is checked too."""
    from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification

    torch.manual_seed(0)
    cfg = ReasonerConfig(seq_len=4, vocab_size=3, num_labels=3, hidden_size=8, num_heads=2, num_layers=1,
                         h_cycles=1, l_cycles=2, halt_max_steps=1, grad_mode="deq")
    model = ReasonerForGridClassification(cfg).double()
    emb = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, {"inputs_embeds": emb}, lambda m, i: _weighted(m(**i).logits)


def mdeq_trained():
    """The embedded mdeq-tiny-mnist checkpoint in float64: its f converges to 1e-12 (the random init's does
    not: GroupNorm at init leaves no attracting fixed point)."""
    import deqzoo

    model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist").double()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, {"pixel_values": x}, lambda m, i: _weighted(m(**i).logits)


def deq_transformer_contractive():
    """Weights drawn as in tests/models/deq_transformer: Anderson converges to 1e-12 from them."""
    model, inputs, loss_fn = deq_transformer()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "emb" in name else 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model, inputs, loss_fn


BUILDERS = {"mdeq": mdeq, "deq_transformer": deq_transformer, "ignn": ignn, "implicit2": implicit2,
            "deq_flow": deq_flow, "reasoner": reasoner}


def test_every_registered_family_has_a_builder():
    assert {f.model_type for f in FAMILIES} == set(BUILDERS)


# Tiny models with an attracting fixed point (the implicit modes differentiate a converged z*). DEQ-Flow has
# none in float64 at 1e-12: its f looks up the correlation volume by bilinear sampling at the flow it
# updates (piecewise smooth), and Anderson stalls at a relative residual of 1e-2 (3e-4 with the update
# block scaled by 0.05); its implicit modes are not in this suite, its reversible mode is.
IMPLICIT_BUILDERS = {"mdeq": mdeq_trained, "deq_transformer": deq_transformer_contractive, "ignn": ignn,
                     "implicit2": implicit2}


@pytest.fixture(params=sorted(BUILDERS))
def family(request):
    return request.param, BUILDERS[request.param]


@pytest.fixture(params=sorted(IMPLICIT_BUILDERS))
def converging_family(request):
    return request.param, IMPLICIT_BUILDERS[request.param]
