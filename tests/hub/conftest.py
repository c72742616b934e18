"""A tiny test-only DEQ image classifier family, registered like a real one (config, model, image processor,
task module). It stands in for the zoo families so the hub can be tested on its own."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.image_processing_backends import PilBackend

from deqzoo.core import DEQ, SolverStats
from deqzoo.modeling_utils import DEQModelOutput, DEQPretrainedConfig, DEQPreTrainedModel
from deqzoo.models.registry import Family

TOY_MODULE = "deqzoo_hub_toy_family"


class ToyDEQConfig(DEQPretrainedConfig):
    model_type = "deqzoo_hub_toy"

    def __init__(self, image_size: int = 8, num_channels: int = 3, hidden_size: int = 16, **kwargs):
        self.image_size = image_size
        self.num_channels = num_channels
        self.hidden_size = hidden_size
        kwargs.setdefault("num_labels", 3)
        super().__init__(**kwargs)


@dataclass
class ToyOutput(DEQModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    deq_stats: SolverStats | None = None


class ToyDEQPreTrainedModel(DEQPreTrainedModel):
    config_class = ToyDEQConfig
    base_model_prefix = "toy"
    main_input_name = "pixel_values"


class ToyDEQForImageClassification(ToyDEQPreTrainedModel):
    """z* = tanh(0.9 W z / ||W||_2 + U x): a contraction, so every solver converges."""

    def __init__(self, config: ToyDEQConfig):
        super().__init__(config)
        d_in = config.num_channels * config.image_size**2
        self.inject = nn.Linear(d_in, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.head = nn.Linear(config.hidden_size, config.num_labels)
        self.register_buffer("label_bias", torch.zeros(config.num_labels))
        self.deq = DEQ(config.deq_config)
        self.post_init()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **_) -> ToyOutput:
        x = self.inject(pixel_values.flatten(1))
        weight = 0.9 * self.mix.weight / torch.linalg.matrix_norm(self.mix.weight, 2)
        z, stats = self.deq(lambda z: torch.tanh(F.linear(z, weight) + x), torch.zeros_like(x))
        logits = self.head(z) + self.label_bias
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ToyOutput(loss=loss, logits=logits, deq_stats=stats)


class ToyImageProcessor(PilBackend):
    model_input_names = ["pixel_values"]
    size = {"height": 8, "width": 8}
    do_resize = True
    do_rescale = True
    do_normalize = False
    do_convert_rgb = False
    resample = 2  # PIL bilinear


ARCHITECTURES = {
    "toy-deq-tiny": {"task": "image-classification", "auto": "AutoModelForImageClassification",
                     "config": {"hidden_size": 16}, "description": "test-only toy DEQ classifier"},
}


# --- the task module protocol (evaluate / demo / predict) --------------------------------------------------
def _samples(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    return torch.rand(4, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    x = _samples(model)[:limit]
    with torch.no_grad():
        out = model(x)
    return {"mean_max_prob": round(float(out.logits.softmax(-1).max(-1).values.mean()), 4)}


def demo(model):
    with torch.no_grad():
        out = model(_samples(model))
    return f"classes {out.logits.argmax(-1).tolist()}", out.deq_stats


def predict(model, input: str) -> str:
    with torch.no_grad():
        out = model(_samples(model)[:1])
    return f"{input}: class {int(out.logits.argmax(-1))}"


TOY_FAMILY = Family(
    model_type=ToyDEQConfig.model_type,
    config=f"{TOY_MODULE}:ToyDEQConfig",
    models={"AutoModel": f"{TOY_MODULE}:ToyDEQForImageClassification",
            "AutoModelForImageClassification": f"{TOY_MODULE}:ToyDEQForImageClassification"},
    architectures=f"{TOY_MODULE}:ARCHITECTURES",
    image_processor=f"{TOY_MODULE}:ToyImageProcessor",
)

# Family paths are "module:attr" strings: expose this file under a stable module name.
sys.modules.setdefault(TOY_MODULE, sys.modules[__name__])


@pytest.fixture
def toy_family():
    from deqzoo.integrations.transformers import register_family, unregister_family
    from deqzoo.predict import PREDICTORS
    from examples.tasks import TASKS, register_task

    register_family(TOY_FAMILY)
    register_task(TOY_MODULE, TOY_MODULE)  # evaluate / demo (a clone's programs)
    PREDICTORS[TOY_MODULE] = predict  # `deqzoo predict` (the package's)
    yield TOY_FAMILY
    TASKS.pop(TOY_MODULE, None)
    PREDICTORS.pop(TOY_MODULE, None)
    unregister_family(TOY_FAMILY.model_type)


def make_toy_checkpoint(directory, *, seed: int = 0, card: bool = True):
    """Save a toy model (+ processor, + card) to `directory`; returns the model."""
    from utils.cards import save, write_model_card

    torch.manual_seed(seed)
    model = ToyDEQForImageClassification(ToyDEQConfig(deq={"f_solver": "anderson", "f_max_iter": 40,
                                                            "f_tol": 1e-6}))
    model.config.id2label = {0: "zero", 1: "one", 2: "two"}
    model.config.label2id = {v: k for k, v in model.config.id2label.items()}
    save(model, directory, ToyImageProcessor())
    if card:
        write_model_card(directory, model_id="deqzoo/toy-deq-tiny", title="Toy DEQ",
                         pipeline_tag="image-classification",
                         task_module=TOY_MODULE, datasets=["random"], dataset_name="random pixels",
                         metrics=[{"type": "mean_max_prob", "name": "Mean max prob",
                                   "value": evaluate(model, limit=None)["mean_max_prob"]}],
                         tags=["test"], train_command="(random init)", eval_command="deqzoo eval DIR",
                         body_markdown="Test-only checkpoint.")
    return model


@pytest.fixture
def toy_checkpoint(tmp_path, toy_family):
    directory = tmp_path / "toy-deq-tiny"
    model = make_toy_checkpoint(directory)
    return directory, model
