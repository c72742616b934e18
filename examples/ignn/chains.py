"""The synthetic chains task of IGNN (Gu et al. 2020): long-range dependencies on directed chains.

`num_classes * chains_per_class` directed chains of `chain_length` nodes (edges i -> i+1). Every node of a
chain carries the chain's class as its label, but only the first node of each chain has a non-zero feature
(a one-hot of the class in its first `num_classes` coordinates); the other features are zero (plus optional
uniform noise). A model must carry the information `chain_length - 1` hops down the chain to label every node.
Splits are random node subsets (20 train, 100 validation, 200 test by default), drawn exactly as the original
loader does (``numpy.random.RandomState(seed)``: noise first, then a shuffle of the node indices), so the
dataset and split for a given length equal the original's.

Used by ``deqzoo eval|demo|predict deqzoo/ignn-chains``; the chain length is read from the checkpoint
(``config.task_specific_params["chains"]``).

Example:
    >>> from deqzoo.tasks.chains import make_chains
    >>> ds = make_chains(chain_length=10)
    >>> ds.x.shape, ds.edge_index.shape, len(ds.train_idx), len(ds.test_idx)
    (torch.Size([400, 100]), torch.Size([2, 360]), 20, 200)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core import SolverStats
from ._demo import DemoSummary

__all__ = ["ChainsDataset", "chains_settings", "demo", "evaluate", "make_chains", "predict"]


@dataclass
class ChainsDataset:
    """A chains graph: features (N, F), edges (2, E) source->target, labels (N,), and index splits."""

    x: torch.Tensor
    edge_index: torch.Tensor
    labels: torch.Tensor
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int
    chains_per_class: int
    chain_length: int

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]

    def adjacency(self) -> torch.Tensor:
        """The same graph as a torch sparse COO adjacency (A[i, j] = 1 for the edge i -> j)."""
        n = self.num_nodes
        return torch.sparse_coo_tensor(
            self.edge_index, torch.ones(self.edge_index.shape[1]), (n, n)
        ).coalesce()


def make_chains(
    chain_length: int = 10,
    *,
    num_classes: int = 2,
    chains_per_class: int = 20,
    feature_dim: int = 100,
    num_train: int = 20,
    num_val: int = 100,
    num_test: int = 200,
    noise: float = 0.0,
    seed: int = 42,
) -> ChainsDataset:
    """Build the chains dataset (deterministic in `seed`; defaults are the original's).

    Node index of (class c, chain k, position p) is ``(c * chains_per_class + k) * chain_length + p``.
    Features are row-normalized as the original's preprocessing does (rows summing to zero stay zero).

    Example:
        >>> ds = make_chains(chain_length=5, chains_per_class=2, num_train=4, num_val=2, num_test=4)
        >>> ds.labels.tolist()[:10], ds.x[0, :2].tolist(), ds.x[1].abs().sum().item()
        ([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1.0, 0.0], 0.0)
    """
    if chain_length < 2:
        raise ValueError(f"chain_length must be >= 2, got {chain_length}")
    if num_classes > feature_dim:
        raise ValueError(f"feature_dim ({feature_dim}) must be >= num_classes ({num_classes})")
    n_nodes = num_classes * chains_per_class * chain_length
    if num_train + num_val + num_test > n_nodes:
        raise ValueError(f"splits ({num_train}+{num_val}+{num_test}) exceed the {n_nodes} nodes")
    rng = np.random.RandomState(seed)
    feats = rng.uniform(-noise, noise, size=(num_classes, chains_per_class, chain_length, feature_dim))
    feats[:, :, 0, :num_classes] += np.eye(num_classes).reshape(num_classes, 1, num_classes)
    feats = feats.reshape(-1, feature_dim)
    row_sum = feats.sum(1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(row_sum != 0, 1.0 / row_sum, 0.0)
    feats = feats * inv
    labels = np.repeat(np.arange(num_classes), chains_per_class * chain_length)
    order = np.arange(n_nodes)
    rng.shuffle(order)
    starts = np.arange(num_classes * chains_per_class)[:, None] * chain_length
    src = (starts + np.arange(chain_length - 1)[None, :]).reshape(-1)
    edge_index = torch.from_numpy(np.stack([src, src + 1])).long()
    return ChainsDataset(
        x=torch.from_numpy(feats).float(),
        edge_index=edge_index,
        labels=torch.from_numpy(labels).long(),
        train_idx=torch.from_numpy(order[:num_train]).long(),
        val_idx=torch.from_numpy(order[num_train : num_train + num_val]).long(),
        test_idx=torch.from_numpy(order[num_train + num_val : num_train + num_val + num_test]).long(),
        num_classes=num_classes,
        chains_per_class=chains_per_class,
        chain_length=chain_length,
    )


def chains_settings(model) -> dict[str, Any]:
    """The dataset settings a checkpoint was trained on (``config.task_specific_params["chains"]``)."""
    params = (getattr(model.config, "task_specific_params", None) or {}).get("chains")
    if not params or "chain_length" not in params:
        raise ValueError(
            "this model's config has no task_specific_params['chains']['chain_length']; "
            "it was not trained on the chains task (see examples/ignn/train_chains.py)"
        )
    return dict(params)


def _node_classifier(model):
    """The node-classification head; a bare IGNNModel cannot classify nodes."""
    if not hasattr(model, "classifier"):
        raise ValueError(f"{type(model).__name__} has no node classifier; load a node-classification "
                         "checkpoint (deqzoo.from_pretrained picks the head from config.architectures)")
    return model


@torch.no_grad()
def _run(model, ds: ChainsDataset):
    model = _node_classifier(model)
    model.eval()
    out = model(ds.x, ds.edge_index)
    return out.logits.argmax(-1), out.deq_stats


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """Held-out (test split) node accuracy at the checkpoint's chain length, and the forward solve's NFE.

    The whole graph is solved (one equilibrium); `limit` scores only the first `limit` test nodes.

    Example:
        >>> import deqzoo  # doctest: +SKIP
        >>> evaluate(deqzoo.from_pretrained("deqzoo/ignn-chains"))  # doctest: +SKIP
        {'accuracy': ..., 'nfe': ...}
    """
    settings = chains_settings(model)
    ds = make_chains(**settings)
    idx = ds.test_idx if limit is None else ds.test_idx[:limit]
    pred, stats = _run(model, ds)
    acc = (pred[idx] == ds.labels[idx]).float().mean().item()
    return {"accuracy": round(acc, 4), "nfe": round(float(stats.nfe), 4)}


def demo(model) -> tuple[str, SolverStats]:
    """Classify every node of the checkpoint's chains graph; one-line summary and the solve's stats."""
    settings = chains_settings(model)
    ds = make_chains(**settings)
    pred, stats = _run(model, ds)
    correct = pred == ds.labels
    per_pos = correct.view(-1, ds.chain_length).float().mean(0)
    last = per_pos[-1].item()
    line = (
        f"chains (length {ds.chain_length}, {ds.num_nodes} nodes): all-node accuracy "
        f"{correct.float().mean().item():.4f}, accuracy at the last chain position {last:.4f}; "
        f"solve: {stats.nfe} f-evals, final residual {stats.abs_residual.max().item():.2e}"
    )
    return DemoSummary(line, f"accuracy {correct.float().mean().item():.3f} (last {last:.3f})"), stats


# Documented limits of `deqzoo predict` for graphs: generated chain length, size of a graph JSON file.
MAX_CHAIN_LENGTH = 100_000
MAX_GRAPH_FILE_BYTES = 64 * 1024 * 1024


def predict(model, input: str) -> str:
    """Predict chain classes. INPUT is a chain length (e.g. ``"40"``: a fresh chains graph of that length,
    generated with the checkpoint's other settings) or a path to a JSON graph file
    ``{"x": [[...], ...], "edge_index": [[sources...], [targets...]]}`` (optional ``"edge_weight"``).

    Returns one line per chain (class per node, start -> end, and the mean probability of the predicted
    classes) for a length, or the predicted class and its probability per node for a file.
    """
    text = str(input).strip()
    if text.isdigit():
        if not 1 <= int(text) <= MAX_CHAIN_LENGTH:
            raise ValueError(f"chain length {text} is outside [1, {MAX_CHAIN_LENGTH:,}] (MAX_CHAIN_LENGTH)")
        settings = {**chains_settings(model), "chain_length": int(text)}
        ds = make_chains(**settings)
        with torch.no_grad():
            out = _node_classifier(model).eval()(ds.x, ds.edge_index)
        conf, pred = out.logits.softmax(-1).max(-1)
        stats = out.deq_stats
        lines = []
        for chain, (p, y, c) in enumerate(
            zip(pred.view(-1, ds.chain_length), ds.labels.view(-1, ds.chain_length),
                conf.view(-1, ds.chain_length))
        ):
            ok = (p == y).float().mean().item()
            lines.append(
                f"chain {chain:3d} (class {y[0].item()}): predicted {''.join(map(str, p.tolist()))} "
                f"({ok:.0%} correct, mean probability {c.mean().item():.4f})"
            )
        acc = (pred == ds.labels).float().mean().item()
        lines.append(f"all nodes: accuracy {acc:.4f}; {stats.nfe} f-evals")
        return "\n".join(lines)
    path = Path(text)
    if not path.is_file():
        raise ValueError(
            f"predict input {text!r} is neither a chain length (an integer) nor an existing JSON file"
        )
    from ..hub.validation import read_json

    graph = read_json(path, max_bytes=MAX_GRAPH_FILE_BYTES, max_depth=4)
    for key in ("x", "edge_index"):
        if key not in graph:
            raise ValueError(
                f"{path}: missing key {key!r}; expected {{'x': [[...]], 'edge_index': [[...], [...]]}}"
            )
    try:
        x = torch.tensor(graph["x"], dtype=torch.float32)
        edge_index = torch.tensor(graph["edge_index"], dtype=torch.long)
        weight = torch.tensor(graph["edge_weight"], dtype=torch.float32) if "edge_weight" in graph else None
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"{path}: 'x', 'edge_index' and 'edge_weight' must be numeric arrays "
                         f"(x: nodes x features, edge_index: 2 x edges) ({err})") from err
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"{path}: key 'edge_index' must be [[sources...], [targets...]], got shape "
                         f"{tuple(edge_index.shape)}")
    model = _node_classifier(model).eval()
    with torch.no_grad():
        out = model(x, edge_index, weight)
    probs = out.logits.softmax(-1).max(-1)
    pred = probs.indices.tolist()
    scores = [round(float(p), 4) for p in probs.values]
    return (f"{path.name}: {len(pred)} nodes, predicted classes {pred}, their probabilities {scores}; "
            f"{out.deq_stats.nfe} f-evals")
