"""Reversible mode switched on from a model's own settings (issue 58): DEQ-Flow and Implicit² carry phantom
options (``k``, ``tau``, ``variant``) in their default solver settings, which ``b_mode="reversible"`` does not
accept; switching the mode without giving its options now drops them (`deqzoo.core.config.merge_settings`)
instead of failing on options the user never set. Each model then runs a forward and a backward, and its
gradient equals autograd through the same coupled iteration (written here, independent of
deqzoo.core.reversible), in float64 at a tiny size.
"""

from __future__ import annotations

import pytest
import torch

from deqzoo.core import BACKWARD_MODES
from deqzoo.core.backward import MODE_KWARGS
from tests.gradients.test_gradients_reversible_steps import coupled_reference  # the paper's coupled loop

torch.set_num_threads(1)
STEPS, BETA = 4, 0.8  # BETA: coupled_reference's default too


def _flow_model():
    from deqzoo.models.deq_flow import DEQFlowConfig, DEQFlowForOpticalFlow

    small = {"encoder_layers": [8, 8, 12, 16], "feature_dim": 16, "context_dim": 12, "hidden_dim": 12,
             "corr_levels": 2, "corr_radius": 2, "motion_corr_layers": [16, 12], "motion_flow_layers": [8, 8],
             "motion_dim": 12, "flow_head_dim": 16, "mask_dim": 16}
    torch.manual_seed(0)
    model = DEQFlowForOpticalFlow(DEQFlowConfig(**small)).double().eval()
    g = torch.Generator().manual_seed(1)
    images = (torch.rand(1, 3, 32, 32, generator=g, dtype=torch.float64),
              torch.rand(1, 3, 32, 32, generator=g, dtype=torch.float64))
    return model, lambda m: m(*images).flow


def _implicit2_model():
    from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation, coordinate_grid

    torch.manual_seed(0)
    model = Implicit2ForSignalRepresentation(Implicit2Config(hidden_size=16, out_features=3, input_scale=4.0))
    coords = coordinate_grid((5, 5)).double()
    return model.double().eval(), lambda m: m(coords).values


@pytest.mark.parametrize("build", [_flow_model, _implicit2_model], ids=["deq_flow", "implicit2"])
def test_reversible_from_the_models_own_settings(build, monkeypatch):
    model, output = build()
    own = model.config.deq
    assert own["b_mode"] == "phantom" and own["b_mode_kwargs"]  # the options that used to be refused
    cfg = model.set_deq(b_mode="reversible", f_max_iter=STEPS)
    assert cfg.b_mode_kwargs == {} and cfg.f_solver == own["f_solver"]  # only the mode's options dropped
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient():
        out = output(model)
        weights = torch.sin(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad((out * weights).sum(), params,
                                                                      allow_unused=True) if g is not None])

    got = gradient()
    monkeypatch.setitem(BACKWARD_MODES, "_coupled_reference", coupled_reference)
    monkeypatch.setitem(MODE_KWARGS, "_coupled_reference", {"beta"})
    model.set_deq(b_mode="_coupled_reference", b_mode_kwargs={"beta": BETA})
    want = gradient()
    assert got.shape == want.shape and float(want.abs().max()) > 0
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-10, err


def test_reversible_from_config_and_create_model():
    """The same switch through a config's ``deq`` (merged over the family's defaults) and create_model."""
    import deqzoo
    from deqzoo.models.implicit2 import Implicit2Config

    assert Implicit2Config(deq={"b_mode": "reversible"}).deq_config.b_mode_kwargs == {}
    model = deqzoo.create_model("deq-flow-cpu-synth", deq={"b_mode": "reversible", "f_max_iter": 3})
    assert model.config.deq_config.b_mode == "reversible" and model.config.deq_config.b_mode_kwargs == {}
    # options given with the new mode are kept; a mode's options are not dropped when the mode stays
    cfg = Implicit2Config(deq={"b_mode": "reversible", "b_mode_kwargs": {"beta": 0.5}}).deq_config
    assert cfg.b_mode_kwargs == {"beta": 0.5}
    assert Implicit2Config(deq={"f_max_iter": 5}).deq_config.b_mode_kwargs["variant"] == "npg"
