"""Implicit Graph Neural Networks (Gu et al., NeurIPS 2020) on deqzoo's engine.

One implicit layer finds the equilibrium of

    Z = φ(Â Z Wᵀ + Â X Ω₁ᵀ [+ X Ω₂ᵀ])        Z: (nodes, hidden), X: (nodes, features)

where Â is the augmented normalized adjacency of the original (self-loops added, D^-1/2 (A + I) D^-1/2 with
D the row sums of A + I, A[source, target] = edge weight) used as an aggregation operator: node j sums over
its in-neighbours i. Only sparse products with Â are formed, so time and memory grow with the edge count.

Well-posedness, two ways (both available, as in TorchDEQ's version):
- the original's projection ||W||∞ <= κ / λ_pf(|Â|) (rows of W projected onto an ℓ1 ball before each
  forward; λ_pf is exactly 1 for nonnegative edge weights, and for signed weights is bounded by power
  iteration with Collatz–Wielandt upper bounds), and
- TorchDEQ's clipped spectral (or weight) normalization of W, Ω₁, Ω₂ via :mod:`deqzoo.core.norm`.

Graphs come in the PyTorch Geometric convention (``x``, ``edge_index`` with row 0 the sources and row 1 the
targets, optional ``edge_weight``, ``batch``), as a torch sparse adjacency (``adjacency[i, j] = w`` for an
edge i -> j, i.e. ``torch.sparse_coo_tensor(edge_index, edge_weight)``), or as a PyG ``Data``/``Batch``
object (anything with ``.x`` and ``.edge_index``; torch_geometric itself is not imported).

For the engine the whole graph (or a batch of graphs, block-diagonal as in the original) is one sample:
the state has shape (1, nodes, hidden) and solver statistics describe the whole input.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithNoAttention

from ...core import DEQ, SolverStats
from ...core.norm import apply_norm, reset_norm
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from .configuration_ignn import IGNNConfig

__all__ = [
    "IGNNForGraphClassification", "IGNNForNodeClassification", "IGNNGraph", "IGNNModel",
    "IGNNPreTrainedModel", "augmented_normalized_adjacency", "perron_frobenius_radius", "project_rows_l1",
]

_ACTIVATIONS = {"relu": F.relu, "tanh": torch.tanh, "identity": lambda t: t}

# Documented input limits, checked before the operator is built: nodes and edges of one (batched) graph.
MAX_GRAPH_NODES = 10_000_000
MAX_GRAPH_EDGES = 200_000_000


# ----------------------------------------------------------------------------------------------- graph input
@dataclass
class IGNNGraph:
    """A validated graph ready for IGNN: the aggregation operator Â (sparse CSR, rows = targets) and batch.

    Build once with :meth:`IGNNModel.prepare_graph` and pass as ``graph=`` to reuse it (its λ_pf estimate
    is cached on it).
    """

    operator: torch.Tensor
    num_nodes: int
    batch: torch.Tensor | None = None
    num_graphs: int = 1
    nonnegative: bool = True
    _radius: float | None = field(default=None, repr=False)

    def spectral_radius(self, tol: float = 1e-6, max_iter: int = 2000) -> float:
        """λ_pf(|Â|), computed once per graph.

        With nonnegative edge weights it is exactly 1: D^-1/2 (A + I) D^-1/2 with D the row sums of A + I is
        similar (by D^1/2) to the row-stochastic D^-1 (A + I). Signed weights fall back to the power
        iteration of :func:`perron_frobenius_radius` (an upper bound tight to `tol`).
        """
        if self._radius is None:
            if self.nonnegative:
                self._radius = 1.0
            else:
                self._radius = perron_frobenius_radius(self.operator, tol=tol, max_iter=max_iter)
        return self._radius


def _check_edge_index(edge_index: torch.Tensor, num_nodes: int) -> None:
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(
            f"edge_index must be a torch.LongTensor of shape (2, num_edges), got {type(edge_index)}"
        )
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape (2, num_edges), got {tuple(edge_index.shape)}")
    if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
        raise TypeError(f"edge_index must hold integers, got dtype {edge_index.dtype}")
    if edge_index.numel():
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= num_nodes:
            bad = ((edge_index < 0) | (edge_index >= num_nodes)).any(0).nonzero()[0, 0].item()
            raise ValueError(
                f"edge_index holds node indices in [{lo}, {hi}] but the graph has {num_nodes} nodes "
                f"(valid: 0..{num_nodes - 1}); first bad edge #{bad}: {edge_index[:, bad].tolist()}"
            )


def augmented_normalized_adjacency(edge_index: torch.Tensor, num_nodes: int,
                                   edge_weight: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The original's ``aug_normalized_adjacency`` as an aggregation operator (sparse CSR, rows = targets).

    With A[i, j] = w for an edge i -> j: Ã = A + I, d = Ã.sum(1), Â = D^-1/2 Ã D^-1/2, returned transposed
    (``out[j, i] = Â[i, j]``) so that ``out @ H`` sums, at each node, its in-neighbours' messages, which is
    how the original applies it (``X W Â`` in its (hidden, nodes) layout). Duplicate edges add up.

    Example:
        >>> import torch
        >>> op = augmented_normalized_adjacency(torch.tensor([[0], [1]]), num_nodes=2)
        >>> op.to_dense()
        tensor([[0.5000, 0.0000],
                [0.7071, 1.0000]])
    """
    _check_edge_index(edge_index, num_nodes)
    device = edge_index.device
    if edge_weight is None:
        edge_weight = torch.ones(edge_index.shape[1], dtype=dtype, device=device)
    elif not isinstance(edge_weight, torch.Tensor) or edge_weight.shape != (edge_index.shape[1],):
        raise ValueError(
            f"edge_weight must be a 1-D tensor of shape ({edge_index.shape[1]},) (one weight per edge of "
            f"edge_index), got {getattr(edge_weight, 'shape', type(edge_weight))}"
        )
    # sum duplicate edges first, in a canonical order, so that an edge list and the equivalent sparse
    # adjacency go through bit-identical arithmetic
    a = torch.sparse_coo_tensor(edge_index.long(), edge_weight.to(dtype), (num_nodes, num_nodes),
                                check_invariants=False).coalesce()
    loops = torch.arange(num_nodes, device=device)
    src = torch.cat([a.indices()[0], loops])
    dst = torch.cat([a.indices()[1], loops])
    w = torch.cat([a.values(), torch.ones(num_nodes, dtype=dtype, device=device)])
    deg = torch.zeros(num_nodes, dtype=dtype, device=device).index_add_(0, src, w)
    if bool((deg < 0).any()):
        bad = int((deg < 0).nonzero()[0, 0])
        raise ValueError(
            f"edge weights make the row sum of A + I negative at node {bad} ({deg[bad].item():.4g}); the "
            "augmented normalized adjacency D^-1/2 (A + I) D^-1/2 needs nonnegative row sums"
        )
    d_inv_sqrt = deg.pow(-0.5)
    d_inv_sqrt[torch.isinf(d_inv_sqrt)] = 0.0  # as the original: a zero row sum gives a zero row
    values = d_inv_sqrt[src] * w * d_inv_sqrt[dst]
    op = torch.sparse_coo_tensor(
        torch.stack([dst, src]), values, (num_nodes, num_nodes), check_invariants=False
    ).coalesce()  # indices were checked above
    with warnings.catch_warnings():  # CSR is "beta" in torch; its products are what we need
        warnings.simplefilter("ignore", UserWarning)
        return op.to_sparse_csr()


