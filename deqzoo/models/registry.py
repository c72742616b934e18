"""The families of the zoo. Adding a family costs its two files and one entry here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    """Where a family's classes live, as "module:attribute" strings (imported on demand).

    `models` maps a transformers Auto class name (e.g. "AutoModelForImageClassification") to the model class;
    `heads` names model classes with no transformers Auto class (found through config.architectures);
    `architectures` is the module attribute holding named presets: {name: {"task": ..., "config": {...}}}.
    """

    model_type: str
    config: str
    models: dict[str, str]
    architectures: str
    image_processor: str | None = None
    tokenizer: str | None = None
    timm_module: str | None = None
    heads: dict[str, str] = field(default_factory=dict)

    def load(self, path: str):
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)


_M = "deqzoo.models"
_DT = f"{_M}.deq_transformer"

FAMILIES: list[Family] = [
    Family(
        model_type="mdeq",
        config=f"{_M}.mdeq.configuration_mdeq:MDEQConfig",
        models={
            "AutoModel": f"{_M}.mdeq.modeling_mdeq:MDEQModel",
            "AutoModelForImageClassification": f"{_M}.mdeq.modeling_mdeq:MDEQForImageClassification",
            "AutoModelForSemanticSegmentation": f"{_M}.mdeq.modeling_mdeq:MDEQForSemanticSegmentation",
        },
        architectures=f"{_M}.mdeq.configuration_mdeq:ARCHITECTURES",
        image_processor=f"{_M}.mdeq.image_processing_mdeq:MDEQImageProcessor",
        timm_module="deqzoo.integrations.timm",
    ),
    Family(
        model_type="deq_transformer",
        config=f"{_DT}.configuration_deq_transformer:DEQTransformerConfig",
        models={
            "AutoModel": f"{_DT}.modeling_deq_transformer:DEQTransformerModel",
            "AutoModelForCausalLM": f"{_DT}.modeling_deq_transformer:DEQTransformerForCausalLM",
        },
        architectures=f"{_DT}.configuration_deq_transformer:ARCHITECTURES",
    ),
    Family(
        model_type="ignn",
        config=f"{_M}.ignn.configuration_ignn:IGNNConfig",
        models={
            "AutoModel": f"{_M}.ignn.modeling_ignn:IGNNModel",
        },
        # transformers has no Auto class for graph tasks: the heads are found by config.architectures
        heads={
            "IGNNForNodeClassification": f"{_M}.ignn.modeling_ignn:IGNNForNodeClassification",
            "IGNNForGraphClassification": f"{_M}.ignn.modeling_ignn:IGNNForGraphClassification",
        },
        architectures=f"{_M}.ignn.configuration_ignn:ARCHITECTURES",
    ),
    Family(
        model_type="implicit2",
        config=f"{_M}.implicit2.configuration_implicit2:Implicit2Config",
        models={
            "AutoModel": f"{_M}.implicit2.modeling_implicit2:Implicit2Model",
        },
        # transformers has no Auto class for coordinate-to-signal networks: heads found by
        # config.architectures
        heads={
            "Implicit2ForSignalRepresentation": (
                f"{_M}.implicit2.modeling_implicit2:Implicit2ForSignalRepresentation"
            ),
        },
        architectures=f"{_M}.implicit2.configuration_implicit2:ARCHITECTURES",
    ),
    Family(
        model_type="deq_flow",
        config=f"{_M}.deq_flow.configuration_deq_flow:DEQFlowConfig",
        models={
            "AutoModel": f"{_M}.deq_flow.modeling_deq_flow:DEQFlowModel",
        },
        # transformers has no Auto class for optical flow: the head is found by config.architectures
        heads={
            "DEQFlowForOpticalFlow": f"{_M}.deq_flow.modeling_deq_flow:DEQFlowForOpticalFlow",
        },
        architectures=f"{_M}.deq_flow.configuration_deq_flow:ARCHITECTURES",
    ),
]
