"""transformers' common model tests on the recursive reasoners: the core (TRM and HRM) and the grid head.

Inputs are token grids (batch, seq_len); the batch dimension is independent puzzles. The budget is fixed
(halting "budget"), so every sample runs the same segments and batched and single-row outputs agree."""

from __future__ import annotations

import unittest

import pytest
import torch

from deqzoo.models.reasoner.configuration_reasoner import ReasonerConfig
from deqzoo.models.reasoner.modeling_reasoner import ReasonerForGridClassification, ReasonerModel

from ._harness import ConfigTester, ModelTesterMixin, ids_tensor

pytestmark = pytest.mark.common


class ReasonerModelTester:
    def __init__(self, parent, architecture="trm", batch_size=2, seq_len=9, vocab_size=5, hidden_size=16):
        self.parent = parent
        self.architecture = architecture
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = 2
        self.is_training = True

    def get_config(self):
        return ReasonerConfig(architecture=self.architecture, seq_len=self.seq_len,
                              vocab_size=self.vocab_size, num_labels=self.vocab_size,
                              hidden_size=self.hidden_size, num_heads=2,
                              num_layers=self.num_hidden_layers, h_cycles=2, l_cycles=2, halt_max_steps=2)

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_len], self.vocab_size)
        return self.get_config(), {"input_ids": ids}


class ReasonerModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (ReasonerModel, ReasonerForGridClassification)
    # transformers exempts only its own pre-2023 models (found by a copyright year our files do not carry)
    test_can_init_all_missing_weights_before_2023 = True
    has_attentions = False
    test_resize_embeddings = False
    architecture = "trm"

    def setUp(self):
        self.model_tester = ReasonerModelTester(self, architecture=self.architecture)
        self.config_tester = ConfigTester(self, config_class=ReasonerConfig, has_text_modality=False,
                                          common_properties=["hidden_size"])

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is ReasonerForGridClassification:
            # a function of the inputs: two preparations of one batch get the same labels
            inputs["labels"] = (inputs["input_ids"] + 1) % self.model_tester.vocab_size
        return inputs

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_hidden_states_output(self):
        """Replaces the per-layer check: hidden_states are (x, z, y), (batch, 1 + seq_len, hidden) each, asked
        for per call or through the config (a recursive core has no stack of distinct layers)."""
        t = self.model_tester
        config, inputs = t.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            for per_call in (True, False):
                cfg = ReasonerConfig.from_dict(config.to_dict())
                cfg.output_hidden_states = not per_call
                model = model_class(cfg).eval()
                with torch.no_grad():
                    out = model(**inputs, **({"output_hidden_states": True} if per_call else {}))
                shapes = [tuple(h.shape) for h in out.hidden_states]
                self.assertEqual(shapes, [(t.batch_size, t.seq_len + 1, t.hidden_size)] * 3)
                with torch.no_grad():
                    self.assertIsNone(model(**inputs, output_hidden_states=False).hidden_states)


class HRMModelTest(ReasonerModelTest):
    architecture = "hrm"
