"""Configs are strict dataclasses as transformers v5 writes them (huggingface_hub's ``@strict``): typed fields
checked on every assignment, ``validate_*`` methods after ``__init__`` and before a save, errors raised as
`ConfigError` naming the class, the key and the value; one non-convergence policy, at model level."""

import dataclasses
import json
import math
import warnings

import pytest
import torch

from deqzoo.configuration_utils import ConfigError
from deqzoo.core import DEQConvergenceError
from deqzoo.hypersolver import HyperSolverConfig, HyperSolverConfigError
from deqzoo.modeling_utils import DEQNonConvergenceWarning
from deqzoo.models.deq_flow import DEQFlowConfig
from deqzoo.models.deq_transformer import DEQTransformerConfig
from deqzoo.models.ignn import IGNNConfig
from deqzoo.models.implicit2 import Implicit2Config
from deqzoo.models.mdeq import ARCHITECTURES, MDEQConfig, MDEQForImageClassification
from utils.catalog import REPO_ROOT

CONFIGS = {"mdeq": MDEQConfig, "deq_flow": DEQFlowConfig, "deq_transformer": DEQTransformerConfig,
           "ignn": IGNNConfig, "implicit2": Implicit2Config}
CARDS = sorted(p for p in (REPO_ROOT / "model_cards").glob("*/config.json")
               if json.loads(p.read_text()).get("model_type") in CONFIGS)


def test_every_card_is_covered():
    assert {json.loads(p.read_text())["model_type"] for p in CARDS} == set(CONFIGS)


@pytest.mark.parametrize("path", CARDS, ids=lambda p: p.parent.name)
def test_every_embedded_config_loads_to_the_values_it_holds(path):
    """The config.json files written before configs were strict load unchanged: every value they hold comes
    back as written, and the config saves back to the same values."""
    data = json.loads(path.read_text())
    config = CONFIGS[data["model_type"]].from_dict(dict(data))
    values = json.loads(config.to_json_string(use_diff=False))
    for key, value in data.items():
        if key == "deq":  # a newer engine may add settings, at defaults that keep the older behaviour
            assert {k: values["deq"][k] for k in value} == value
        elif key not in ("transformers_version", "dtype", "torch_dtype"):
            assert values[key] == value, (key, values[key], value)
    assert json.loads(type(config).from_dict(values).to_json_string(use_diff=False)) == values


@pytest.mark.parametrize("cls,floats,kept", [
    (MDEQConfig, {"dropout": 0, "bn_momentum": 1, "residual_alpha": 1, "fusion_alpha": 0, "conv_norm": 2,
                  "gamma_bound": 1, "relu_slope": 1, "init_std": 0, "jac_loss_weight": 2},
     {"expansion_factor": 5}),
    (DEQFlowConfig, {"jac_loss_weight": 1, "residual_loss_weight": 2, "flow_residual_weight": 3}, {}),
    (Implicit2Config, {"input_scale": 30, "gabor_alpha": 2, "spectral_max_norm": 1,
                       "coordinate_range": [-2, 3]}, {"spectral_max_norm": None}),
])
def test_float_fields_given_ints_are_stored_and_saved_as_floats(cls, floats, kept):
    """The embedded cards and presets hold these fields as floats (JSON 2.0, not 2) whatever number type was
    given, while the other number fields keep what they were given."""
    saved = json.loads(cls(**floats).to_json_string(use_diff=False))
    for key, value in floats.items():
        numbers = saved[key] if isinstance(value, list) else [saved[key]]
        assert saved[key] == value and {type(v) for v in numbers} == {float}, (key, saved[key])
    saved = json.loads(cls(**kept).to_json_string(use_diff=False))  # ints stay ints there, None stays None
    for key, value in kept.items():
        assert saved[key] == value and type(saved[key]) is type(value), (key, saved[key])


