"""transformers' common model tests on DEQ-Flow: the model and its optical-flow head.

Inputs are two image batches (image1, image2), (batch, 3, H, W) each; the label of the flow head is the
ground-truth flow (batch, 2, H, W).
"""

from __future__ import annotations

import unittest

import pytest
import torch

pytest.importorskip("torchvision", reason="DEQ-Flow needs the vision extra (torchvision's RAFT blocks)")

from deqzoo.models.deq_flow.configuration_deq_flow import DEQFlowConfig  # noqa: E402
from deqzoo.models.deq_flow.modeling_deq_flow import DEQFlowForOpticalFlow, DEQFlowModel  # noqa: E402

from ._harness import (  # noqa: E402
    NO_TOKEN_EMBEDDINGS,
    ConfigTester,
    ModelTesterMixin,
    floats_tensor,
)

pytestmark = [pytest.mark.common,
              pytest.mark.filterwarnings("ignore::deqzoo.modeling_utils.DEQNonConvergenceWarning")]


class DEQFlowModelTester:
    def __init__(self, parent, batch_size=2, image_size=32, hidden_dim=8, context_dim=8):
        self.parent = parent
        self.batch_size = batch_size
        self.image_size = image_size
        self.hidden_dim = hidden_dim
        self.context_dim = context_dim
        self.is_training = True

    def get_config(self):
        # fixed-point iteration, a few steps: see _harness.UNCONVERGED_AT_INIT
        return DEQFlowConfig(
            encoder_layers=[8, 8, 12, 16], feature_dim=16, context_dim=self.context_dim,
            hidden_dim=self.hidden_dim, feature_norm="instance", context_norm="instance", corr_levels=2,
            corr_radius=1, motion_corr_layers=[16], motion_flow_layers=[8, 4], motion_dim=12, flow_head_dim=8,
            mask_dim=8, deq={"f_solver": "fixed_point", "f_max_iter": 4, "f_tol": 1e-6})

    def prepare_config_and_inputs_for_common(self):
        shape = [self.batch_size, 3, self.image_size, self.image_size]
        return self.get_config(), {"image1": floats_tensor(shape), "image2": floats_tensor(shape)}


class DEQFlowModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (DEQFlowModel, DEQFlowForOpticalFlow)
    # transformers exempts only its own pre-2023 models (found by a copyright year our files do not carry)
    test_can_init_all_missing_weights_before_2023 = True
    has_attentions = False
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = DEQFlowModelTester(self)
        self.config_tester = ConfigTester(self, config_class=DEQFlowConfig, has_text_modality=False,
                                          common_properties=["hidden_dim", "context_dim"])

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is DEQFlowForOpticalFlow:
            t = self.model_tester
            inputs["flow_gt"] = torch.zeros(t.batch_size, 2, t.image_size, t.image_size)
        return inputs

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip(reason=NO_TOKEN_EMBEDDINGS)
    def test_model_get_set_embeddings(self):
        pass

    def test_hidden_states_output(self):
        """Replaces the sequence-shaped check: hidden_states are (the context features, the final GRU state),
        (batch, context_dim or hidden_dim, H/8, W/8), asked for per call or through the config."""
        t = self.model_tester
        config, inputs = t.prepare_config_and_inputs_for_common()
        side = t.image_size // 8
        for model_class in self.all_model_classes:
            for per_call in (True, False):
                cfg = DEQFlowConfig.from_dict(config.to_dict())
                cfg.output_hidden_states = not per_call
                model = model_class(cfg).eval()
                with torch.no_grad():
                    out = model(**inputs, **({"output_hidden_states": True} if per_call else {}))
                shapes = [tuple(h.shape) for h in out.hidden_states]
                self.assertEqual(shapes, [(t.batch_size, t.context_dim, side, side),
                                          (t.batch_size, t.hidden_dim, side, side)])
                torch.testing.assert_close(out.hidden_states[-1], out.hidden_state)
                with torch.no_grad():
                    self.assertIsNone(model(**inputs, output_hidden_states=False).hidden_states)