def perron_frobenius_radius(operator: torch.Tensor, tol: float = 1e-6, max_iter: int = 2000) -> float:
    """An upper bound of the spectral radius of |Â| tight to relative `tol` (sparse products only).

    Power iteration on the nonnegative matrix |Â| from a positive vector; for any positive x,
    max_i (|Â|x)_i / x_i bounds λ_pf from above (Collatz–Wielandt) and decreases along the iteration, so the
    returned value is always safe for the well-posedness projection, even when stopped early.

    Example:
        >>> import torch
        >>> ring = torch.tensor([[0, 1, 2], [1, 2, 0]])
        >>> round(perron_frobenius_radius(augmented_normalized_adjacency(ring, 3)), 4)
        1.0
    """
    n = operator.shape[0]
    a = operator.to(torch.float64).abs()  # sparse (CSR or COO) or dense
    x = torch.ones(n, 1, dtype=torch.float64, device=operator.device)
    best = math.inf
    for _ in range(max_iter):
        y = a @ x
        ratio = y / x
        hi, lo = ratio.max().item(), ratio.min().item()
        converged = hi - lo <= tol * hi or best - hi <= tol * hi
        best = min(best, hi)
        if converged or hi == 0.0:
            break
        # a floor keeps x positive (the bound needs it) when some component decays faster than the rest
        x = (y / y.max()).clamp_min(1e-200)
    return float(best)