@pytest.mark.parametrize("cls,key,value,message", [
    (MDEQConfig, "num_groups", "2", "MDEQConfig: key 'num_groups' must be int, got '2' (str)"),
    (MDEQConfig, "num_groups", 2.0, "key 'num_groups' must be int, got 2.0 (float)"),
    (MDEQConfig, "wnorm", 1, "key 'wnorm' must be bool, got 1 (int)"),
    (MDEQConfig, "dropout", math.inf, "key 'dropout' must be float (finite), got inf"),
    (MDEQConfig, "dropout", 1.5, "key 'dropout' is 1.5, outside the allowed range [0.0, 1.0)"),
    (MDEQConfig, "branch_channels", [16, 0], "an entry of 'branch_channels' is 0, outside"),
    (MDEQConfig, "branch_channels", (16, "a"), "key 'branch_channels' must be a list of int"),
    (MDEQConfig, "image_std", [1.0] * 2000, "key 'image_std' has 2,000 entries, above the limit of 1024"),
    (DEQFlowConfig, "feature_norm", "layer", "key 'feature_norm' must be one of 'instance', 'batch'"),
    (DEQFlowConfig, "corr_levels", 7, "key 'corr_levels' is 7, outside the allowed range [1, 6]"),
    (DEQTransformerConfig, "variant", "xl", "key 'variant' must be one of 'bai2019', 'torchdeq'"),
    (DEQTransformerConfig, "tie_projs", [0, 1], "key 'tie_projs' must be a list of bool"),
    (IGNNConfig, "kappa", -1.0, "key 'kappa' is -1.0, outside the allowed range"),
    (IGNNConfig, "graph_head_hidden", "64", "key 'graph_head_hidden' must be int or None, got '64'"),
    (Implicit2Config, "hidden_size", 10**6, "key 'hidden_size' is 1000000, outside the allowed range"),
    (Implicit2Config, "spectral_max_norm", math.nan, "key 'spectral_max_norm' must be float (finite)"),
    (Implicit2Config, "input_scale", 0, "key 'input_scale' is 0, outside the allowed range (0.0, None]"),
    (IGNNConfig, "spectral_radius", 0.0, "key 'spectral_radius' is 0.0, outside the allowed range (0.0,"),
    (MDEQConfig, "conv_norm", 0.0, "key 'conv_norm' is 0.0, outside the allowed range (0.0, None]"),
    (MDEQConfig, "fusion_alpha", 1.5, "key 'fusion_alpha' is 1.5, outside the allowed range [0.0, 1.0]"),
    (MDEQConfig, "final_conv_kernel", 2, "key 'final_conv_kernel' must be one of 1, 3, got 2"),
])
def test_a_bad_value_is_refused_at_construction_and_at_assignment(cls, key, value, message):
    with pytest.raises(ConfigError, match=f"^{cls.__name__}: ") as info:
        cls(**{key: value})
    assert message in str(info.value), str(info.value)
    config = cls()
    before = config.to_dict()
    with pytest.raises(ConfigError) as info:
        setattr(config, key, value)
    assert message in str(info.value), str(info.value)
    assert config.to_dict() == before  # a refused assignment changes nothing


def test_fields_are_typed_and_every_config_is_a_strict_dataclass():
    for cls in CONFIGS.values():
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"deq", "on_nonconvergence"} <= names
        assert callable(cls.validate) and "deq" in cls.__validators__
    hints = {f.name: f.type for f in dataclasses.fields(MDEQConfig)}
    assert hints["num_groups"] is int and hints["wnorm"] is bool


def test_whole_config_checks_run_after_init_and_before_a_save(tmp_path):
    with pytest.raises(ConfigError, match="MDEQConfig: key 'branch_channels': entry 10 is not divisible by "
                                          "num_groups=4"):
        MDEQConfig(branch_channels=[10, 20], num_groups=4)
    config = MDEQConfig(**ARCHITECTURES["mdeq-tiny-mnist"]["config"])
    config.num_groups = 3  # a valid int on its own; only the whole config shows it divides no stream
    with pytest.raises(ConfigError, match="not divisible by num_groups=3"):
        config.validate()
    with pytest.raises(ConfigError, match="not divisible by num_groups=3"):
        config.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad" / "config.json").exists()
    with pytest.raises(ConfigError, match="n_head\\*d_head \\(3\\*8\\) must equal d_model \\(16\\)"):
        DEQTransformerConfig(d_model=16, n_head=3, d_head=8)
    with pytest.raises(ConfigError, match="key 'encoder_layers' must be a list of 4 to 4 integers"):
        DEQFlowConfig(encoder_layers=[64, 64])
    with pytest.raises(ConfigError, match="key 'coordinate_range' must be two finite numbers low < high"):
        Implicit2Config(coordinate_range=[1.0, -1.0])
    with pytest.raises(ConfigError, match="IGNNConfig: key 'dropout' is 1.0, outside the allowed range"):
        IGNNConfig(dropout=1.0)


