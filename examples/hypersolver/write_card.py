"""Write a hypersolver's model card from its config.json and a `deqzoo bench hypersolver` JSON.

    python examples/hypersolver/write_card.py model_cards/hyperdeq-mdeq-tiny-mnist \\
        --bench bench_output/hypersolver.json --png bench_output/hypersolver.png

The card carries the training command, data, time and the benchmark's table and acceptance ratios exactly as
the benchmark printed them (`benchmarks.hypersolver.markdown_table`), plus the PNG (copied next to it).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.hypersolver import _acceptance, markdown_table


def _ships(use: str, acc: dict) -> str:
    """The card's paragraph on what attaching the artifact does and the measured reason."""
    ratio = lambda key: "never reaches it" if acc.get(key) is None else f"{acc[key]:.2f}x"  # noqa: E731
    measured = (
        f"Measured below (wall time to Anderson-default's mean residual, over Anderson-default's): the "
        f"initializer with the model's Anderson {ratio('anderson+init_wall_ratio')}, HyperAnderson "
        f"{ratio('hyperanderson_wall_ratio')}; the bar is {acc['wall_bar']}x, "
        + ("met" if acc["wall_ratio_met"] else "not met") + " by the part that ships."
    )
    if use == "initializer":
        return (
            "`use: initializer` (config.json): attaching this hypersolver starts every DEQ solve from "
            "h_φ(input injection) and then solves with the model's own solver settings (`config.deq`: "
            "solver, budget, tolerance). The HyperAnderson network s_ξ is in the file and runs when asked "
            "for (`use=\"hyperanderson\"`), but it is not the default: it does not pay in wall time on this "
            f"model. {measured} The training command below writes the default `use: hyperanderson` "
            "(`--use initializer` writes this one); the published config.json sets the initializer, with "
            "the weights of that training run unchanged."
        )
    return f"`use: hyperanderson`: h_φ's start and the learned HyperAnderson mixing. {measured}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder")
    p.add_argument("--bench", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--extra", default="", help="markdown appended (a file or text)")
    p.add_argument("--bench-command", required=True, help="the command that wrote --bench")
    p.add_argument("--also", default=None, help="the hypersolver benchmarked as hyperanderson[paper]")
    p.add_argument("--model-seconds", type=float, required=True, help="the model's training time (its card)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    cfg = json.loads((folder / "config.json").read_text())
    t = cfg["training"]
    bench = json.loads(Path(args.bench).read_text())
    result = next(r for r in bench["results"] if r["model"] == cfg["model_id"])
    result["acceptance"] = _acceptance(result)  # recomputed from the stored curves (same function)
    (folder / "bench_hypersolver.json").write_text(json.dumps(bench, indent=1) + "\n")
    acc = result["acceptance"]
    shutil.copyfile(args.png, folder / "pareto.png")
    name = folder.name
    metric = result["metric_name"]
    share = 100 * t["seconds_total"] / args.model_seconds
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: deqzoo",
        "tags:",
        "- deqzoo",
        "- deep-equilibrium",
        "- hyperdeq",
        "- hypersolver",
        f"base_model: {cfg['model_id']}",
        "metrics:",
        "- nfe_ratio",
        "- wall_ratio",
        "---",
        "",
        f"# {name}",
        "",
        "A HyperDEQ hypersolver (Bai, Koltun & Kolter, \"Neural Deep Equilibrium Solvers\", ICLR 2022) "
        "for the "
        f"frozen `{cfg['model_id']}`: a learned initializer h_φ over the model's input injection and a "
        f"HyperAnderson network s_ξ ({cfg['state_kind']} state; memory m = {cfg['m']}, trained through "
        f"K = {cfg['unroll_steps']} unrolled steps, update form `{cfg['form']}`, alpha_base "
        f"`{cfg['alpha_base']}`). {t['parameters']:,} parameters "
        f"({100 * acc['parameter_share']:.2f}% of the model's "
        f"{result['model_parameters']:,}).",
        "",
        "alpha_base `anderson` means the network predicts a correction to Anderson's own least-squares "
        "mixing weights (and the step β) instead of the weights themselves (`none`, the paper's form); see "
        "`deqzoo.core.hyper`.",
        "",
        "## What ships",
        "",
        _ships(cfg.get("use", "hyperanderson"), acc),
        "",
        "## Use",
        "",
        "```python",
        "import deqzoo",
        "from deqzoo.hypersolver import load_hypersolver, set_hypersolver",
        "",
        f"model = deqzoo.from_pretrained(\"{cfg['model_id']}\", hypersolver=\"deqzoo/{name}\")  "
        f"# use: {cfg.get('use', 'hyperanderson')}",
        f"set_hypersolver(model, load_hypersolver(\"deqzoo/{name}\"), use=\"hyperanderson\")  "
        "# the learned mixing too",
        "model.remove_hypersolver()   # back to the model's own solver settings",
        "```",
        "",
        "Attaching it to any other weights (checked by a fingerprint of the model's state dict) is an error "
        "naming both.",
        "",
        "## Training",
        "",
        f"Data: {t['data']} (the model's own training inputs). "
        f"Ground truth: {t['ground_truth']} "
        f"(largest relative residual {t['ground_truth_max_rel_residual']:.1e}). {t['steps']} Adam steps "
        f"(lr {t['lr']}, cosine), seed {t['seed']}, {t['threads']} CPU thread. "
        "Losses: L_conv (relative error of every unrolled iterate, weights increasing in k) + 0.5 L_init "
        "+ L_α (decayed to 0 over the first "
        "half).",
        "",
        f"Training took {t['seconds_total']:.1f} s including the ground-truth solves "
        f"({t['seconds_ground_truth']:.1f} s) on a shared 2-core CPU, {share:.1f}% of the model's training "
        f"time ({args.model_seconds:.0f} s).",
        "",
        "```bash",
        t["command"],
        "```",
        "",
        "## Speed and accuracy (held-out data, one side-by-side run)",
        "",
        f"`{args.bench_command}` ({result['problems']} held-out solves, {result['samples']} samples; task "
        f"metric: {metric}; JSON: `bench_hypersolver.json`). Methods: `anderson` and `broyden` from the "
        "model's zero start, `anderson+init` from this hypersolver's initializer alone, `hyperanderson` "
        "(initializer and learned mixing)"
        + (", `hyperanderson[paper]` (the paper's form, see below)" if args.also else "")
        + "; every method runs to its budget without early stopping, and a budget's answer is each sample's "
        "best iterate so far (what a solve with that budget returns). `anderson-default` and `shipped` run "
        "at the model's own budget and tolerance with early stopping: Anderson from the zero start, and this "
        "hypersolver as attaching it runs. Wall times (the initializer's included) are summed over the "
        "solves, measured side by side (every method on a problem before the next problem, in an order that "
        "rotates) on a shared 2-core CPU, one thread.",
        "",
        markdown_table(result),
        "",
        "![residual vs NFE, residual vs wall time, metric vs wall time](pareto.png)",
        "",
    ]
    if args.also:
        other = json.loads((Path(args.also) / "config.json").read_text())
        ot = other["training"]
        lines += [
            "## The paper's form",
            "",
            "`hyperanderson[paper]` is the same architecture trained by the same command with "
            "`--alpha-base none` (α̂ from the network alone, as in Bai et al.), kept outside the repository "
            f"(trained in {ot['seconds_total']:.1f} s, {ot['steps']} steps):",
            "",
            "```bash",
            ot["command"],
            "```",
            "",
        ]
    if args.extra:
        lines += [Path(args.extra).read_text() if Path(args.extra).is_file() else args.extra, ""]
    (folder / "README.md").write_text("\n".join(lines))
    print(f"wrote {folder / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
