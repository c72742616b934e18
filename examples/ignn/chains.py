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
    >>> from examples.ignn.chains import make_chains
    >>> ds = make_chains(chain_length=10)
    >>> ds.x.shape, ds.edge_index.shape, len(ds.train_idx), len(ds.test_idx)
    (torch.Size([400, 100]), torch.Size([2, 360]), 20, 200)
"""

from __future__ import annotations

import torch

from deqzoo.core import SolverStats
from deqzoo.predict import ChainsDataset, chains_settings, make_chains, node_classifier
from examples.demo import DemoSummary

__all__ = ["ChainsDataset", "chains_settings", "demo", "evaluate", "make_chains"]


@torch.no_grad()
def _run(model, ds: ChainsDataset):
    model = node_classifier(model)
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