def test_the_engine_config_is_a_validated_nested_field():
    config = IGNNConfig(deq={"f_max_iter": 7})
    assert config.deq_config.f_max_iter == 7 and config.deq["f_solver"] == "fixed_point"  # family default
    with pytest.raises(ConfigError, match="IGNNConfig: key 'deq': DEQConfig.f_solver='newton' is not "
                                          "registered"):
        IGNNConfig(deq={"f_solver": "newton"})
    with pytest.raises(ConfigError, match="IGNNConfig: key 'deq': Unknown DEQConfig key"):
        IGNNConfig(deq={"f_max_iterations": 3})
    with pytest.raises(ConfigError, match="key 'deq' must be a mapping, DEQConfig or None, got \\[1\\]"):
        IGNNConfig(deq=[1])
    config.deq = {"f_max_iter": 0}  # the nested dict is checked as a whole, by DEQConfig itself
    with pytest.raises(ConfigError, match="key 'deq': DEQConfig.f_max_iter must be an integer >= 1"):
        config.validate()


def _tiny_mdeq(**config):
    torch.manual_seed(0)
    preset = {**ARCHITECTURES["mdeq-tiny-mnist"]["config"], "deq": {"f_max_iter": 2, "f_tol": 1e-9}}
    return MDEQForImageClassification(MDEQConfig(**{**preset, **config})).eval()


def test_one_nonconvergence_policy_at_model_level():
    x = torch.randn(2, 1, 28, 28)
    strict = _tiny_mdeq(on_nonconvergence="raise")  # given to the config, the engine follows it
    assert strict.config.deq_config.on_nonconvergence == "raise"
    with pytest.raises(DEQConvergenceError), torch.no_grad():
        strict(x)
    strict.config.on_nonconvergence = "ignore"  # so does a later assignment
    assert strict.config.deq_config.on_nonconvergence == "ignore"
    # an older config kept a policy inside `deq`: it becomes the model's, and the engine stays silent, so a
    # stalled solve gives one model warning, not a second one from the engine
    legacy = _tiny_mdeq(deq={"f_max_iter": 2, "f_tol": 1e-9, "on_nonconvergence": "warn"})
    assert legacy.config.on_nonconvergence == "warn" and legacy.config.deq["on_nonconvergence"] == "ignore"
    with warnings.catch_warnings(record=True) as got, torch.no_grad():
        warnings.simplefilter("always")
        legacy(x)
    assert [w.category for w in got] == [DEQNonConvergenceWarning], [str(w.message) for w in got]
    assert MDEQConfig(deq={"on_nonconvergence": "raise"}).on_nonconvergence == "raise"
    with pytest.raises(ConfigError, match="key 'on_nonconvergence' must be one of"):
        MDEQConfig(on_nonconvergence="shout")


def test_hypersolver_config_is_strict_too():
    config = HyperSolverConfig(state_kind="multires", state_channels=(4, 8))
    assert config.state_channels == [4, 8] and HyperSolverConfig.from_dict(config.to_dict()) == config
    with pytest.raises(HyperSolverConfigError, match="x.json: HyperSolverConfig: key 'pool' is 0, outside"):
        HyperSolverConfig.from_dict({"pool": 0}, source="x.json")
    with pytest.raises(HyperSolverConfigError, match="key 'form' must be one of 'anderson', 'simplified'"):
        HyperSolverConfig(form="newton")
    with pytest.raises(ConfigError, match="key 'm' must be int, got True"):
        config.m = True
    with pytest.raises(HyperSolverConfigError, match="unknown hypersolver config key"):
        HyperSolverConfig.from_dict({"pools": 2})


def test_a_presets_model_class_follows_its_task():
    """create_model builds the class of the Auto class a preset's task implies (`deqzoo.factory`): every
    family declares it, and the heads come out as the presets' tasks say."""
    from deqzoo.factory import _architectures, _model_class
    from deqzoo.models.registry import available_families

    classes = {}
    for family in available_families().values():
        for name, preset in _architectures(family).items():
            assert preset["auto"] in family.models, (name, preset["task"], preset["auto"])
            cls = _model_class(family, preset["auto"], preset["config"].get("architectures"))
            classes[name] = cls.__name__
    assert classes["mdeq-cifar-tiny"] == "MDEQForImageClassification"
    assert classes["mdeq-cityscapes-small"] == "MDEQForSemanticSegmentation"
    assert classes["deq-transformer-tiny-pydoc"] == "DEQTransformerForCausalLM"
    assert classes["ignn-chains"] == "IGNNForNodeClassification"
    assert classes["deq-flow-cpu-synth"] == "DEQFlowForOpticalFlow"
    assert classes["implicit2-isiren-camera"] == "Implicit2ForSignalRepresentation"