def project_rows_l1(weight: torch.Tensor, radius: float, slack: float = 1e-6) -> torch.Tensor:
    """Euclidean projection of each row of `weight` onto the ℓ1 ball of `radius` (so ||W||∞ <= radius).

    Rows already inside are unchanged, rows outside land on the sphere: the original's
    ``projection_norm_inf``, vectorized (sort-and-threshold, Duchi et al. 2008). Rows within a relative
    `slack` of the sphere count as inside, so projecting twice changes nothing (repeated forwards on the
    same input give bit-identical outputs).

    Example:
        >>> import torch
        >>> project_rows_l1(torch.tensor([[3.0, -1.0], [0.2, 0.1]]), 1.0)
        tensor([[1.0000, -0.0000],
                [0.2000, 0.1000]])
    """
    a = weight.abs()
    over = a.sum(dim=1) > radius * (1 + slack)
    if not bool(over.any()):
        return weight
    u, _ = a.sort(dim=1, descending=True)
    css = u.cumsum(dim=1)
    k = torch.arange(1, weight.shape[1] + 1, dtype=weight.dtype, device=weight.device)
    support = (u - (css - radius) / k > 0).sum(dim=1, keepdim=True).clamp_min(1)
    theta = (css.gather(1, support - 1) - radius) / support.to(weight.dtype)
    projected = weight.sign() * (a - theta).clamp_min(0)
    return torch.where(over.unsqueeze(1), projected, weight)


# ------------------------------------------------------------------------------------------------- modules
class IGNNImplicitLayer(nn.Module):
    """One implicit graph layer's parameters: W (hidden x hidden), Ω₁ and optionally Ω₂ (hidden x in).

    They are ``nn.Linear`` modules without bias so :mod:`deqzoo.core.norm` can normalize them; the weights
    keep the original's orientation (``W.weight`` is the original ``W``, ``Omega_1.weight`` its ``Omega_1``).
    """

    def __init__(self, in_features: int, hidden_size: int, with_linear: bool):
        super().__init__()
        self.W = nn.Linear(hidden_size, hidden_size, bias=False)
        self.Omega_1 = nn.Linear(in_features, hidden_size, bias=False)
        self.Omega_2 = nn.Linear(in_features, hidden_size, bias=False) if with_linear else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The original draws every weight from U(±1/sqrt(hidden)). A model built here ends with PyTorch's
        # Linear draw instead: post_init's _init_weights resets the layer's Linears after this runs, so W is
        # U(±1/sqrt(hidden)) as in the original but Ω is U(±1/sqrt(in_features)), narrower when in > hidden
        # (pinned by test_implicit_layer_init). Kept on purpose: with the original's Ω draw the chains recipe
        # (examples/ignn/train_chains.py, 200 epochs, seed 0) fails from length 70 on (held-out accuracy
        # 0.495 / 0.515 / 0.790 / 0.465 at 70 / 80 / 90 / 100) where the ignn-chains card's run reaches 1.0 at
        # 100; changing the draw would also change every from-scratch training run behind the card.
        stdv = 1.0 / math.sqrt(self.W.out_features)
        for lin in (self.W, self.Omega_1, self.Omega_2):
            if lin is not None and isinstance(lin._parameters.get("weight"), torch.Tensor):
                nn.init.uniform_(lin.weight, -stdv, stdv)

    def injection(self, x: torch.Tensor, operator: torch.Tensor) -> torch.Tensor:
        """Â X Ω₁ᵀ (+ X Ω₂ᵀ): computed once per forward, outside the solve."""
        b = operator @ self.Omega_1(x)
        if self.Omega_2 is not None:
            b = b + self.Omega_2(x)
        return b

    def has_norm(self) -> bool:
        return "weight" not in self.W._parameters


