"""IGNN configuration: implicit graph layers Z = φ(Â Z Wᵀ + Â X Ω₁ᵀ [+ X Ω₂ᵀ]) solved to equilibrium.

Gu, Chang, Zhu, Sojoudi, El Ghaoui, "Implicit Graph Neural Networks", NeurIPS 2020 (SwiftieH/IGNN);
TorchDEQ's re-implementation (locuslab/torchdeq, deq-zoo/ignn) adds the Ω₂ skip term and a clipped
spectral normalization of W, Ω₁, Ω₂.
"""

from __future__ import annotations

from typing import Any

from ...modeling_utils import DEQPretrainedConfig

INJECTIONS = ("adjacency", "adjacency+linear")
NORM_TYPES = ("none", "spectral_norm", "weight_norm")
ACTIVATIONS = ("relu", "tanh", "identity")
POOLINGS = ("add", "mean", "max")

# The original solves with plain fixed-point iteration, at most 300 steps, stopping at an absolute tolerance.
DEFAULT_DEQ: dict[str, Any] = {
    "f_solver": "fixed_point",
    "f_max_iter": 300,
    "f_tol": 3e-6,
    "f_stop_mode": "abs",
    "b_mode": "ift",
    "b_solver": "fixed_point",
    "b_max_iter": 300,
    "b_tol": 3e-6,
    "b_stop_mode": "abs",
}


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
    # checked before __init__ runs (deqzoo.modeling_utils.check_config_values); the size budget does the rest
    value_ranges = {
        "in_features": (1, 1 << 24), "hidden_size": (1, 65536), "num_layers": (1, 64), "kappa": (0.0, None),
        "spectral_radius": (0.0, None), "pf_tol": (0.0, 1.0), "pf_max_iter": (1, 1_000_000),
        "norm_clip_value": (0.0, None), "dropout": (0.0, 1.0), "graph_head_hidden": (1, 65536),
    }

    def __init__(
        self,
        in_features: int = 100,
        hidden_size: int = 16,
        num_layers: int = 1,
        kappa: float | None = 0.9,
        spectral_radius: float | None = None,
        pf_tol: float = 1e-6,
        pf_max_iter: int = 2000,
        injection: str = "adjacency",
        norm_type: str = "none",
        norm_clip: bool = False,
        norm_clip_value: float = 1.0,
        activation: str = "relu",
        dropout: float = 0.5,
        normalize_states: bool = True,
        graph_pooling: str = "add",
        graph_head_hidden: int | None = None,
        deq: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        deq = {**DEFAULT_DEQ, **(deq.to_dict() if hasattr(deq, "to_dict") else (deq or {}))}
        for name, value, allowed in (
            ("injection", injection, INJECTIONS),
            ("norm_type", norm_type, NORM_TYPES),
            ("activation", activation, ACTIVATIONS),
            ("graph_pooling", graph_pooling, POOLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"IGNNConfig.{name}={value!r}; choose one of {list(allowed)}")
        for name, value in (
            ("in_features", in_features),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"IGNNConfig.{name} must be an integer >= 1, got {value!r}")
        if kappa is not None and not kappa >= 0:
            raise ValueError(f"IGNNConfig.kappa must be >= 0 or None, got {kappa!r}")
        if spectral_radius is not None and not spectral_radius > 0:
            raise ValueError(f"IGNNConfig.spectral_radius must be > 0 or None, got {spectral_radius!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"IGNNConfig.dropout must be in [0, 1), got {dropout!r}")
        self.in_features = in_features
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.kappa = kappa
        self.spectral_radius = spectral_radius
        self.pf_tol = pf_tol
        self.pf_max_iter = pf_max_iter
        self.injection = injection
        self.norm_type = norm_type
        self.norm_clip = norm_clip
        self.norm_clip_value = norm_clip_value
        self.activation = activation
        self.dropout = dropout
        self.normalize_states = normalize_states
        self.graph_pooling = graph_pooling
        self.graph_head_hidden = graph_head_hidden
        super().__init__(deq=deq, **kwargs)


# Named presets for deqzoo.create_model (see deqzoo.models.registry).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "ignn-chains": {
        "task": "graph-ml",
        "auto": "AutoModel",
        "config": {
            "in_features": 100,
            "hidden_size": 16,
            "num_labels": 2,
            "kappa": 0.9,
            "dropout": 0.5,
            "architectures": ["IGNNForNodeClassification"],
        },
        "description": "IGNN node classifier for the synthetic chains task "
        "(the paper's long-range benchmark).",
    },
    "ignn-graph": {
        "task": "graph-ml",
        "auto": "AutoModel",
        "config": {
            "in_features": 7,
            "hidden_size": 64,
            "num_layers": 3,
            "num_labels": 2,
            "kappa": 0.9,
            "spectral_radius": 1.0,
            "graph_pooling": "add",
            "graph_head_hidden": 64,
            "architectures": ["IGNNForGraphClassification"],
        },
        "description": "IGNN graph classifier as the original's graph-classification model "
        "(3 implicit layers, "
        "add pooling, 2-layer MLP).",
    },
}
