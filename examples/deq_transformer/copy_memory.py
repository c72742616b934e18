"""Copy-memory task (Bai et al. 2018/2019; DEQ thesis Table 2.1) with a small DEQ-Transformer.

Each input is 10 symbols drawn from {1..8}, then T blanks (0), a delimiter (9) and 10 more blanks; the target
is
blanks everywhere except the last 10 positions, which must repeat the first 10 symbols. A model that cannot
remember predicts the symbols at chance: its cross-entropy is 10 ln 8 / (T + 20) per position (printed as the
memoryless baseline). The whole sequence is one segment (no cross-segment memory is needed).

    python examples/deq_transformer/copy_memory.py --T 30 --steps 400
    python examples/deq_transformer/copy_memory.py --T 30 --steps 400 --explicit   # untied 2 blocks (71k vs
    50k params)
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM


def copy_batch(batch: int, t_blank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, t_blank + 20)."""
    symbols = torch.randint(1, 9, (batch, 10), generator=generator)
    x = torch.zeros(batch, t_blank + 20, dtype=torch.long)
    x[:, :10] = symbols
    x[:, t_blank + 10] = 9
    y = torch.zeros_like(x)
    y[:, -10:] = symbols
    return x, y


def evaluate(model, t_blank: int, n: int = 256, seed: int = 1234) -> dict[str, float]:
    x, y = copy_batch(n, t_blank, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(x, use_cache=False)
    logits = out.logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    acc = (logits[:, -10:].argmax(-1) == y[:, -10:]).float().mean()
    return {"loss": round(float(loss), 4), "copy_accuracy": round(float(acc), 4),
            "nfe": int(out.deq_stats.nfe)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=30, help="number of blanks between symbols and delimiter")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--explicit", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    common = dict(vocab_size=10, d_model=64, n_head=4, d_head=16, tgt_len=args.T + 20, mem_len=0)
    deq = {"f_solver": "anderson", "f_max_iter": 16, "f_tol": 1e-3, "b_mode": "ift", "b_max_iter": 12}
    config = (DEQTransformerConfig(**common, d_inner=64, explicit_layers=2, deq=deq) if args.explicit
              else DEQTransformerConfig(**common, d_inner=128, deq=deq))
    model = DEQTransformerForCausalLM(config)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc="copy-memory " + ("explicit" if args.explicit else "deq"))
    for _ in bar:
        model.train()
        x, y = copy_batch(args.batch, args.T, gen)
        out = model(x, use_cache=False)
        loss = F.cross_entropy(out.logits.reshape(-1, 10), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{float(loss):.4f}", nfe=int(out.deq_stats.nfe))
    model.eval()
    result = {"T": args.T, "model": "explicit" if args.explicit else "deq", "steps": args.steps,
              "params": sum(t.numel() for t in model.parameters()),
              "memoryless_loss": round(10 * math.log(8) / (args.T + 20), 4), **evaluate(model, args.T)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
