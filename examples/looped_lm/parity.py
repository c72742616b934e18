"""Measure what LoopedLM reproduces and reports on randomly initialised tiny looped LMs.

Prints, for transformers' HRM-Text and the test suite's Huginn-style fixture: the largest absolute logit
difference between the stock model and `LoopedLM.own_loop` (float32 and float64), whether greedy
``generate()`` agrees token for token, and per-token NFE / convergence / residual ratio for the plain loop
run longer (``fixed_point``) and for Anderson, plus a drifting configuration (weights scaled up).

    python examples/looped_lm/parity.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "integrations"


def hrm(dtype, H=3, L=2, init=0.02, seed=0):
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(seed)
    cfg = HrmTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, head_dim=8, H_cycles=H, L_cycles=L,
                        initializer_range=init)  # fmt: skip
    return HrmTextForCausalLM(cfg).to(dtype).eval()


def huginn(dtype, steps=4, scale=1.0, seed=0):
    sys.path.insert(0, str(FIXTURE))
    from huginn_fixture import TinyHuginnConfig, TinyHuginnForCausalLM

    torch.manual_seed(seed)
    m = TinyHuginnForCausalLM(TinyHuginnConfig(mean_recurrence=steps)).to(dtype).eval()
    with torch.no_grad():
        for mod in [m.adapter, *m.core_block.modules()]:
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(scale)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    from deqzoo.integrations.looped_lm import LoopedLM

    x = torch.randint(0, 64, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    for name, make, drift in [
        ("HRM-Text (H_cycles=3, L_cycles=2)", hrm, lambda d: hrm(d, init=1.0)),
        ("Huginn-style fixture (4 steps)", huginn, lambda d: huginn(d, scale=20.0)),
    ]:
        print(f"== {name}")
        for dtype in (torch.float32, torch.float64):
            model = make(dtype)
            with torch.no_grad():
                diff = (LoopedLM.own_loop(model)(x).logits - model(x).logits).abs().max().item()
            print(f"  own loop vs stock, {str(dtype)[6:]}: max |logit diff| = {diff:.2e}")
        model = make(torch.float32)
        ref = model.generate(x[:, :6], max_new_tokens=12, do_sample=False, pad_token_id=0)
        got = LoopedLM.own_loop(model).generate(x[:, :6], max_new_tokens=12, do_sample=False, pad_token_id=0)
        print(f"  greedy generate, 12 new tokens x {args.batch}: identical = {torch.equal(ref, got)}")
        for label, m, solver, kw in [
            ("plain loop, longer", model, "fixed_point", {}),
            ("anderson m=10", model, "anderson", {"m": 10}),
            ("drifting (weights scaled up), plain loop", drift(torch.float32), "fixed_point", {}),
        ]:
            with torch.no_grad():
                out = LoopedLM.from_model(m, solver=solver, max_iter=100, tol=1e-4, solver_kwargs=kw)(x)
            conv, nfe = out.converged, out.nfe.double()
            print(f"  {label}: tol 1e-4, max_iter 100: converged {int(conv.sum())}/{conv.numel()} tokens, "
                  f"NFE mean {nfe.mean():.1f} (min {int(nfe.min())}, max {int(nfe.max())}), "
                  f"median residual ratio {out.residual_ratio.nanmedian():.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
