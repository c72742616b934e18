"""transformers' common model tests on MDEQ: backbone, image classification and semantic segmentation, with
the original f_θ and with the Lipschitz f_θ (Sato & Iiduka)."""

from __future__ import annotations

import unittest

import pytest
import torch

from deqzoo.models.mdeq.configuration_mdeq import MDEQConfig
from deqzoo.models.mdeq.modeling_mdeq import (
    MDEQForImageClassification,
    MDEQForSemanticSegmentation,
    MDEQModel,
)

from ._harness import (
    NO_TOKEN_EMBEDDINGS,
    ConfigTester,
    ModelTesterMixin,
    floats_tensor,
    ids_tensor,
)

pytestmark = pytest.mark.common


class MDEQModelTester:
    def __init__(self, parent, lipschitz=False, batch_size=2, image_size=8, num_channels=1, num_labels=3):
        self.parent = parent
        self.lipschitz = lipschitz
        self.batch_size = batch_size
        self.image_size = image_size
        self.num_channels = num_channels
        self.num_labels = num_labels
        self.branch_channels = [8, 8]
        self.is_training = True

    def get_config(self):
        if self.lipschitz:  # contractive by construction: Anderson converges to the tight tolerance
            extra = dict(wnorm=False, lipschitz=True, spectral_fft_size=self.image_size + 4)
            deq = {"f_solver": "anderson", "f_max_iter": 40, "f_tol": 1e-6, "b_solver": "anderson",
                   "b_max_iter": 40, "b_tol": 1e-6}
        else:  # see _harness.UNCONVERGED_AT_INIT
            extra = {}
            deq = {"f_solver": "fixed_point", "f_max_iter": 12, "f_tol": 1e-6, "b_solver": "fixed_point",
                   "b_max_iter": 12, "b_tol": 1e-6}
        return MDEQConfig(
            in_channels=self.num_channels, image_size=[self.image_size] * 2,
            branch_channels=self.branch_channels, head_channels=[4, 4], final_chansize=16, expansion_factor=2,
            num_groups=4, downsample_times=0, num_labels=self.num_labels, num_layers=2, deq=deq, **extra)

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        labels = ids_tensor([self.batch_size], self.num_labels)
        return self.get_config(), pixel_values, labels

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, _ = self.prepare_config_and_inputs()
        return config, {"pixel_values": pixel_values}


class MDEQCommonTests(ModelTesterMixin):
    all_model_classes = (MDEQModel, MDEQForImageClassification, MDEQForSemanticSegmentation)
    # transformers exempts only its own pre-2023 models (found by a copyright year our files do not carry)
    test_can_init_all_missing_weights_before_2023 = True
    has_attentions = False
    test_resize_embeddings = False
    lipschitz = False

    def setUp(self):
        self.model_tester = MDEQModelTester(self, lipschitz=self.lipschitz)
        self.config_tester = ConfigTester(self, config_class=MDEQConfig, has_text_modality=False,
                                          common_properties=["num_labels", "image_size"])

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_hidden_states_output(self):
        """Replaces the sequence-shaped check: hidden_states are the equilibrium of every resolution, highest
        first, each (B, C_i, H / 2^i, W / 2^i), asked for per call or through the config."""
        t = self.model_tester
        config, inputs = t.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            for per_call in (True, False):
                cfg = MDEQConfig.from_dict(config.to_dict())
                cfg.output_hidden_states = not per_call
                model = model_class(cfg).eval()
                with torch.no_grad():
                    out = model(**inputs, **({"output_hidden_states": True} if per_call else {}))
                shapes = [tuple(h.shape) for h in out.hidden_states]
                expected = [(t.batch_size, c, t.image_size >> i, t.image_size >> i)
                            for i, c in enumerate(t.branch_channels)]
                self.assertEqual(shapes, expected, model_class.__name__)
                with torch.no_grad():
                    self.assertIsNone(model(**inputs, output_hidden_states=False).hidden_states)

    @unittest.skip(reason=NO_TOKEN_EMBEDDINGS)
    def test_model_get_set_embeddings(self):
        pass


@pytest.mark.filterwarnings("ignore::deqzoo.modeling_utils.DEQNonConvergenceWarning")
class MDEQModelTest(MDEQCommonTests, unittest.TestCase):
    pass


class LipschitzMDEQModelTest(MDEQCommonTests, unittest.TestCase):
    lipschitz = True
