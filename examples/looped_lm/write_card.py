"""Write the model card folder of a finished HRM-Text run from its state and one `evaluate.py` result.

The folder is a Hub repository that transformers loads with the stock class (``HrmTextForCausalLM``):
config.json, model.safetensors, generation_config.json and the tokenizer, copied from ``RUN/model``, and a
README.md with the data, recipe, seed, CPU and wall time, the training and evaluation commands and the
evaluation table (the decoding numbers of one interleaved run, whatever they show, the issue's targets with
their measured values).

A run that has not reached its ``--steps`` is refused: an unfinished model is not published. ``--draft``
writes only the README (no weights) to ``--out``, marked as a draft with the step it was evaluated at.
The output folder must not exist (nothing is overwritten).

    python examples/looped_lm/write_card.py --run /work/runs/looped-lm2 \\
        --results examples/looped_lm/results/eval.json --out examples/looped_lm/results/hrm-text-tiny-pydoc

The card is written beside the results (where the app's Looped LM tab finds it): publishing it under
``model_cards/`` means a catalog entry, and ``utils/catalog.py`` counts parameters for deqzoo's own families
only, not for a stock transformers checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CARD_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json")  # fmt: skip


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def results_table(results: dict, own_calls: int) -> str:
    """Markdown: one row per setting (decoding numbers), f calls also as a fraction of the own loop."""
    rows = ["| setting | held-out loss | perplexity | f calls / token | x own loop | converged |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        rows.append(f"| {name} | {_fmt(r['held_out_loss'], 4)} | {_fmt(r['perplexity'], 2)} | "
                    f"{_fmt(r['f_calls_per_token'], 2)} | {_fmt(r['f_calls_per_token'] / own_calls, 2)} | "
                    f"{_fmt(r['converged_fraction'], 2)} |")  # fmt: skip
    return "\n".join(rows)


def verdict_lines(v: dict) -> list[str]:
    out = []
    a, lo, h = v["anderson_reaching_own_loss"], v["anderson_lowest_loss"], v["halting_within_1pct_ppl"]
    own = f"own loop: loss {v['own_loop_loss']:.4f}, perplexity {v['own_loop_perplexity']:.3f}"
    if a:
        out.append(f"- Anderson reaches the own loop's held-out loss ({own}) with {a['setting']} at "
                   f"{a['calls_ratio']:.2f}x its f calls per token: target <= 0.6x "
                   f"**{'met' if a['met'] else 'not met'}**.")  # fmt: skip
    else:
        out.append(f"- Anderson does not reach the own loop's held-out loss ({own}) at any tolerance tried: "
                   f"its lowest loss is {lo['held_out_loss']:.4f} ({lo['setting']}, {lo['calls_ratio']:.2f}x "
                   "the own loop's f calls). Target (<= 0.6x the f calls at the own loop's loss) "
                   "**not met**.")
    if h:
        out.append(f"- Per-token halting within 1% of the own loop's perplexity saves at most "
                   f"{100 * h['saving']:.1f}% of its f calls ({h['setting']}): target >= 30% "
                   f"**{'met' if h['met'] else 'not met'}**.")  # fmt: skip
    else:
        out.append("- No per-token halting setting stays within 1% of the own loop's perplexity: target "
                   "(>= 30% fewer f calls at <= 1% perplexity cost) **not met**.")
    return out


def reading_lines(dec: dict, H: int) -> list[str]:
    """What the table says beyond the targets: whether a fixed shorter loop does as well, and whether solving
    further towards the fixed point helps."""
    own = next(r for n, r in dec.items() if n.startswith("own loop"))
    out = []
    cuts = sorted((r["f_calls_per_token"], n, r) for n, r in dec.items()
                  if n.startswith("own map cut") and r["held_out_loss"] <= own["held_out_loss"])  # fmt: skip
    if cuts:
        calls, name, r = cuts[0]
        out.append(f"- The same map cut to {calls:g} calls for every token already reaches the own loop's "
                   f"loss ({name}: {r['held_out_loss']:.4f}, {calls / H:.2f}x): trained at random depth, the "
                   "model is as good at shallower depths, so savings of this size are open to a fixed shorter"
                   " loop too; judge halting and Anderson against the cut loops' rows too.")
    anderson = sorted((float(n.split()[-1]), n) for n in dec if n.startswith("anderson tol"))
    if anderson:
        tight = dec[anderson[0][1]]
        far = next((r for n, r in dec.items() if n.startswith("drift: own map")), None)
        line = (f"- Solving further towards the fixed point does not help: {anderson[0][1]} has loss "
                f"{tight['held_out_loss']:.4f} at {tight['f_calls_per_token']:.2f} calls per token "
                f"({100 * tight['converged_fraction']:.0f}% converged)")
        if far is not None:
            line += (f", and the map run for {far['f_calls_per_token']:g} calls has loss "
                     f"{far['held_out_loss']:.4f}")
        out.append(line + ". HRM-Text injects the token only into its initial z_H, so a fixed point of its "
                   "map can forget the token; the settings that meet the targets stop at a loose tolerance "
                   "(an early stop on the way, not an equilibrium).")
    return out


def card_text(run: Path, ev: dict, draft: bool) -> str:
    cfg = json.loads((run / "run.json").read_text())
    state = json.loads((run / "state.json").read_text())
    model_cfg = json.loads((run / "model" / "config.json").read_text())
    command = (run / "command.txt").read_text().strip() if (run / "command.txt").is_file() else "(not kept)"
    command = command.split(" && ", 1)[-1] if command.startswith("cd ") else command  # from the clone's root
    dec = ev["results"]["decoding"]
    own_name = next(n for n in dec if n.startswith("own loop"))
    own = dec[own_name]
    H = ev["H_cycles"]
    log = state["log"]
    train_rows = ["| step | train loss | held-out loss (own loop) | CPU hours | wall hours |",
                  "|---|---|---|---|---|"]
    train_rows += [f"| {e['step']} | {e['train_loss']:.4f} | {e['held_out_loss']:.4f} | "
                   f"{e['cpu_hours']:.3f} | {e.get('wall_hours', float('nan')):.3f} |"
                   for e in log]  # fmt: skip
    drift = [f"- {n}: {100 * dec[n]['converged_fraction']:.1f}% of {dec[n]['tokens']} tokens converged, "
             f"median residual ratio {dec[n]['median_residual_ratio']:.3f}; first window per token: "
             f"`{ev['first_window_converged_flags'][n]}` (`.` converged, `x` not)" for n in dec
             if n.startswith("drift")]  # fmt: skip
    samples = []
    for name, s in ev["samples"].items():
        for mode in ("greedy", "sampled"):
            r = s[mode]
            samples.append(f"| {name} | {mode} | {r['distinct_1']:.3f} | {r['distinct_2']:.3f} | "
                           f"{r['distinct_3']:.3f} | {r['f_calls_per_generated_token']:.2f} |")  # fmt: skip
    example = ev["samples"][own_name]["sampled"]["first_text"].replace("`", "'")
    status = (f"> **Draft**: evaluated at step {state['step']} of {cfg['steps']}; the run is unfinished "
              "and resumable; no weights are published with this text.\n\n" if draft else "")
    yaml = f"""---
