"""Exact-solve rate of a trained reasoner on a stored held-out set vs test-time iterations, as JSON.

For each multiple k of the trained budget (config.halt_max_steps segments; default 1, 2, 4, 16) and each
halting rule ("budget": halting off; "act": the Q-head; "stability": argmax unchanged for
config.halt_patience segments; "residual"), it prints the exact-solve rate (every cell right), the cell
accuracy and the mean segments run per puzzle.

    PYTHONPATH=. python examples/reasoner/evaluate.py RUN/checkpoint --heldout sudoku6_heldout
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from deqzoo.models.reasoner import ReasonerForGridClassification, exact_solved
from examples.reasoner.puzzles import HELDOUT, load_heldout


@torch.no_grad()
def solve_rates(model, inputs: np.ndarray, labels: np.ndarray, segments: int, halting: str,
                batch: int = 250, solves: list | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """({"exact", "cells", "segments"}, answers, segments run per puzzle) over the set at a budget of
    `segments` with the rule `halting`; `solves`, if given, receives each batch's last-segment solve
    statistics (``deq_stats``, grad_mode "deq")."""
    model.eval()
    solved, cells, steps, answers = [], [], [], []
    for i in range(0, len(inputs), batch):
        x = torch.from_numpy(inputs[i:i + batch].astype(np.int64))
        y = torch.from_numpy(labels[i:i + batch].astype(np.int64))
        out = model(x, num_segments=segments, halting=halting)
        if solves is not None:
            solves.append(out.deq_stats)
        solved.append(exact_solved(out.logits, y))
        cells.append((out.logits.argmax(-1) == y).float().mean(1))
        steps.append(out.steps)
        answers.append(out.logits.argmax(-1))
    steps_all = torch.cat(steps)
    return ({"exact": round(float(torch.cat(solved).float().mean()), 4),
             "cells": round(float(torch.cat(cells).mean()), 4),
             "segments": round(float(steps_all.float().mean()), 3)}, torch.cat(answers), steps_all)


def early_agreement(answers: torch.Tensor, steps: torch.Tensor, budget_answers: torch.Tensor,
                    budget: int) -> tuple[int, int]:
    """(puzzles a rule stopped before `budget` segments, how many of those got the budget's answer)."""
    early = steps < budget
    return int(early.sum()), int((answers[early] == budget_answers[early]).all(1).sum())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a folder written by save_pretrained (train.py's <out>/checkpoint)")
    p.add_argument("--heldout", default="sudoku6_heldout", choices=sorted(HELDOUT))
    p.add_argument("--limit", type=int, default=None, help="first N puzzles only")
    p.add_argument("--multiples", default="1,2,4,16")
    p.add_argument("--halting", default="budget,act,stability")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ReasonerForGridClassification.from_pretrained(args.checkpoint)
    data = load_heldout(args.heldout)
    inputs, labels = data["inputs"][:args.limit], data["labels"][:args.limit]
    trained = model.config.halt_max_steps
    rows = []
    for k in [int(m) for m in args.multiples.split(",")]:
        budget_answers = None
        for rule in ["budget"] + [r for r in args.halting.split(",") if r != "budget"]:
            t = time.time()
            rates, answers, steps = solve_rates(model, inputs, labels, k * trained, rule)
            row = {"multiple": k, "segments_budget": k * trained, "halting": rule, **rates,
                   "wall_s": round(time.time() - t, 2)}
            if rule == "budget":
                budget_answers = answers
            else:  # the puzzles the rule stopped early, and whether their answers are the budget's
                n_early, n_same = early_agreement(answers, steps, budget_answers, k * trained)
                row["stopped_early"] = round(n_early / len(inputs), 4)
                row["early_same_as_budget"] = round(n_same / n_early, 4) if n_early else None
            if rule in args.halting.split(","):
                rows.append(row)
    report = {"checkpoint": str(args.checkpoint), "heldout": args.heldout, "puzzles": len(inputs),
              "trained_segments": trained, "applications_per_segment": model.config.applications_per_segment,
              "rows": rows}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
