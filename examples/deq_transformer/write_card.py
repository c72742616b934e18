"""Write the model card of deqzoo/deq-transformer-tiny-pydoc from measured numbers.

    python examples/deq_transformer/compare_pydoc.py model_cards/deq-transformer-tiny-pydoc /tmp/explicit-
    pydoc \\
        /tmp/deq-jr03-pydoc /tmp/deq-jr2-pydoc --json /tmp/pydoc_compare.json
    python examples/deq_transformer/write_card.py model_cards/deq-transformer-tiny-pydoc \\
        --compare /tmp/pydoc_compare.json

Card metrics are exactly what ``deqzoo eval deqzoo/deq-transformer-tiny-pydoc`` prints (evaluate() is re-run
here); baselines and the Jacobian-regularization rows come from the comparison JSON (same evaluate()).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from deqzoo.models.deq_transformer import DEQTransformerForCausalLM
from deqzoo.predict import generate_text

if __package__ in (None, ""):  # run as a file (`python examples/...`): `examples` from the clone
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.deq_transformer import pydoc_lm
from utils.cards import write_model_card

# measured after training (the run did not record its time); see the HyperDEQ hypersolver's card
TRAINING_TIME = (
    'Training time was not recorded when this checkpoint was trained; measured afterwards (for the '
    "HyperDEQ hypersolver's 10% budget) by running the training command above (output to a scratch "
    'directory) for 140 s on the shared 2-core CPU, one thread: 253 of 800 steps in 140 s (0.553 s/step; '
    'every training forward solve was already at its 14-iteration cap, so later steps cost the same), '
    'extrapolated to 800 x 0.553 s = about 443 s (7.4 min) of training loop, excluding start-up and '
    'tokenizer training.'
)

def _train_command(a: dict) -> str:
    cmd = (f"python examples/deq_transformer/train_pydoc.py --steps {a['steps']} --dropout {a['dropout']} "
           f"--variant {a.get('variant', 'bai2019')} --b-mode {a['b_mode']} "
           f"--train-f-iter {a['train_f_iter']}" + (" --pre-lnorm" if a.get("pre_lnorm") else ""))
    return cmd + " --out model_cards/deq-transformer-tiny-pydoc"


def _label(path: str, v: dict, ckpt: Path) -> str:
    if v.get("explicit_layers"):
        return f"Explicit transformer, {v['explicit_layers']} untied blocks"
    this = " (this checkpoint)" if Path(path).resolve() == ckpt.resolve() else ""
    ln = " pre-LN" if v.get("pre_lnorm") else ""
    return f"DEQ-Transformer {v['variant']}{ln}, {v['b_mode']} training{this}"


def generation_prompts() -> list[str]:
    """The prompts the card's generation-time solve statistics are measured on: the demo prompt and the first
    8 words of each held-out topic."""
    topics = pydoc_lm._topics()
    held_out = [" ".join(topics[t].split()[:8]) for t in sorted(topics) if pydoc_lm.is_held_out(t)]
    return [pydoc_lm.DEMO_PROMPT, *held_out]


def generation_solves(model) -> dict:
    """How often generation with the card's decoding (what `deqzoo demo` and `deqzoo predict` run: 24 new
    tokens, `pydoc_lm.DECODING`, seed 0) meets a forward solve that stops above its tolerance at the
    f_max_iter cap, over `generation_prompts()`: every forward's per-sample flags from `deq_stats`."""
    seen = []
    handle = model.register_forward_hook(lambda _m, _i, out: seen.append(out.deq_stats))
    policy = model.config.on_nonconvergence
    model.set_deq(on_nonconvergence="ignore")  # counted here, not warned about
    try:
        for prompt in generation_prompts():
            generate_text(model, prompt)
    finally:
        handle.remove()
        model.set_deq(on_nonconvergence=policy)
    return {
        "prompts": len(generation_prompts()),
        "solves": sum(s.converged.numel() for s in seen),
        "at_cap": sum(int((~s.converged).sum()) for s in seen),
        "max_residual": max(float(s.residual.max()) for s in seen),
        "cap": model.config.deq["f_max_iter"],
    }


# Measured on a second CPU after the card was written (the card check in
# tests/models/deq_transformer/test_deqlm_checkpoint.py allows it).
CPU_NOTE = ("The largest residual is that of solves stopped unconverged, so it carries the float32 "
            "rounding of the machine's kernels, whose reduction order follows the CPU's vector width: on an "
            "AMD EPYC with AVX-512 the same 6 solves stop at the cap with largest residual 2.5e-02, and with "
            "one thread (`torch.set_num_threads(1)`) here 9.8e-03.")