@dataclass
class IGNNModelOutput(BaseModelOutputWithNoAttention, DEQModelOutput):
    """Node states at equilibrium (of the last implicit layer) and the forward solve's statistics.

    Attributes:
        last_hidden_state: (num_nodes, hidden_size).
        hidden_states: per implicit layer, when asked for with ``output_hidden_states=True``.
        all_deq_stats: the solve statistics of every implicit layer (``deq_stats`` is the last one's).
        graph: the :class:`IGNNGraph` used, reusable as ``graph=`` in the next call.
    """

    all_deq_stats: tuple[SolverStats, ...] | None = None
    graph: IGNNGraph | None = None
    deq_stats: SolverStats | None = None


@dataclass
class IGNNNodeClassifierOutput(DEQModelOutput):
    """Per-node logits (num_nodes, num_labels), optional loss over labelled nodes (-100 = unlabelled)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    all_deq_stats: tuple[SolverStats, ...] | None = None
    graph: IGNNGraph | None = None
    deq_stats: SolverStats | None = None


@dataclass
class IGNNGraphClassifierOutput(DEQModelOutput):
    """Per-graph logits (num_graphs, num_labels) and optional loss."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    pooled_output: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    all_deq_stats: tuple[SolverStats, ...] | None = None
    graph: IGNNGraph | None = None
    deq_stats: SolverStats | None = None


class IGNNPreTrainedModel(DEQPreTrainedModel):
    """Weights I/O for IGNN models (config class, init, prefix)."""

    config_class = IGNNConfig
    base_model_prefix = "ignn"
    main_input_name = "x"

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, IGNNImplicitLayer):
            module.reset_parameters()
        elif isinstance(module, nn.Linear) and "weight" in module._parameters:
            module.reset_parameters()