license: apache-2.0
library_name: transformers
tags:
- deqzoo
- looped-lm
- hrm-text
- text-generation
datasets:
- python-pydoc-topics
metrics:
- perplexity
pipeline_tag: text-generation
model-index:
- name: deqzoo/hrm-text-tiny-pydoc
  results:
  - task:
      type: text-generation
      name: Text Generation
    dataset:
      type: python-pydoc-topics
      name: Python pydoc_data.topics (held-out topics)
    metrics:
    - type: perplexity
      name: Held-out perplexity (own loop, {H} calls per token)
      value: {own['perplexity']:.4f}
---
"""
    n_params = f", {ev['parameters']:,} parameters" if "parameters" in ev else ""
    return yaml + f"""
# HRM-Text tiny (pydoc topics)

{status}A small HRM-Text (transformers' stock `HrmTextForCausalLM`: one block per H / L stack,
`hidden_size` {model_cfg['hidden_size']}, `H_cycles` {H}, `L_cycles` {model_cfg['L_cycles']}{n_params})
trained here on Python's `pydoc_data.topics`, and evaluated through
`deqzoo.integrations.looped_lm.LoopedLM`: its own loop, the fixed point by Anderson, per-token halting by
residual. One f call = one application of the recurrent core to one
token (`L_cycles` L-steps and one H-step); the model's own loop is {H} calls per token.

