"""IGNN family: implicit graph neural networks (node and graph classification)."""

from .configuration_ignn import ARCHITECTURES, IGNNConfig
from .modeling_ignn import (
    IGNNForGraphClassification,
    IGNNForNodeClassification,
    IGNNGraph,
    IGNNModel,
    IGNNPreTrainedModel,
    augmented_normalized_adjacency,
    perron_frobenius_radius,
    project_rows_l1,
)

__all__ = [
    "ARCHITECTURES", "IGNNConfig", "IGNNForGraphClassification", "IGNNForNodeClassification", "IGNNGraph",
    "IGNNModel", "IGNNPreTrainedModel", "augmented_normalized_adjacency", "perron_frobenius_radius",
    "project_rows_l1",
]