class IGNNModel(IGNNPreTrainedModel):
    """Stacked implicit graph layers; returns node states at equilibrium.

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNModel
        >>> model = IGNNModel(IGNNConfig(in_features=3, hidden_size=8)).eval()
        >>> x = torch.randn(4, 3); edge_index = torch.tensor([[0, 1, 2], [1, 2, 3]])
        >>> out = model(x, edge_index)
        >>> out.last_hidden_state.shape, bool(out.deq_stats.converged.all())
        (torch.Size([4, 8]), True)
    """

    def __init__(self, config: IGNNConfig):
        super().__init__(config)
        with_linear = config.injection == "adjacency+linear"
        self.layers = nn.ModuleList(
            IGNNImplicitLayer(config.in_features if i == 0 else config.hidden_size, config.hidden_size,
                              with_linear)
            for i in range(config.num_layers)
        )
        if config.norm_type != "none":
            apply_norm(self.layers, config.norm_type, learn_scale=True, clip=config.norm_clip,
                       clip_value=config.norm_clip_value)
        self.deq = DEQ(config.deq_config)
        self.post_init()

    # -- inputs -------------------------------------------------------------------------------------------
    def prepare_graph(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None,
                      edge_weight: torch.Tensor | None = None, batch: torch.Tensor | None = None,
                      adjacency: torch.Tensor | None = None, num_nodes: int | None = None) -> IGNNGraph:
        """Validate a graph and build its normalized operator (PyG-style or sparse-adjacency input).

        Example:
            >>> import torch
            >>> from deqzoo.models.ignn import IGNNConfig, IGNNModel
            >>> model = IGNNModel(IGNNConfig(in_features=2))
            >>> g = model.prepare_graph(torch.zeros(3, 2), torch.tensor([[0], [2]]))
            >>> g.num_nodes, g.operator.layout
            (3, torch.sparse_csr)
        """
        if num_nodes is None:
            if x is None:
                raise ValueError("prepare_graph needs x (node features) or num_nodes")
            num_nodes = x.shape[0]
        if num_nodes == 0:
            raise ValueError(
                "empty graph: x has 0 nodes (shape (0, in_features)); IGNN needs at least one node"
            )
        if num_nodes > MAX_GRAPH_NODES:
            raise ValueError(f"graph has {num_nodes:,} nodes, above the limit of {MAX_GRAPH_NODES:,} "
                             "(MAX_GRAPH_NODES)")
        if edge_index is not None and getattr(edge_index, "dim", lambda: 0)() == 2 and (
                edge_index.shape[-1] > MAX_GRAPH_EDGES):
            raise ValueError(f"graph has {edge_index.shape[-1]:,} edges, above the limit of "
                             f"{MAX_GRAPH_EDGES:,} (MAX_GRAPH_EDGES)")
        dtype = x.dtype if x is not None and x.dtype.is_floating_point else self.dtype
        if adjacency is not None:
            if edge_index is not None:
                raise ValueError("pass either edge_index (PyG style) or adjacency (torch sparse), not both")
            edge_index, edge_weight = _adjacency_to_edges(adjacency, num_nodes)
        elif edge_index is None:
            raise ValueError("a graph needs edge_index of shape (2, num_edges) or a sparse adjacency")
        operator = augmented_normalized_adjacency(edge_index, num_nodes, edge_weight, dtype=dtype)
        num_graphs = 1
        if batch is not None:
            if batch.dim() != 1 or batch.shape[0] != num_nodes:
                raise ValueError(
                    f"batch must have shape ({num_nodes},) (one graph index per node), "
                    f"got {tuple(batch.shape)}"
                )
            if int(batch.min()) < 0:
                raise ValueError(f"batch holds a negative graph index ({int(batch.min())})")
            num_graphs = int(batch.max()) + 1
        nonneg = edge_weight is None or bool((edge_weight >= 0).all())
        return IGNNGraph(operator=operator, num_nodes=num_nodes, batch=batch, num_graphs=num_graphs,
                         nonnegative=nonneg)

    def _resolve(self, x, edge_index, edge_weight, batch, adjacency, data, graph):
        if data is None and x is not None and hasattr(x, "edge_index") and hasattr(x, "x"):
            data, x = x, None  # a PyG Data/Batch passed positionally
        if data is not None:
            x = data.x if x is None else x
            edge_index = data.edge_index if edge_index is None else edge_index
            if edge_weight is None:
                edge_weight = getattr(data, "edge_weight", None)
            if batch is None:
                batch = getattr(data, "batch", None)
        if x is None:
            raise ValueError("IGNN needs node features x of shape (num_nodes, in_features)")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(
                f"x must be a tensor of shape (num_nodes, in_features={self.config.in_features}), "
                f"got {getattr(x, 'shape', type(x))}"
            )
        if x.shape[1] != self.config.in_features:
            raise ValueError(
                f"x has {x.shape[1]} features per node but the model expects "
                f"in_features={self.config.in_features} (x shape {tuple(x.shape)})"
            )
        if graph is None:
            graph = self.prepare_graph(x, edge_index, edge_weight, batch, adjacency)
        elif graph.num_nodes != x.shape[0]:
            raise ValueError(f"graph has {graph.num_nodes} nodes but x has {x.shape[0]} rows")
        if graph.operator.dtype != x.dtype:
            graph.operator = graph.operator.to(x.dtype)
        return x, graph

    # -- well-posedness -------------------------------------------------------------------------------------
    def projection_radius(self, graph: IGNNGraph) -> float | None:
        """κ / λ_pf(|Â|), the bound on ||W||∞ (None when the projection is off)."""
        if not self.config.kappa:
            return None
        rho = self.config.spectral_radius or graph.spectral_radius(
            self.config.pf_tol, self.config.pf_max_iter
        )
        return self.config.kappa / rho

    @torch.no_grad()
    def project_weights(self, graph: IGNNGraph | None = None, radius: float | None = None) -> None:
        """Project every un-normalized W onto ||W||∞ <= κ/λ_pf in place (the original, per forward).

        The forward calls it; call it yourself after an optimizer step to keep stored weights feasible.
        """
        if radius is None:
            if graph is None:
                raise ValueError("project_weights needs the graph (for λ_pf) or an explicit radius")
            radius = self.projection_radius(graph)
        if radius is None:
            return
        for layer in self.layers:
            if not layer.has_norm():
                layer.W.weight.copy_(project_rows_l1(layer.W.weight, radius))

    def _effective_w(self, layer: IGNNImplicitLayer, radius: float | None, projected: bool = False
                     ) -> torch.Tensor:
        w = layer.W.weight
        if radius is not None and not layer.has_norm() and not projected:
            return project_rows_l1(w, radius)  # inference: the projected value, the stored W untouched
        if radius is not None and layer.has_norm():
            # normalized W: project its value, let gradients pass as if unprojected (as TorchDEQ does)
            w = w + (project_rows_l1(w.detach(), radius) - w.detach())
        return w

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None,
                edge_weight: torch.Tensor | None = None, batch: torch.Tensor | None = None, *,
                adjacency: torch.Tensor | None = None, data=None, graph: IGNNGraph | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **_
    ) -> IGNNModelOutput | tuple:
        x, graph = self._resolve(x, edge_index, edge_weight, batch, adjacency, data, graph)
        if self.config.norm_type != "none":
            reset_norm(self.layers)  # normalized weights once per forward, reused by every f call
        radius = self.projection_radius(graph)
        # kappa unset (None or 0): no projection, nothing reads the weights' values. Training projects the
        # stored W in place, as the original does per forward (the optimizer steps from a feasible W);
        # inference projects a copy (_effective_w), so concurrent calls on graphs with different λ_pf never
        # change the weights another thread is solving with
        in_place = radius is not None and self.training and torch.is_grad_enabled()
        if in_place:
            self.project_weights(radius=radius)
        phi = _ACTIVATIONS[self.config.activation]
        op = graph.operator
        z, hidden, stats_all = x, [], []
        for layer in self.layers:
            w = self._effective_w(layer, radius, projected=in_place)
            b = layer.injection(z, op)

            def f(s: torch.Tensor, w=w, b=b) -> torch.Tensor:
                return phi(op @ (s[0] @ w.t()) + b).unsqueeze(0)

            s, stats = self.deq(f, b.new_zeros(1, *b.shape))  # the original starts from zeros
            z = s[0]
            hidden.append(z)
            stats_all.append(stats)
        out = IGNNModelOutput(
            deq_stats=stats_all[-1],
            last_hidden_state=z,
            hidden_states=tuple(hidden) if self._flag(output_hidden_states, "output_hidden_states") else None,
            all_deq_stats=tuple(stats_all),
            graph=graph,
        )
        return self._output(out, return_dict)

    def get_input_embeddings(self) -> nn.Module:
        """The first implicit layer's Ω₁ (the map of node features into the state's injection)."""
        return self.layers[0].Omega_1