**Data.** The help topics of the Python that trained it, split by topic (held out when the first byte of
sha256(name) is below 26); a byte-level BPE tokenizer ({cfg['vocab']} tokens, `tokenizers`) trained on the
training topics only. **Recipe.** {cfg['steps']} steps of AdamW (lr {cfg['lr']}, {cfg['warmup']} warm-up
steps, cosine to 10%, weight decay 0.01, betas 0.9/0.95, clip 1.0), batch {cfg['batch']} x {cfg['seq']}
tokens; random depth: each step runs the stock forward with `H_cycles` drawn uniformly from
[{cfg.get('H_min', cfg['H'])}, {cfg['H']}] (the saved config keeps {H}); gradient through the whole loop
(HRM-Text's own forward, `L_bp_cycles` default). Seed {cfg['seed']}, one thread at `nice -n 19` on a shared
2-core machine. **Time:** {state['seconds'] / 60:.1f} CPU minutes, {state.get('wall_seconds', 0) / 60:.1f}
wall minutes (step {state['step']}).

Training: `{command}` (resumable: rerun the same command).
Evaluation: `OMP_NUM_THREADS=1 nice -n 15 python {ev['command']}`
({ev['eval_cpu_seconds']:.0f} CPU s, {ev['eval_wall_seconds']:.0f} wall s, load average
{ev['load_average'][0]:.1f}).

## Held-out loss against f calls per token

One interleaved run over {ev['windows']} held-out windows of {ev['seq']} tokens ({ev['tokens']} tokens):
every setting runs a window before the next window. Teacher-forced decoding, one token per forward with the
KV cache (so each token's f calls are calls made); Anderson m = 5 capped at {2 * H} calls (one more call when
its best iterate is not its last); halting = the model's own loop, each token stopping once its relative
residual is below tol.

{results_table(dec, H)}

{chr(10).join(verdict_lines(ev['verdict']))}

Reading the table:

{chr(10).join(reading_lines(dec, H))}
- The sample is {ev['tokens']} held-out tokens: differences of a few thousandths in loss, and ratios within a
  few hundredths of a target, are within what another sample could change.

**Drifting configurations, per token:**

{chr(10).join(drift)}

## Samples

Continuations of {len(ev['samples'])} settings from held-out prompts (32 tokens each; greedy, and sampled at
temperature 0.8, top-k 40); distinct n-grams over the generated tokens:

| setting | decoding | distinct-1 | distinct-2 | distinct-3 | f calls / generated token |
|---|---|---|---|---|---|
{chr(10).join(samples)}

A sampled continuation (own loop): `{example[:300]}`

## Training log

{chr(10).join(train_rows)}

## Use

```python
from transformers import AutoTokenizer, HrmTextForCausalLM
from deqzoo.integrations.looped_lm import LoopedLM

path = "examples/looped_lm/results/hrm-text-tiny-pydoc"  # this folder
model = HrmTextForCausalLM.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
halting = LoopedLM.from_model(model, solver="fixed_point", max_iter={H}, tol=0.1, answer="last")
out = halting.generate(**tok("The for statement", return_tensors="pt"), max_new_tokens=32, do_sample=False)
```
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the training run's --out folder")
    ap.add_argument("--results", type=Path, required=True, help="evaluate.py --out JSON")
    ap.add_argument("--out", type=Path, required=True, help="the card folder to create (must not exist)")
    ap.add_argument("--draft", action="store_true", help="README only, for an unfinished run")
    args = ap.parse_args()
    cfg = json.loads((args.run / "run.json").read_text())
    state = json.loads((args.run / "state.json").read_text())
    finished = state["step"] >= int(cfg["steps"])
    if not finished and not args.draft:
        raise SystemExit(f"{args.run / 'state.json'}: step {state['step']} of {cfg['steps']}: the run is not "
                         "finished; an unfinished model gets no card (use --draft for the README only)")
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: write_card.py creates a new folder and overwrites nothing")
    ev = json.loads(args.results.read_text())
    if not args.draft:
        missing = [f for f in CARD_FILES if not (args.run / "model" / f).is_file()]
        if missing:
            raise SystemExit(f"{args.run / 'model'} lacks {missing}")
    args.out.mkdir(parents=True)
    if not args.draft:
        for f in CARD_FILES:
            shutil.copy2(args.run / "model" / f, args.out / f)
    (args.out / "README.md").write_text(card_text(args.run, ev, draft=args.draft or not finished))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