def generation_sentence(g: dict) -> str:
    share = 100 * g["at_cap"] / g["solves"]
    return (f"With the card's decoding (what `deqzoo demo` runs), {g['at_cap']} of {g['solves']} "
            f"generation-time solves ({share:.1f}%) stop at the {g['cap']}-iteration cap above the "
            f"tolerance (largest residual {g['max_residual']:.1e}; {g['prompts']} prompts: the demo's and "
            "the "
            "first 8 words of each held-out topic, 24 new tokens each; `generation_solves` in "
            "examples/deq_transformer/write_card.py), so the checkpoint ships "
            '`on_nonconvergence="ignore"` (the per-solve flags stay in `deq_stats.converged`; '
            '`model.set_deq(on_nonconvergence="warn")` reports them).')


def reuse_measurement(model, max_new_tokens: int = 32) -> dict:
    """Greedy generation of the demo prompt with and without fixed-point reuse (tight solves)."""
    tok = pydoc_lm.load_tokenizer(model)
    ids = tok(pydoc_lm.DEMO_PROMPT, return_tensors="pt")["input_ids"]
    old = dict(model.config.deq)
    # the checkpoint's own tolerance, with room to converge (every solve below reaches it)
    model.set_deq(f_solver="anderson", f_max_iter=100, f_tol=1e-3, f_stop_mode="rel")
    rows = {}
    for reuse in (True, False):
        model.config.fixed_point_reuse = reuse
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        cache = out.past_key_values
        rows[reuse] = {"tokens": out.sequences[0].tolist(), "total_nfe": cache.total_nfe, "nfe": cache.nfe,
                       "incremental_nfe": sum(cache.nfe[1:]), "steps": len(cache.nfe) - 1}
    model.config.fixed_point_reuse = True
    model.set_deq(**{k: old[k] for k in ("f_solver", "f_max_iter", "f_tol", "f_stop_mode")})
    converged = max(rows[True]["nfe"] + rows[False]["nfe"]) < 100
    solver = ("Anderson to rel. tol 1e-3, at most 100 iterations (every solve "
              + ("converged)" if converged else "did NOT converge)"))
    return {"same_tokens": rows[True]["tokens"] == rows[False]["tokens"], "with_reuse": rows[True],
            "without_reuse": rows[False], "text": tok.decode(rows[True]["tokens"]), "solver": solver,
            "converged": converged}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--compare", required=True, help="JSON written by compare_pydoc.py")
    p.add_argument("--train-log", required=True, help="the checkpoint's train_pydoc.py --log JSON")
    p.add_argument("--jr-note", default=None, help="a text file: the observed Jacobian-regularization effect")
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ckpt = Path(args.checkpoint)
    model = DEQTransformerForCausalLM.from_pretrained(ckpt).eval()
    full = pydoc_lm.evaluate(model)
    sub = pydoc_lm.evaluate(model, limit=8, progress=False)
    reuse = reuse_measurement(model)
    generation = generation_sentence(generation_solves(model))
    cmp = json.loads(Path(args.compare).read_text())
    explicit = next(v for k, v in cmp.items() if k != "unigram" and v.get("explicit_layers"))
    unigram = cmp["unigram"]["perplexity"]
    train_topics, held_topics = pydoc_lm.split_topics()
    n_params = sum(t.numel() for t in model.parameters())
    jr_base = [v for k, v in cmp.items() if k != "unigram" and not v.get("explicit_layers")
               and v["variant"] == "bai2019" and v["b_mode"] == "ift"]
    jr_rows = "\n".join(
        f"| {'pre-LN' if v.get('pre_lnorm') else 'post-LN'} | {v['jac_reg_weight']} | {v['perplexity']} | "
        f"{v['mean_nfe']} |"
        for v in sorted(jr_base, key=lambda v: (not v.get("pre_lnorm"), v["jac_reg_weight"])))
    model_rows = "\n".join(
        f"| {_label(k, v, ckpt)} | {v['params']:,} | {v['perplexity']} | {v['mean_nfe']} |"
        for k, v in cmp.items() if k != "unigram" and not v["jac_reg_weight"])
    ratio = full["perplexity"] / explicit["perplexity"]
    jr_note = Path(args.jr_note).read_text().strip() if args.jr_note else ""
    w, wo = reuse["with_reuse"], reuse["without_reuse"]
    cfg = model.config
    # defaults of train_pydoc.py for logs written before these options existed
    targs = {"variant": "bai2019", "b_mode": "ift", "train_f_iter": 14,
             **json.loads(Path(args.train_log).read_text())["meta"]["args"]}
    train_cmd = _train_command(targs)
    variant = ("TorchDEQ's redesigned DEQ-Transformer (pre-LayerNorm, LayerNorm after attention; "
               f"{cfg.n_block} block(s) in f)" if cfg.variant == "torchdeq" else
               "Bai et al. (2019) DEQ-Transformer (one weight-tied decoder block, "
               + ("LayerNorm before each sublayer)" if cfg.pre_lnorm else "post-LayerNorm)"))
    grad = ({"unrolled": f"backpropagation through the {targs['train_f_iter']} fixed-point iterations of f "
                         "from z0 = 0 (TorchDEQ deq-lm's recipe)",
             "ift": "implicit differentiation (Anderson backward, 10 iterations) at the forward solve's "
                    f"answer (Anderson, {targs['train_f_iter']} iterations, tol 1e-3)",
             "phantom": "phantom gradients"}[targs["b_mode"]])
    body = f"""
A tiny DEQ-Transformer language model: {variant}, relative positional attention over a memory of past
equilibria (Transformer-XL style), input injection into q/k/v. Trained here on the English text of Python's
`pydoc_data.topics` with a byte-level BPE tokenizer (`tokenizers`, {cfg.vocab_size} tokens) trained on the
training topics only. {n_params:,} parameters.

**Data.** The {len(train_topics) + len(held_topics)} pydoc help topics are split by topic: a topic is held out
when the first byte of sha256(topic name) is below 26 ({len(held_topics)} held-out topics:
{", ".join(held_topics)}; see `examples/deq_transformer/pydoc_lm.py`). Evaluation runs over the held-out token
stream in chunks of {cfg.tgt_len} tokens with the memory of past equilibria carried over ({cfg.mem_len}
positions); perplexity is over every predicted token, mean NFE is the forward-solve f evaluations per
chunk ({cfg.deq['f_solver']},
f_max_iter={cfg.deq['f_max_iter']}, f_tol={cfg.deq['f_tol']}).

**Recipe.** {targs['steps']} steps of Adam (lr {targs['lr']}, 5% warmup, cosine), batch {targs['batch']} x
{targs['seg']} tokens ({targs['steps'] * targs['batch'] * targs['seg']:,} training tokens), variational
dropout {targs['dropout']}, gradient clipping 0.25; gradient: {grad}. Seed {targs['seed']}, one CPU thread.
{TRAINING_TIME}

**Baselines** (same data, tokenizer, steps, batch and tokens; every row is `evaluate()` on the same split):

| Model | Parameters | Held-out perplexity | Mean NFE |
|---|---|---|---|
{model_rows}
| Unigram (add-one smoothed training counts) | - | {unigram} | - |

This checkpoint / explicit perplexity ratio: {ratio:.3f}. The explicit baseline is `train_pydoc.py --explicit`
(two distinct bai2019 blocks applied once each, d_inner shrunk to 96 so the parameter count matches).
With the post-LN block (Bai et al.'s default) the same recipe stays far behind: its training solves sat at the
14-iteration cap from step ~150 on. The pre-LN block (their "preln" configuration, this checkpoint) trains
well at this budget. {generation} {CPU_NOTE}
The torchdeq/unrolled row (`--variant torchdeq --b-mode unrolled --train-f-iter 8`, TorchDEQ deq-lm's recipe
of backpropagating through the fixed-point iterations) is the best model at this budget but is not published:
its pre-LN f = z + g(LN z) has no fixed point the solvers reach (Anderson does not converge; held-out
perplexity on the first 20 chunks is 24.7 at 8 steps, 24.6 at 12, 73.6 at 20), so solver settings are not
a safe test-time knob and fixed-point reuse changes its greedy tokens.

**Jacobian regularization** (`train_pydoc.py --jac-reg W [--pre-lnorm]`: bai2019, implicit
differentiation, one Hutchinson sample, otherwise the same recipe as the weight-0 row of its block):

| Block | Weight | Held-out perplexity | Mean NFE |
|---|---|---|---|
{jr_rows}

{jr_note}

**Generation with fixed-point reuse.** Greedy `generate()` of 32 tokens after "{pydoc_lm.DEMO_PROMPT}",
solving each step with {reuse['solver']}: the same tokens with and without reuse: {reuse['same_tokens']};
total NFE {w['total_nfe']} with reuse vs {wo['total_nfe']} without (incremental steps only:
{w['incremental_nfe']} vs {wo['incremental_nfe']} over {w['steps']} one-token steps).
Text: `{reuse['text']!r}`

**Subset check used by the test suite** (`evaluate(model, limit=8)`):
limit=8: perplexity {sub['perplexity']:.4f}, mean NFE {sub['mean_nfe']:.4f}.
"""
    write_model_card(
        ckpt, model_id="deqzoo/deq-transformer-tiny-pydoc", title="DEQ-Transformer tiny (pydoc topics)",
        pipeline_tag="text-generation", task_module="pydoc_lm", datasets=["python-pydoc-topics"],
        dataset_name="Python pydoc_data.topics (held-out topics)",
        metrics=[{"type": "perplexity", "name": "Held-out perplexity", "value": full["perplexity"]},
                 {"type": "mean_nfe", "name": "Mean forward NFE per chunk", "value": full["mean_nfe"]}],
        tags=["deq-transformer", "language-modeling", "text-generation"], train_command=train_cmd,
        eval_command="deqzoo eval deqzoo/deq-transformer-tiny-pydoc", body_markdown=body)
    result = {"eval": full, "eval_limit8": sub, "reuse": reuse, "compare": cmp, "ratio_to_explicit": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "compare"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
