"""Two-layer GCN (Kipf & Welling) baseline for the chains example, on the same normalized operator as IGNN.

Its receptive field is two hops, so on chains it can only label nodes within two hops of a chain's first
node; the rest is a guess. Not part of the package: a baseline lives with its experiment.

Run alone, it trains the baseline on one chain length with train_chains.py's recipe and prints its accuracy:

    python examples/ignn/gcn_baseline.py --length 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class GCN(nn.Module):
    """logits = Â · dropout(ReLU(Â X W₁ + b₁)) W₂ + b₂ with the sparse operator Â (rows = targets)."""

    def __init__(self, in_features: int, hidden: int, num_classes: int, dropout: float = 0.5):
        super().__init__()
        self.lin1 = nn.Linear(in_features, hidden)
        self.lin2 = nn.Linear(hidden, num_classes)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, operator: torch.Tensor) -> torch.Tensor:
        h = F.relu(operator @ self.lin1(F.dropout(x, self.dropout, self.training)))
        h = F.dropout(h, self.dropout, self.training)
        return operator @ self.lin2(h)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=10, help="chain length")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="parameter init seed")
    p.add_argument("--data-seed", type=int, default=42, help="dataset seed (42 = the original's)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_chains import parse_args, train_gcn

    from examples.ignn.chains import make_chains

    recipe = parse_args(["--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress"])
    ds = make_chains(chain_length=args.length, seed=args.data_seed)
    print(json.dumps({"length": args.length, **train_gcn(ds, recipe, args.length)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