def _check_sparse_structure(adjacency: torch.Tensor, n: int) -> None:
    """Validate a sparse adjacency's index arrays before torch converts it (torch's CSR -> COO conversion
    trusts them: invalid row pointers or column indices crash the interpreter), with torch's own invariant
    checks (rebuilding the tensor over the same arrays copies nothing)."""
    csr = adjacency.layout == torch.sparse_csr
    # an uncoalesced COO tensor's arrays: `indices()` refuses one, and coalescing first would merge an
    # out-of-range entry into a valid one; torch's sparse docs name `_indices()`/`_values()` for this
    indices, values = (adjacency.col_indices(), adjacency.values()) if csr else (adjacency._indices(),
                                                                                 adjacency._values())
    if values.dim() != 1:
        raise ValueError("adjacency values must be scalars (a 2-D sparse matrix with 1-D values)")
    if indices.shape[-1] > MAX_GRAPH_EDGES:
        raise ValueError(f"adjacency has {indices.shape[-1]:,} edges, above the limit of {MAX_GRAPH_EDGES:,} "
                         "(MAX_GRAPH_EDGES)")
    try:
        if csr:
            torch.sparse_csr_tensor(adjacency.crow_indices(), indices, values, (n, n), check_invariants=True)
        else:
            torch.sparse_coo_tensor(indices, values, (n, n), check_invariants=True)
    except RuntimeError as err:
        raise ValueError(f"adjacency ({'CSR' if csr else 'COO'}, a graph of {n} nodes, valid indices "
                         f"0..{n - 1}) is not a valid sparse matrix: {err}") from err


