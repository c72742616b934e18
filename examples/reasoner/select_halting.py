"""Choose an inference halting setting on validation puzzles, so that the held-out set is looked at once.

Each candidate ("stability:P": argmax answer unchanged for P segments; "residual:T": relative change of the
answer state below T) is run at each multiple of the trained budget next to the fixed budget (halting off,
run once per multiple). A candidate qualifies when, at every multiple, it gives the budget's answer on every
puzzle it stops early and, at 1x, stops some puzzles early with fewer mean segments than the budget; the
choice is the qualifying candidate with the fewest mean segments at 1x (ties: the earlier candidate). The
weights are not touched. Prints and returns the report as JSON.

    PYTHONPATH=. python examples/reasoner/select_halting.py RUN/checkpoint --heldout sudoku9_validation \\
        --candidates stability:2,stability:3,residual:0.01
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from deqzoo.models.reasoner import ReasonerForGridClassification
from examples.reasoner.evaluate import early_agreement, solve_rates
from examples.reasoner.puzzles import HELDOUT, load_heldout

SETTINGS = {"stability": ("halt_patience", int), "residual": ("halt_tol", float)}


def parse_candidate(text: str) -> tuple[str, str, float | int]:
    """"stability:3" -> ("stability", "halt_patience", 3): the rule, the config key it sets, the value."""
    rule, _, value = text.partition(":")
    if rule not in SETTINGS or not value:
        raise ValueError(f"candidate {text!r}: expected stability:<patience> or residual:<tol>")
    key, kind = SETTINGS[rule]
    return rule, key, kind(value)


def select(model: ReasonerForGridClassification, inputs: np.ndarray, labels: np.ndarray,
           candidates: list[str], multiples: list[int]) -> dict:
    """Every candidate's rows (exact, cells, mean segments, share stopped early, share of those with the
    budget's answer) at every multiple, whether it qualifies, and the choice (None if none qualifies)."""
    trained = model.config.halt_max_steps
    parsed = [parse_candidate(c) for c in candidates]
    rows, qualifies = [], {c: True for c in candidates}
    seg_1x = {}
    for k in multiples:
        t = time.time()
        budget, budget_answers, _ = solve_rates(model, inputs, labels, k * trained, "budget")
        rows.append({"multiple": k, "halting": "budget", **budget, "wall_s": round(time.time() - t, 2)})
        for text, (rule, key, value) in zip(candidates, parsed):
            old = getattr(model.config, key)
            setattr(model.config, key, value)
            try:
                t = time.time()
                rates, answers, steps = solve_rates(model, inputs, labels, k * trained, rule)
            finally:
                setattr(model.config, key, old)
            n_early, same = early_agreement(answers, steps, budget_answers, k * trained)
            rows.append({"multiple": k, "halting": rule, key: value, "candidate": text, **rates,
                         "stopped_early": n_early, "early_same_as_budget": same,
                         "wall_s": round(time.time() - t, 2)})
            qualifies[text] &= same == n_early
            if k == 1:
                seg_1x[text] = rates["segments"]
                qualifies[text] &= n_early > 0 and rates["segments"] < trained
    eligible = [c for c in candidates if qualifies[c] and c in seg_1x]
    choice = min(eligible, key=lambda c: (seg_1x[c], candidates.index(c))) if eligible else None
    return {"trained_segments": trained, "puzzles": len(inputs), "multiples": multiples,
            "candidates": candidates, "qualifies": qualifies, "choice": choice, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a folder written by save_pretrained")
    p.add_argument("--heldout", default="sudoku9_validation", choices=sorted(HELDOUT))
    p.add_argument("--candidates", required=True, help="comma-separated stability:<P> / residual:<T>")
    p.add_argument("--multiples", default="1,2,4,16")
    p.add_argument("--limit", type=int, default=None, help="first N puzzles only")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    candidates = [c for c in args.candidates.split(",") if c]
    for c in candidates:  # a typo fails here, before any puzzle runs
        parse_candidate(c)
    torch.set_num_threads(args.threads)
    model = ReasonerForGridClassification.from_pretrained(args.checkpoint).eval()
    data = load_heldout(args.heldout)
    report = {"checkpoint": str(args.checkpoint), "set": args.heldout,
              **select(model, data["inputs"][:args.limit], data["labels"][:args.limit], candidates,
                       [int(m) for m in args.multiples.split(",")])}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
