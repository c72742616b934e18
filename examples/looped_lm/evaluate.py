"""Held-out loss against f calls per token for a trained HRM-Text, through `LoopedLM`.

One interleaved pass over consecutive windows of the held-out pydoc stream (the split of ``train.py``):
every window is run by every method in turn, so machine load falls on all of them alike. Methods: the
model's own loop (``fixed_point`` for ``H_cycles`` calls), the plain loop run longer, Anderson at a few
tolerances, and each solve's per-token halting. "f calls per token" is a token's ``nfe`` (the calls until
its residual fell below tol, the engine freezing it there); "without halting" counts, for every token, the
calls the whole window took (what a solve that stops only when all its tokens have converged spends).
Then greedy generation from a few held-out prompts, each generated token's Anderson solve started cold or
warm (from the previous token's fixed point): f calls per generated token.

    python examples/looped_lm/evaluate.py --model /work/runs/looped-lm/model --windows 32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def warm_start_in_generation(model, stream: torch.Tensor, prompts: int, new_tokens: int) -> dict:
    """Greedy generation from held-out prompts (32 tokens each) with Anderson, each generated token's solve
    started cold or from the previous token's fixed point: f calls per generated token, and whether the
    two generate the same tokens."""
    from deqzoo.integrations.looped_lm import LoopedLM

    H = model.config.H_cycles
    out = {}
    texts = {}
    for mode in ("cold", "warm"):
        looped = LoopedLM.from_model(model, solver="anderson", max_iter=4 * H, tol=3e-2,
                                     solver_kwargs={"m": 5}, warm_start=mode == "warm",
                                     log_stats=True)  # fmt: skip
        seqs = []
        for i in range(prompts):
            prompt = stream[i * 256 : i * 256 + 32][None]
            seqs.append(looped.generate(prompt, max_new_tokens=new_tokens, do_sample=False))
        decode = [s["nfe"].double().mean() for s in looped.stats_log if s["nfe"].shape[1] == 1]
        out[f"{mode}_f_calls_per_token"] = float(torch.stack(decode).mean())
        texts[mode] = seqs
    out["same_tokens"] = all(torch.equal(a, b) for a, b in zip(texts["cold"], texts["warm"]))
    print(f"generation, anderson tol 0.03: f calls per generated token cold "
          f"{out['cold_f_calls_per_token']:.2f}, warm {out['warm_f_calls_per_token']:.2f}, "
          f"same tokens {out['same_tokens']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/work/runs/looped-lm/model"))
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the results (default: print)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts for the warm-start comparison")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import torch.nn.functional as F
    from transformers import AutoTokenizer, HrmTextForCausalLM

    from deqzoo.integrations.looped_lm import LoopedLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train import split_text

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = HrmTextForCausalLM.from_pretrained(args.model).eval()
    H = model.config.H_cycles
    stream = torch.tensor(tok(split_text("held_out"))["input_ids"], dtype=torch.long)
    n = min(args.windows, (stream.numel() - 1) // args.seq)
    methods = {f"own loop ({H} calls)": LoopedLM.own_loop(model)}
    for k in (2, 4):
        methods[f"plain loop x{k} ({k * H} calls)"] = LoopedLM.own_loop(model, max_iter=k * H)
    for tol in (1e-2, 3e-2, 1e-1):
        for solver, kw in (("anderson", {"m": 5}), ("fixed_point", {})):
            methods[f"{solver} tol {tol:g}"] = LoopedLM.from_model(
                model, solver=solver, max_iter=4 * H, tol=tol, solver_kwargs=kw
            )
    zero = {"nll": 0.0, "tokens": 0, "nfe": 0.0, "nfe_no_halting": 0.0, "converged": 0, "seconds": 0.0}
    totals = {name: dict(zero) for name in methods}
    with torch.no_grad():
        for w in range(n):
            rows = stream[w * args.seq : (w + 1) * args.seq + 1][None]
            for name, looped in methods.items():
                t = time.perf_counter()
                out = looped(rows[:, :-1], use_cache=False)
                tot = totals[name]
                tot["seconds"] += time.perf_counter() - t
                nll = F.cross_entropy(out.logits[0], rows[0, 1:], reduction="sum")
                tot["nll"] += float(nll)
                tot["tokens"] += args.seq
                tot["nfe"] += float(out.nfe.sum())
                tot["nfe_no_halting"] += float(out.nfe.max()) * args.seq
                tot["converged"] += int(out.converged.sum())
    results = {}
    for name, tot in totals.items():
        loss = tot["nll"] / tot["tokens"]
        results[name] = {
            "held_out_loss": loss,
            "perplexity": math.exp(loss),
            "f_calls_per_token": tot["nfe"] / tot["tokens"],
            "f_calls_per_token_without_halting": tot["nfe_no_halting"] / tot["tokens"],
            "converged_fraction": tot["converged"] / tot["tokens"],
            "seconds": tot["seconds"],
        }
        r = results[name]
        print(f"{name:28s} loss {loss:.4f} ppl {r['perplexity']:.2f}  "
              f"f calls/token {r['f_calls_per_token']:.2f} "
              f"(no halting {r['f_calls_per_token_without_halting']:.2f})  converged "
              f"{r['converged_fraction']:.2f}  {r['seconds']:.1f} s", flush=True)  # fmt: skip
    meta = {"model": str(args.model), "windows": n, "seq": args.seq, "H_cycles": H, "results": results,
            "generation": warm_start_in_generation(model, stream, args.prompts, args.new_tokens)}  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