def _adjacency_to_edges(adjacency: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(adjacency, torch.Tensor) or adjacency.layout not in (
        torch.sparse_coo,
        torch.sparse_csr,
    ):
        layout = getattr(adjacency, "layout", type(adjacency))
        raise TypeError(
            f"adjacency must be a torch sparse (COO or CSR) tensor, got {layout}; "
            "for a dense matrix use adjacency.to_sparse()"
        )
    if adjacency.dim() != 2 or adjacency.shape[0] != adjacency.shape[1]:
        raise ValueError(f"adjacency must be square (num_nodes, num_nodes), got {tuple(adjacency.shape)}")
    if adjacency.shape[0] != num_nodes:
        raise ValueError(f"adjacency is {tuple(adjacency.shape)} but x has {num_nodes} nodes")
    _check_sparse_structure(adjacency, num_nodes)
    coo = (
        adjacency.to_sparse_coo().coalesce() if adjacency.layout == torch.sparse_csr else adjacency.coalesce()
    )
    return coo.indices(), coo.values()


def _pool(z: torch.Tensor, batch: torch.Tensor | None, num_graphs: int, how: str) -> torch.Tensor:
    if batch is None:
        batch = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    out = z.new_zeros(num_graphs, z.shape[1])
    if how == "add":
        return out.index_add_(0, batch, z)
    # per graph's nodes ("max" / "mean"); a graph index without nodes keeps its zeros
    return out.index_reduce_(0, batch, z, "amax" if how == "max" else "mean", include_self=False)


def _label_loss(logits: torch.Tensor, labels: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """The heads' cross-entropy, one label per node or graph (-100 skipped, cross_entropy's default)."""
    if labels is not None and labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must have shape ({logits.shape[0]},) (one per {what}, -100 to skip), got "
                         f"{tuple(labels.shape)}")
    return None if labels is None else F.cross_entropy(logits, labels)


class IGNNForNodeClassification(IGNNPreTrainedModel):
    """IGNN with the original node classifier: L2-normalized states -> dropout -> Linear (no bias).

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification
        >>> model = IGNNForNodeClassification(IGNNConfig(in_features=3, hidden_size=8, num_labels=2)).eval()
        >>> out = model(torch.randn(5, 3), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]),
        ...             labels=torch.tensor([0, 1, -100, -100, 0]))
        >>> out.logits.shape, out.loss.dim()
        (torch.Size([5, 2]), 0)
    """

    def __init__(self, config: IGNNConfig):
        super().__init__(config)
        self.ignn = IGNNModel(config)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None,
                edge_weight: torch.Tensor | None = None, batch: torch.Tensor | None = None, *,
                adjacency: torch.Tensor | None = None, data=None, graph: IGNNGraph | None = None,
                labels: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **_) -> IGNNNodeClassifierOutput | tuple:
        out = self.ignn(x, edge_index, edge_weight, batch, adjacency=adjacency, data=data, graph=graph,
                        output_hidden_states=self._flag(output_hidden_states, "output_hidden_states"),
                        return_dict=True)
        z = out.last_hidden_state
        if self.config.normalize_states:
            z = F.normalize(z, dim=-1)
        logits = self.classifier(self.dropout(z))
        loss = _label_loss(logits, labels, "node")
        # the backbone's fields (states, stats, graph) carried over as they are
        return self._output(IGNNNodeClassifierOutput(loss=loss, logits=logits, **out), return_dict)


