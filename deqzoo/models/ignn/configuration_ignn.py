"""IGNN configuration: implicit graph layers Z = φ(Â Z Wᵀ + Â X Ω₁ᵀ [+ X Ω₂ᵀ]) solved to equilibrium.

Gu, Chang, Zhu, Sojoudi, El Ghaoui, "Implicit Graph Neural Networks", NeurIPS 2020 (SwiftieH/IGNN);
TorchDEQ's re-implementation (locuslab/torchdeq, deq-zoo/ignn) adds the Ω₂ skip term and a clipped
spectral normalization of W, Ω₁, Ω₂.
"""

from typing import Any, Literal

from ...configuration_utils import DEQPretrainedConfig, preset, ranged, strict_config

# The original solves with plain fixed-point iteration, at most 300 steps, stopping at an absolute tolerance.
DEFAULT_DEQ: dict[str, Any] = {"f_solver": "fixed_point", "f_max_iter": 300, "f_tol": 3e-6,
                               "f_stop_mode": "abs", "b_mode": "ift", "b_solver": "fixed_point",
                               "b_max_iter": 300, "b_tol": 3e-6, "b_stop_mode": "abs"}


@strict_config
class IGNNConfig(DEQPretrainedConfig):
    """Configuration of an Implicit Graph Neural Network.

    Args:
        in_features: node feature size p.
        hidden_size: equilibrium state size m per node.
        num_layers: implicit layers stacked (each its own equilibrium; the original graph classifier uses 3).
        kappa: well-posedness projection ||W||∞ <= kappa / λ_pf(|Â|) applied before every forward (the
            original's); ``None`` or 0 disables it.
        spectral_radius: a fixed λ_pf to use instead of estimating it per graph (the original graph
            classifier uses 1.0); ``None`` uses 1 for nonnegative edge weights (exact) and
            a power-iteration bound for signed weights.
        pf_tol, pf_max_iter: tolerance (relative gap of the upper and lower bound) and cap of that estimate.
        injection: "adjacency" (Â X Ω₁ᵀ, the original) or "adjacency+linear" (Â X Ω₁ᵀ + X Ω₂ᵀ, TorchDEQ).
        norm_type: "none", "spectral_norm" or "weight_norm" on W, Ω₁ (, Ω₂) (TorchDEQ's alternative).
        norm_clip, norm_clip_value: clip the rescaling factor (a norm may only shrink a weight).
        activation: φ, "relu" as in the paper.
        dropout: dropout before the classifier.
        normalize_states: L2-normalize each node's equilibrium state before the node classifier (original).
        graph_pooling, graph_head_hidden: graph head: pool node states ("add" as the original), then
            Linear(H, graph_head_hidden) -> ReLU -> dropout -> Linear(., num_labels).
        deq: solver settings (DEQConfig dict); defaults follow the original (fixed point, 300 steps,
            abs 3e-6).

    Example:
        >>> from deqzoo.models.ignn import IGNNConfig
        >>> cfg = IGNNConfig(in_features=100, hidden_size=16, num_labels=2)
        >>> cfg.model_type, cfg.deq_config.f_solver
        ('ignn', 'fixed_point')
    """

    model_type = "ignn"
    default_deq = DEFAULT_DEQ

    in_features: int = ranged(1, 1 << 24, default=100)
    hidden_size: int = ranged(1, 65536, default=16)
    num_layers: int = ranged(1, 64, default=1)
    kappa: float | int | None = ranged(0.0, None, default=0.9)
    spectral_radius: float | int | None = ranged(0.0, None, open_low=True, default=None)
    pf_tol: float | int = ranged(0.0, 1.0, default=1e-6)
    pf_max_iter: int = ranged(1, 1_000_000, default=2000)
    injection: Literal["adjacency", "adjacency+linear"] = "adjacency"
    norm_type: Literal["none", "spectral_norm", "weight_norm"] = "none"
    norm_clip: bool = False
    norm_clip_value: float | int = ranged(0.0, None, default=1.0)
    activation: Literal["relu", "tanh", "identity"] = "relu"
    dropout: float | int = ranged(0.0, 1.0, open_high=True, default=0.5)
    normalize_states: bool = True
    graph_pooling: Literal["add", "mean", "max"] = "add"
    graph_head_hidden: int | None = ranged(1, 65536, default=None)


# Named presets for deqzoo.create_model (see deqzoo.models.registry).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "ignn-chains": preset(
        "graph-ml", "IGNN node classifier for the synthetic chains task (the paper's long-range benchmark).",
        in_features=100,
        hidden_size=16,
        num_labels=2,
        kappa=0.9,
        dropout=0.5,
        architectures=["IGNNForNodeClassification"],
    ),
    "ignn-graph": preset(
        "graph-ml", "IGNN graph classifier as the original's graph-classification model (3 implicit layers, "
        "add pooling, 2-layer MLP).",
        in_features=7,
        hidden_size=64,
        num_layers=3,
        num_labels=2,
        kappa=0.9,
        spectral_radius=1.0,
        graph_pooling="add",
        graph_head_hidden=64,
        architectures=["IGNNForGraphClassification"],
    ),
}
