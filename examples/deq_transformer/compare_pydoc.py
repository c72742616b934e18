"""Evaluate trained pydoc checkpoints side by side (held-out perplexity, mean NFE) plus the unigram baseline.

    python examples/deq_transformer/compare_pydoc.py model_cards/deq-transformer-tiny-pydoc /tmp/explicit-
    pydoc \\
        /tmp/deq-jr-pydoc --json /tmp/pydoc_compare.json

Each row is exactly what ``examples.deq_transformer.pydoc_lm.evaluate`` returns for that directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from deqzoo.models.deq_transformer import DEQTransformerForCausalLM

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_transformer import pydoc_lm


def unigram_perplexity(tokenizer) -> float:
    """Baseline: unigram model of the training tokens (add-one smoothing) on the same held-out predictions."""
    train = pydoc_lm.token_stream(tokenizer, "train")
    held = pydoc_lm.token_stream(tokenizer, "held_out")[1:]  # the tokens pydoc_lm.evaluate() predicts
    counts = torch.bincount(train, minlength=len(tokenizer)).double() + 1.0
    logp = (counts / counts.sum()).log()
    return round(math.exp(-float(logp[held].mean())), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="checkpoint directories (with their tokenizer)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    for d in args.dirs:
        model = DEQTransformerForCausalLM.from_pretrained(d).eval()
        rows[d] = {**pydoc_lm.evaluate(model, limit=args.limit),
                   "params": sum(t.numel() for t in model.parameters()),
                   "jac_reg_weight": model.config.jac_reg_weight,
                   "explicit_layers": model.config.explicit_layers, "variant": model.config.variant,
                   "pre_lnorm": model.config.pre_lnorm,
                   "b_mode": model.config.deq["b_mode"], "f_solver": model.config.deq["f_solver"],
                   "f_max_iter": model.config.deq["f_max_iter"]}
        tok = pydoc_lm.load_tokenizer(model)
    rows["unigram"] = {"perplexity": unigram_perplexity(tok)}
    print(f"{'model':50s} {'perplexity':>12s} {'mean_nfe':>9s}")
    for name, r in rows.items():
        print(f"{name:50s} {r['perplexity']:12.4f} {r.get('mean_nfe', float('nan')):9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