class IGNNForGraphClassification(IGNNPreTrainedModel):
    """IGNN with the original graph classifier: pool node states per graph -> Linear -> ReLU -> dropout ->
    Linear. A batch of graphs (``batch`` vector) is one block-diagonal system, solved jointly.

    Example:
        >>> import torch
        >>> from deqzoo.models.ignn import IGNNConfig, IGNNForGraphClassification
        >>> cfg = IGNNConfig(in_features=3, hidden_size=8, num_labels=2, num_layers=2, graph_head_hidden=8)
        >>> model = IGNNForGraphClassification(cfg).eval()
        >>> edges, batch = torch.tensor([[0, 1, 3], [1, 2, 4]]), torch.tensor([0, 0, 0, 1, 1])
        >>> out = model(torch.randn(5, 3), edges, batch=batch)
        >>> out.logits.shape
        torch.Size([2, 2])
    """

    def __init__(self, config: IGNNConfig):
        super().__init__(config)
        self.ignn = IGNNModel(config)
        hidden = config.graph_head_hidden or config.hidden_size
        self.pre_classifier = nn.Linear(config.hidden_size, hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(hidden, config.num_labels)
        self.post_init()

    def forward(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None,
                edge_weight: torch.Tensor | None = None, batch: torch.Tensor | None = None, *,
                adjacency: torch.Tensor | None = None, data=None, graph: IGNNGraph | None = None,
                labels: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **_) -> IGNNGraphClassifierOutput | tuple:
        out = self.ignn(x, edge_index, edge_weight, batch, adjacency=adjacency, data=data, graph=graph,
                        output_hidden_states=self._flag(output_hidden_states, "output_hidden_states"),
                        return_dict=True)
        g = out.graph
        pooled = _pool(out.last_hidden_state, g.batch, g.num_graphs, self.config.graph_pooling)
        logits = self.classifier(self.dropout(F.relu(self.pre_classifier(pooled))))
        loss = _label_loss(logits, labels, "graph")
        output = IGNNGraphClassifierOutput(loss=loss, logits=logits, pooled_output=pooled, **out)
        return self._output(output, return_dict)


def prepare_export(model: IGNNPreTrainedModel, graph: IGNNGraph | None = None
                   ) -> Callable[[torch.Tensor], IGNNGraph]:
    """deqzoo.export's preparation of a fixed-iteration copy (the family's declaration names it): apply the
    weight projection for `graph` once, then turn the per-forward projection off (it takes decisions on
    tensor values: power iteration for λ_pf, a branch on which rows exceed the radius). Returns the map from
    the dense operator Â an exported program takes to the model's ``graph`` argument."""
    config = model.config
    if config.kappa:
        if graph is None and not config.spectral_radius:
            raise ValueError("IGNN with kappa set projects W for the graph's λ_pf(|Â|): pass the graph "
                             "(exportable(model, graph=model.ignn.prepare_graph(x, edge_index))) or set "
                             "config.spectral_radius")
        radius = None if graph is not None else config.kappa / config.spectral_radius  # None: the graph's
        model.base_model.project_weights(graph, radius)
    for module in model.modules():
        if isinstance(module, IGNNPreTrainedModel):
            module.config.kappa = None
            module.config.norm_type = "none"  # the norms were folded into W (remove_norm)
    return lambda operator: IGNNGraph(operator=operator, num_nodes=operator.shape[0])
