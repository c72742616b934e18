"""DEQ-Transformer language models (Bai et al. 2019; TorchDEQ's redesign) as config variants of one model."""

from .configuration_deq_transformer import ARCHITECTURES, DEQTransformerConfig
from .modeling_deq_transformer import (
    DEQTransformerCache,
    DEQTransformerCausalLMOutput,
    DEQTransformerForCausalLM,
    DEQTransformerModel,
    DEQTransformerModelOutput,
    DEQTransformerPreTrainedModel,
)

__all__ = [
    "ARCHITECTURES", "DEQTransformerCache", "DEQTransformerCausalLMOutput", "DEQTransformerConfig",
    "DEQTransformerForCausalLM", "DEQTransformerModel", "DEQTransformerModelOutput",
    "DEQTransformerPreTrainedModel",
]
