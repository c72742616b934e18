"""Chains dataset against the original loader's split; the embedded checkpoint against its card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.ignn.chains import make_chains

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
CARD = ROOT / "model_cards" / "ignn-chains"


def test_chains_match_original_loader():
    ref = json.loads((ROOT / "conversion/fixtures/ignn/swiftieh_chains10_split.json").read_text())
    ds = make_chains(chain_length=10)
    assert ds.train_idx.tolist() == ref["idx_train"]
    assert ds.val_idx.tolist() == ref["idx_val"]
    assert ds.test_idx.tolist() == ref["idx_test"]
    assert ds.labels.tolist() == ref["labels"]
    assert ds.x.abs().sum(1).nonzero().flatten().tolist() == ref["nonzero_feature_rows"]
    assert ds.edge_index.shape[1] + ds.num_nodes == ref["adj_nnz"]  # edges + the self-loops added


def test_chains_structure():
    ds = make_chains(chain_length=7, chains_per_class=3, num_train=5, num_val=5, num_test=10, seed=1)
    chains = ds.labels.view(-1, 7)
    assert (chains == chains[:, :1]).all()  # one class per chain
    first = ds.x.view(-1, 7, ds.x.shape[1])
    assert first[:, 1:].abs().sum() == 0 and (first[:, 0, :2].argmax(-1) == chains[:, 0]).all()
    src, dst = ds.edge_index
    assert ((dst - src) == 1).all() and (src % 7 != 6).all()
    splits = torch.cat([ds.train_idx, ds.val_idx, ds.test_idx])
    assert splits.unique().numel() == 20
    with pytest.raises(ValueError, match="exceed"):
        make_chains(chain_length=2, chains_per_class=1, num_train=20)


def test_tiny_training_learns_chains():
    import sys

    sys.path.insert(0, str(ROOT / "examples" / "ignn"))
    import train_chains

    args = train_chains.parse_args(["--lengths", "10", "--epochs", "30", "--no-progress"])
    ds = make_chains(chain_length=10)
    model, metrics = train_chains.train_ignn(ds, args, 10)
    gcn = train_chains.train_gcn(ds, args, 10)
    assert metrics["accuracy"] >= 0.95 and metrics["nfe"] == 50  # 10 + 40 fixed-point steps
    assert gcn["accuracy"] < 0.8  # two hops cannot see the first node of a 10-node chain


@pytest.mark.skipif(not CARD.is_dir(), reason="embedded checkpoint not built yet")
def test_checkpoint_matches_card():
    from deqzoo.hub.cards import card_metrics, read_model_card
    from deqzoo.models.ignn import IGNNForNodeClassification
    from examples.ignn.chains import demo, evaluate

    model = IGNNForNodeClassification.from_pretrained(CARD)
    metrics = evaluate(model, progress=False)
    meta, body = read_model_card(CARD)
    card = card_metrics(meta)
    assert metrics["accuracy"] == card["accuracy"] >= 0.95
    assert metrics["nfe"] == card["nfe"]
    assert model.config.task_specific_params["chains"]["chain_length"] >= 30
    line, stats = demo(model)
    assert "accuracy" in line and stats.nfe > 0
    assert "| 100 |" in body and "GCN" in body  # the whole curve is in the card
