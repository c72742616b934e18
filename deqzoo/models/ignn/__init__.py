"""IGNN family: implicit graph neural networks (node and graph classification)."""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="ignn",
    config=f"{_P}.configuration_ignn:IGNNConfig",
    models={"AutoModel": f"{_P}.modeling_ignn:IGNNModel"},
    # transformers has no Auto class for graph tasks: the heads are found by config.architectures
    heads={
        "IGNNForNodeClassification": f"{_P}.modeling_ignn:IGNNForNodeClassification",
        "IGNNForGraphClassification": f"{_P}.modeling_ignn:IGNNForGraphClassification",
    },
    architectures=f"{_P}.configuration_ignn:ARCHITECTURES",
    names=("ignn-chains",),
    app=("ignn-chains",),
    task="chains",
    export={"IGNNForNodeClassification": "graph node classifier"},
    export_refused={"IGNNForGraphClassification": "graph pooling takes the number of graphs from the "
                                                  "batch vector's values"},
    export_prepare=f"{_P}.modeling_ignn:prepare_export",
)

_EXPORTS = {
    "ARCHITECTURES": ".configuration_ignn", "IGNNConfig": ".configuration_ignn",
    **{name: ".modeling_ignn" for name in (
        "IGNNForGraphClassification", "IGNNForNodeClassification", "IGNNGraph", "IGNNModel",
        "IGNNPreTrainedModel", "augmented_normalized_adjacency", "perron_frobenius_radius",
        "project_rows_l1")},
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
