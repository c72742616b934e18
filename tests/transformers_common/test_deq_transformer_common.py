"""transformers' common model tests on the DEQ-Transformer: backbone and causal LM."""

from __future__ import annotations

import unittest

import pytest

from deqzoo.models.deq_transformer.configuration_deq_transformer import DEQTransformerConfig
from deqzoo.models.deq_transformer.modeling_deq_transformer import (
    DEQTransformerForCausalLM,
    DEQTransformerModel,
)

from ._harness import (
    NO_GENERATION_TESTS,
    ConfigTester,
    ModelTesterMixin,
    ids_tensor,
)

pytestmark = [pytest.mark.common,
              pytest.mark.filterwarnings("ignore::deqzoo.modeling_utils.DEQNonConvergenceWarning")]


class DEQTransformerModelTester:
    # one implicit layer (f_θ has n_block=1 block): hidden_states are (token embeddings, equilibrium) and
    # attentions hold one map per block of f_θ
    num_hidden_layers = 1

    def __init__(self, parent, batch_size=2, seq_length=7, vocab_size=32, hidden_size=16,
                 num_attention_heads=2):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.is_training = True

    def get_config(self):
        # fixed-point iteration: see _harness.UNCONVERGED_AT_INIT
        return DEQTransformerConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size, n_head=self.num_attention_heads, d_head=8,
            d_inner=32, tgt_len=self.seq_length, mem_len=self.seq_length, dropout=0.0,
            deq={"f_solver": "fixed_point", "f_max_iter": 20, "f_tol": 1e-7, "b_mode": "ift",
                 "b_max_iter": 20, "b_tol": 1e-7})

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), input_ids

    def prepare_config_and_inputs_for_common(self):
        config, input_ids = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids}


class DEQTransformerModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (DEQTransformerModel, DEQTransformerForCausalLM)
    # transformers exempts only its own pre-2023 models (found by a copyright year our files do not carry)
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = DEQTransformerModelTester(self)
        self.config_tester = ConfigTester(self, config_class=DEQTransformerConfig,
                                          common_properties=["hidden_size", "num_attention_heads"])

    def test_config(self):
        self.config_tester.run_common_tests()

    def _prepare_config_and_inputs_for_retain_grad_hidden_states_attentions(self):
        # By default (final_f_step=False) the output is the solver's z* and the attention maps come from a
        # diagnostic evaluation of f_θ at z* outside the implicit backward: no gradient can reach them. With
        # final_f_step=True the output is f_θ(z*), whose attentions are recorded: their gradients must exist.
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.final_f_step = True
        return config, inputs

    @unittest.skip(reason=NO_GENERATION_TESTS)
    def test_generation_tester_mixin_inheritance(self):
        pass
