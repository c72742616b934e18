"""The `sudoku6` task of `deqzoo eval` / `deqzoo demo`: a reasoner checkpoint scored on the stored 6×6
held-out puzzles (`data/sudoku6_heldout.npz`, 1,000 minimal puzzles) at 1, 2, 4 and 16 times its trained
segment budget with halting off, and at the trained budget with the ACT and stability rules.

The numbers are `evaluate.py`'s (the same :func:`examples.reasoner.evaluate.solve_rates`, batches of 250,
rounded to 4 places), so a card written by `write_card.py` from evaluate.py's JSON is what
``deqzoo eval <card>`` prints.

Example:
    >>> import torch
    >>> from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification
    >>> cfg = ReasonerConfig(seq_len=36, vocab_size=7, num_labels=7, hidden_size=16, num_heads=2,
    ...                      mixer="mlp", pos_encodings="learned", h_cycles=1, l_cycles=1, halt_max_steps=2)
    >>> torch.manual_seed(0) and None
    >>> metrics = evaluate(ReasonerForGridClassification(cfg), limit=20, progress=False)
    >>> sorted(metrics)[:3], 0.0 <= metrics["exact_1x"] <= 1.0
    (['cells_1x', 'exact_16x', 'exact_1x'], True)
"""

from __future__ import annotations

from tqdm import tqdm

from examples.reasoner.evaluate import solve_rates
from examples.reasoner.puzzles import HELDOUT as HELDOUT_SETS
from examples.reasoner.puzzles import load_heldout

HELDOUT = "sudoku6_heldout"
MULTIPLES = (1, 2, 4, 16)
HALTING_RULES = ("act", "stability")  # scored at the trained budget (1×) when the model has > 1 segment


def _check(model, heldout: str = HELDOUT) -> None:
    cfg = model.config
    n = HELDOUT_SETS[heldout][1]
    task = heldout.removesuffix("_heldout")
    if getattr(cfg, "model_type", None) != "reasoner" or cfg.seq_len != n * n or cfg.num_labels < n + 1:
        raise ValueError(f"task {task} needs a reasoner over {n * n} cells with >= {n + 1} labels, got "
                         f"model_type {getattr(cfg, 'model_type', None)!r}, seq_len "
                         f"{getattr(cfg, 'seq_len', None)}, num_labels {getattr(cfg, 'num_labels', None)}")


def metric_names(halt_max_steps: int) -> list[str]:
    """The keys :func:`evaluate` returns for a model trained with `halt_max_steps` segments, in order."""
    names = [f"exact_{k}x" for k in MULTIPLES] + ["cells_1x"]
    if halt_max_steps > 1:
        names += [f"{what}_{rule}_1x" for rule in HALTING_RULES for what in ("exact", "segments")]
    return names


def metrics_from_report(report: dict) -> dict[str, float]:
    """The :func:`evaluate` keys taken from evaluate.py's JSON report (the card writer's source); KeyError
    naming what the report lacks."""
    rows = {(r["multiple"], r["halting"]): r for r in report["rows"]}
    out: dict[str, float] = {}
    for name in metric_names(int(report["trained_segments"])):
        what, *rule, multiple = name.split("_")
        key = (int(multiple[:-1]), rule[0] if rule else "budget")
        if key not in rows:
            raise KeyError(f"evaluate.py's report has no row for {key[0]}x with halting {key[1]!r} "
                           f"(needed for {name}); run it with --multiples {','.join(map(str, MULTIPLES))} "
                           f"--halting budget,{','.join(HALTING_RULES)}")
        out[name] = rows[key][what]
    return out


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """Exact-solve rate on the stored held-out puzzles at 1/2/4/16× the trained segments (halting off), cell
    accuracy at 1×, and exact-solve with mean segments under ACT and stability halting at 1×. `limit`
    scores the first `limit` puzzles only."""
    return evaluate_on(model, HELDOUT, limit=limit, progress=progress)


def evaluate_on(model, heldout: str, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """:func:`evaluate` on the stored held-out set `heldout` (another grid size's task module calls this)."""
    _check(model, heldout)
    data = load_heldout(heldout)
    inputs, labels = data["inputs"][:limit], data["labels"][:limit]
    trained = model.config.halt_max_steps
    runs = [(k, "budget") for k in MULTIPLES] + ([(1, r) for r in HALTING_RULES] if trained > 1 else [])
    out: dict[str, float] = {}
    for k, rule in tqdm(runs, desc=heldout.replace("_heldout", " held-out"), disable=not progress):
        rates, _, _ = solve_rates(model, inputs, labels, k * trained, rule)
        if rule == "budget":
            out[f"exact_{k}x"] = rates["exact"]
            if k == 1:
                out["cells_1x"] = rates["cells"]
        else:
            out[f"exact_{rule}_1x"], out[f"segments_{rule}_1x"] = rates["exact"], rates["segments"]
    return {name: out[name] for name in metric_names(trained)}


def demo(model):
    """Solve the first 100 held-out puzzles at the trained budget, then with stability halting; one line."""
    return demo_on(model, HELDOUT)


def demo_on(model, heldout: str):
    """:func:`demo` on the stored held-out set `heldout`."""
    import numpy as np
    import torch

    from deqzoo.models.reasoner import exact_solved
    from examples.demo import DemoSummary

    _check(model, heldout)
    data = load_heldout(heldout)
    x = torch.from_numpy(data["inputs"][:100].astype(np.int64))
    y = torch.from_numpy(data["labels"][:100].astype(np.int64))
    model.eval()
    with torch.no_grad():
        full = model(x, halting="budget")
        halted = model(x, halting="stability")
    solved = int(exact_solved(full.logits, y).sum())
    line = (f"{heldout.removesuffix('_heldout')} (100 held-out minimal puzzles): {solved}/100 solved at "
            f"{model.config.halt_max_steps} "
            f"segments; with stability halting {int(exact_solved(halted.logits, y).sum())}/100 at "
            f"{halted.steps.float().mean():.2f} segments on average")
    return DemoSummary(line, f"{solved}/100 solved"), full.deq_stats
