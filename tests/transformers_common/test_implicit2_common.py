"""transformers' common model tests on Implicit²: the representation network and its signal head.

Inputs are coordinates (batch, points, in_features) in coordinate_range; the batch dimension is independent
signals' coordinate sets.
"""

from __future__ import annotations

import unittest

import pytest
import torch

from deqzoo.models.implicit2.configuration_implicit2 import Implicit2Config
from deqzoo.models.implicit2.modeling_implicit2 import Implicit2ForSignalRepresentation, Implicit2Model

from ._harness import NO_TOKEN_EMBEDDINGS, ConfigTester, ModelTesterMixin

pytestmark = pytest.mark.common


class Implicit2ModelTester:
    def __init__(self, parent, batch_size=2, num_points=9, in_features=2, hidden_size=16, out_features=3):
        self.parent = parent
        self.batch_size = batch_size
        self.num_points = num_points
        self.in_features = in_features
        self.hidden_size = hidden_size
        self.out_features = out_features
        self.num_hidden_layers = 1
        self.is_training = True

    def get_config(self):
        # the spectral bound (0.97) keeps f contractive: the solve converges to the tight tolerance
        return Implicit2Config(in_features=self.in_features, out_features=self.out_features,
                               hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
                               input_scale=8.0,
                               deq={"f_solver": "anderson", "f_max_iter": 100, "f_tol": 1e-6,
                                    "b_max_iter": 100, "b_tol": 1e-6})

    def prepare_config_and_inputs_for_common(self):
        coords = torch.rand(self.batch_size, self.num_points, self.in_features) * 2 - 1
        return self.get_config(), {"coords": coords}


class Implicit2ModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (Implicit2Model, Implicit2ForSignalRepresentation)
    # transformers exempts only its own pre-2023 models (found by a copyright year our files do not carry)
    test_can_init_all_missing_weights_before_2023 = True
    has_attentions = False
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = Implicit2ModelTester(self)
        self.config_tester = ConfigTester(self, config_class=Implicit2Config, has_text_modality=False,
                                          common_properties=["hidden_size"])

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is Implicit2ForSignalRepresentation:
            t = self.model_tester
            inputs["labels"] = torch.zeros(t.batch_size, t.num_points, t.out_features)
        return inputs

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_hidden_states_output(self):
        """Replaces the sequence-shaped check: hidden_states are (the injection g₀(x), the equilibrium z*),
        (batch, points, hidden_size) each, asked for per call or through the config."""
        t = self.model_tester
        config, inputs = t.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            for per_call in (True, False):
                cfg = Implicit2Config.from_dict(config.to_dict())
                cfg.output_hidden_states = not per_call
                model = model_class(cfg).eval()
                with torch.no_grad():
                    out = model(**inputs, **({"output_hidden_states": True} if per_call else {}))
                shapes = [tuple(h.shape) for h in out.hidden_states]
                self.assertEqual(shapes, [(t.batch_size, t.num_points, t.hidden_size)] * 2)
                torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
                with torch.no_grad():
                    self.assertIsNone(model(**inputs, output_hidden_states=False).hidden_states)

    @unittest.skip(reason=NO_TOKEN_EMBEDDINGS)
    def test_model_get_set_embeddings(self):
        pass
