"""The reasoner's card writer and `deqzoo eval` (issue #56): a card written from two tiny trained runs and
evaluate.py's JSON carries the numbers `deqzoo eval <card>` prints; bad inputs are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from deqzoo.cli import main as cli_main
from deqzoo.hub.cards import card_metrics, read_model_card
from deqzoo.models.reasoner import ReasonerConfig, grid_groups
from examples.reasoner import evaluate, grad_modes, sudoku, train, write_card

TINY = ["--task", "sudoku6", "--pool", "30", "--batch-size", "8", "--eval-every", "2", "--eval-size", "5",
        "--checkpoint-every", "2", "--no-progress", "--threads", "1",
        "--config", json.dumps({"hidden_size": 16, "num_heads": 2, "num_layers": 1, "h_cycles": 1,
                                "l_cycles": 1, "halt_max_steps": 2})]


LIMIT = 150


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs (reasoner and twin), each with evaluate.py's JSON on the first LIMIT held-out puzzles (a
    published card needs all 1,000; `--allow-subset` and `deqzoo eval --limit` keep the test short)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reasoner_runs")
    out = {}
    for model in ("reasoner", "twin"):
        folder = root / model
        train.main(["--out", str(folder), "--steps", "4", "--model", model, *TINY])
        halting = "budget,act,stability" if model == "reasoner" else "budget"
        report = evaluate.main([str(folder / "checkpoint"), "--multiples", "1,2,4,16", "--halting", halting,
                                "--limit", str(LIMIT)])
        (root / f"{model}_eval.json").write_text(json.dumps(report))
        out[model] = (folder, root / f"{model}_eval.json")
    return root, out


def _write(root, out, dest, *extra):
    (r, r_eval), (t, t_eval) = out["reasoner"], out["twin"]
    return write_card.main(["--out", str(dest), "--name", "tiny-reasoner", "--run", str(r), "--eval",
                            str(r_eval), "--twin-name", "tiny-twin", "--twin-run", str(t), "--twin-eval",
                            str(t_eval), "--allow-subset", *extra])


def test_card_has_the_numbers_deqzoo_eval_prints(runs, tmp_path, capsys):
    root, out = runs
    _write(root, out, tmp_path)
    for name, halting in (("tiny-reasoner", True), ("tiny-twin", False)):
        folder = tmp_path / name
        assert sorted(p.name for p in folder.iterdir()) == sorted(write_card.CARD_FILES)
        meta, body = read_model_card(folder)
        assert meta["deqzoo_task"] == "sudoku6"
        metrics = card_metrics(meta)
        assert ("exact_act_1x" in metrics) is halting and "exact_16x" in metrics
        capsys.readouterr()
        assert cli_main(["eval", str(folder), "--no-progress", "--limit", str(LIMIT)]) == 0
        printed = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
        assert printed == {k: f"{v:.4f}" for k, v in metrics.items()}
        # the card states the gradient mode, both commands, compute and the paper comparison
        assert "Gradient: **" in body and body.count("examples/reasoner/train.py --out") >= 2
        assert "CPU-hours" in body and "87.4%" in body and "different task" in body
    # the saved weights are the run's (save_pretrained of the checkpoint), and the twin has the same count
    from deqzoo.models.reasoner import ReasonerForGridClassification

    ran = ReasonerForGridClassification.from_pretrained(out["reasoner"][0] / "checkpoint")
    card = ReasonerForGridClassification.from_pretrained(tmp_path / "tiny-reasoner")
    for (key, p), q in zip(ran.state_dict().items(), card.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=key)
    twin = ReasonerForGridClassification.from_pretrained(tmp_path / "tiny-twin")
    assert twin.num_parameters() == card.num_parameters()


def test_other_budgets_table_reads_each_report(runs, tmp_path):
    """`--other-budget` / `--other-twin`: one row per trained budget and per twin, each rate read from that
    report (not the card's own) and the CPU-hours from that report's checkpoint."""
    root, out = runs
    report = json.loads(out["reasoner"][1].read_text())
    rows = [{**r, "exact": 0.5 if r["halting"] == "budget" else r["exact"]} for r in report["rows"]]
    (root / "other.json").write_text(json.dumps({**report, "trained_segments": 7, "rows": rows}))
    twin_report = json.loads(out["twin"][1].read_text())
    rows = [{**r, "exact": 0.25} for r in twin_report["rows"]]
    (root / "other_twin.json").write_text(json.dumps({**twin_report, "rows": rows}))
    _write(root, out, tmp_path, "--other-budget", str(root / "other.json"), "--other-twin",
           str(root / "other_twin.json"))
    _, body = read_model_card(tmp_path / "tiny-reasoner")
    section = body.split("## Other trained budgets")[1].split("## ")[0]
    table = [line.split(" | ") for line in section.splitlines() if line.startswith(("| reasoner", "| twin"))]
    hours = {m: f"{write_card.Run(out[m][0]).cpu_s / 3600:.2f}" for m in ("reasoner", "twin")}
    own = {r["multiple"]: f"{100 * r['exact']:.1f}" for r in report["rows"] if r["halting"] == "budget"}
    twin = {r["multiple"]: f"{100 * r['exact']:.1f}" for r in twin_report["rows"]}
    assert [row[:3] for row in table] == [["| reasoner", "2", hours["reasoner"]],
                                          ["| reasoner", "7", hours["reasoner"]],
                                          ["| twin (one pass)", "1", hours["twin"]],
                                          ["| twin (one pass)", "1", hours["twin"]]]
    assert [row[3:7] for row in table] == [[own[k] for k in (1, 2, 4, 16)], ["50.0"] * 4,
                                           [twin[k] for k in (1, 2, 4, 16)], ["25.0"] * 4]
    _, twin_body = read_model_card(tmp_path / "tiny-twin")
    assert "Other trained budgets" not in twin_body


def test_two_stage_9x9_card_counts_both_stages_and_deqzoo_eval_scores_9x9(tmp_path, capsys):
    """A 9×9 run continued from another's weights (`--init-from`, the 9×9 bar's continuation): the card
    counts both stages' steps and CPU time, gives both commands, routes `deqzoo eval` to the sudoku9 task,
    and checks bar item 5 against `--bar-cpu-hours`."""
    torch.set_num_threads(1)
    common = ["--task", "sudoku9", "--pool", "12", "--batch-size", "8", "--eval-every", "2",
              "--eval-size", "5", "--checkpoint-every", "2", "--no-progress", "--threads", "1",
              "--config", json.dumps({"hidden_size": 16, "num_heads": 2, "num_layers": 1, "h_cycles": 1,
                                      "l_cycles": 1, "halt_max_steps": 2})]
    for m in ("reasoner", "twin"):
        train.main(["--out", str(tmp_path / f"{m}1"), "--steps", "4", "--model", m, *common])
        (tmp_path / m).mkdir()  # the same pool: copied, as the README's commands do
        pool = next((tmp_path / f"{m}1").glob("pool_*.npz"))
        (tmp_path / m / pool.name).write_bytes(pool.read_bytes())
        train.main(["--out", str(tmp_path / m), "--steps", "4", "--model", m, "--schedule", "cosine",
                    "--init-from", str(tmp_path / f"{m}1" / "checkpoint"), *common])
        report = evaluate.main([str(tmp_path / m / "checkpoint"), "--heldout", "sudoku9_heldout", "--limit",
                                "40", "--multiples", "1,2,4,16",
                                "--halting", "budget,act,stability" if m == "reasoner" else "budget"])
        (tmp_path / f"{m}_eval.json").write_text(json.dumps(report))
    argv = ["--out", str(tmp_path / "cards"), "--name", "tiny9", "--run", str(tmp_path / "reasoner"),
            "--eval", str(tmp_path / "reasoner_eval.json"), "--twin-name", "tiny9-twin",
            "--twin-run", str(tmp_path / "twin"), "--twin-eval", str(tmp_path / "twin_eval.json"),
            "--allow-subset", "--bar-cpu-hours", "6"]
    with pytest.raises(ValueError, match="--init-log"):  # the first stage is part of the card
        write_card.main(argv)
    write_card.main([*argv, "--init-log", str(tmp_path / "reasoner1" / "log.jsonl"),
                     "--twin-init-log", str(tmp_path / "twin1" / "log.jsonl")])
    first, second = write_card.Run(tmp_path / "reasoner1"), write_card.Run(tmp_path / "reasoner",
                                                                            earlier_log=tmp_path / "reasoner1"
                                                                            / "log.jsonl")
    assert (second.step, second.stage_step, second.earlier_step) == (8, 4, 4)
    assert second.cpu_s == pytest.approx(first.cpu_s + second.stage_cpu_s)
    assert [r["step"] for r in second.curve] == [2, 4, 6, 8]
    assert second.curve[2]["cpu_s"] > first.cpu_s
    meta, body = read_model_card(tmp_path / "cards" / "tiny9")
    assert meta["deqzoo_task"] == "sudoku9" and "9×9 Sudoku (3×3 boxes)" in body
    assert f"**{second.cpu_s:,.0f} CPU-s" in body and "Trained in two stages: 4 steps" in body
    assert "--out runs/tiny9-stage1 " in body and "--init-from runs/tiny9-stage1/checkpoint" in body
    commands = body.split("## Commands")[1].split("## ")[0]
    assert commands.count("--schedule cosine") == 2  # the reasoner's second stage and the twin's
    assert commands.count("examples/reasoner/train.py") == 4
    assert "sudoku9_heldout" in body and "sudoku6_heldout" not in body
    assert "| puzzles seen (this stage) |" in body  # train.py's count restarts with --init-from
    assert "| 5. same CPU-hours, ≥ 6 each |" in body and body.split("| 5. same CPU-hours")[1].split("\n")[0]\
        .endswith("| no |")
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "cards" / "tiny9"), "--no-progress", "--limit", "40"]) == 0
    printed = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert printed == {k: f"{v:.4f}" for k, v in card_metrics(meta).items()}
    # an evaluation on the 6×6 held-out set is not this card's
    report = json.loads((tmp_path / "reasoner_eval.json").read_text())
    (tmp_path / "wrong.json").write_text(json.dumps({**report, "heldout": "sudoku6_heldout"}))
    with pytest.raises(ValueError, match="the sudoku9 card needs sudoku9_heldout"):
        write_card.main([*argv[:6], "--eval", str(tmp_path / "wrong.json"), "--allow-subset", "--init-log",
                         str(tmp_path / "reasoner1" / "log.jsonl"), "--replace"])


@pytest.mark.parametrize("mixer, words", [("mlp", "MLP-mixer"), ("attention", "self-attention"),
                                          ("groups", "group mixer")])
def test_card_names_the_mixer_the_config_has(mixer, words):
    cfg = ReasonerConfig(seq_len=16, vocab_size=5, num_labels=5, hidden_size=8, num_heads=2, mixer=mixer,
                         token_groups=grid_groups(4, box=(2, 2)) if mixer == "groups" else None)
    text = write_card.describe_model(cfg, 123)
    assert f"blocks of {words}" in text and text.endswith("123 parameters.")


def test_long_curves_table_reads_the_last_evaluation_before_each_half_hour():
    def report(cpu_s, points):
        curve = [{"cpu_s": c, "eval": {"budget": {"exact": e}}} for c, e in points]
        return {"trained_cpu_s": cpu_s, "curve": curve}

    long = report(4000, [(900, 0.1), (1700, 0.2), (1900, 0.3), (3500, 0.4), (3700, 0.5)])
    short = report(1800, [(1700, 0.9)])
    table = write_card.long_curves_table([("long", long), ("short", short)]).splitlines()
    assert table[0] == "| run | 0.5 h | 1.0 h |" and table[2:] == ["| long | 20.0 | 40.0 |"]
    assert write_card.long_curves_table([("short", short)]) == ""


def test_card_writer_refuses_bad_inputs(runs, tmp_path):
    root, out = runs
    (r, r_eval), (_, t_eval) = out["reasoner"], out["twin"]
    # an evaluation of another checkpoint
    with pytest.raises(ValueError, match="not .*checkpoint"):
        write_card.main(["--out", str(tmp_path), "--name", "x", "--run", str(r), "--eval", str(t_eval)])
    # a report on part of the held-out set
    with pytest.raises(ValueError, match=f"{LIMIT} puzzles; the card needs all 1000"):
        write_card.main(["--out", str(tmp_path), "--name", "x", "--run", str(r), "--eval", str(r_eval)])
    # an existing card folder is not overwritten without --replace
    (tmp_path / "cards" / "tiny-reasoner").mkdir(parents=True)
    (tmp_path / "cards" / "tiny-reasoner" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        _write(root, out, tmp_path / "cards")
    assert (tmp_path / "cards" / "tiny-reasoner" / "notes.txt").read_text() == "mine"
    # a run folder without its trainer state
    with pytest.raises(FileNotFoundError, match="run.json"):
        write_card.Run(tmp_path)


def test_sudoku6_task_refuses_other_models():
    from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification

    cfg = ReasonerConfig(seq_len=16, vocab_size=5, num_labels=5, hidden_size=16, num_heads=2)
    with pytest.raises(ValueError, match="36 cells"):
        sudoku.evaluate(ReasonerForGridClassification(cfg), limit=2, progress=False)


def test_report_rows_map_to_eval_keys():
    report = {"trained_segments": 8, "rows": [
        {"multiple": k, "halting": "budget", "exact": k / 100, "cells": 0.5, "segments": 8.0 * k}
        for k in (1, 2, 4, 16)]}
    with pytest.raises(KeyError, match="act"):
        sudoku.metrics_from_report(report)
    report["trained_segments"] = 1
    assert sudoku.metrics_from_report(report) == {"exact_1x": 0.01, "exact_2x": 0.02, "exact_4x": 0.04,
                                                  "exact_16x": 0.16, "cells_1x": 0.5}


def test_grad_mode_configs_are_distinct_and_valid():
    from deqzoo.models.reasoner import ReasonerConfig

    base = {"h_cycles": 2, "l_cycles": 2}
    seen = set()
    for mode in grad_modes.MODES:
        cfg = ReasonerConfig(seq_len=36, vocab_size=7, num_labels=7, hidden_size=16, num_heads=2,
                             **grad_modes.mode_config(base, mode))
        seen.add((cfg.grad_mode, json.dumps(cfg.deq, sort_keys=True, default=str)
                  if cfg.grad_mode == "deq" else None))
    assert len(seen) == len(grad_modes.MODES)


def test_ift_adjoint_option_sets_the_ift_rows_backward_solve_only():
    base = {"h_cycles": 2, "l_cycles": 2}
    ift = grad_modes.mode_config(base, "ift", 32, "anderson:64")["deq"]
    assert (ift["b_solver"], ift["b_max_iter"], ift["f_max_iter"]) == ("anderson", 64, 32)
    assert ift["b_mode"] == "ift"
    assert grad_modes.mode_config(base, "phantom", 32, "anderson:64")["deq"] == \
        grad_modes.mode_config(base, "phantom", 32)["deq"]
    assert grad_modes.mode_config(base, "ift")["deq"]["b_max_iter"] == 8  # the tables' default adjoint
    for bad in ("newton:5", "anderson", "anderson:0"):
        with pytest.raises(SystemExit):
            grad_modes.parse(["--out", "x", "--ift-adjoint", bad])
    table = {"preset": "p", "config": "{}", "cpu_seconds": 300, "eval_size": 5, "warm_start_seconds": 150,
             "deq_max_iter": 32, "ift_adjoint": "anderson:64",
             "rows": [{"mode": "ift", "exact": 0.5, "cells": 0.9, "steps": 3, "cpu_s": 300.0,
                       "deq": grad_modes.mode_config(base, "ift", 32, "anderson:64")["deq"]}]}
    assert "IFT's adjoint solve runs up to 64 anderson steps" in grad_modes.markdown(table)
    assert "IFT's adjoint solve: up to 64 anderson steps to 0.0001." in write_card.grad_mode_section([table])


def test_warm_started_modes_continue_one_shared_run_within_the_same_cpu_budget(tmp_path):
    threads = torch.get_num_threads()
    try:
        table = grad_modes.main(["--out", str(tmp_path), "--modes", "ift", "--cpu-seconds", "1.0",
                                 "--warm-start-seconds", "0.5", "--deq-max-iter", "3", "--pool", "30",
                                 "--eval-size", "10", "--config", json.dumps(
                                     {"h_cycles": 2, "l_cycles": 2, "hidden_size": 16, "num_heads": 2})])
    finally:
        torch.set_num_threads(threads)
    warm, ift = table["rows"]
    assert (warm["mode"], ift["mode"]) == ("warm-up", "ift")
    run = json.loads((tmp_path / "ift" / "run.json").read_text())
    assert run["args"]["init_from"] == str(tmp_path / "warm-up" / "checkpoint")
    assert run["config"]["grad_mode"] == "deq" and run["config"]["deq"]["f_max_iter"] == 3
    warm_log = grad_modes.final_record(tmp_path / "warm-up")
    own_log = grad_modes.final_record(tmp_path / "ift")
    assert warm["steps"] == warm_log["step"] > 0 and ift["steps"] == warm_log["step"] + own_log["step"]
    assert ift["cpu_s"] == pytest.approx(warm_log["cpu_s"] + own_log["cpu_s"], abs=0.1)
    assert 1.0 <= ift["f_calls"] <= 3.0 and 0.0 <= ift["converged"] <= 1.0  # the forward cap held
    # the row's solve figures are those of one direct call on the scored puzzles
    from deqzoo.models.reasoner import ReasonerForGridClassification
    from examples.reasoner.puzzles import load_heldout

    model = ReasonerForGridClassification.from_pretrained(tmp_path / "ift" / "checkpoint").eval()
    model.set_deq(on_nonconvergence="ignore")
    scored = torch.from_numpy(load_heldout("sudoku6_heldout")["inputs"][:10].astype("int64"))
    with torch.no_grad():
        stats = model(scored).deq_stats
    assert ift["converged"] == round(float(stats.converged.float().mean()), 4)
    assert ift["f_calls"] == round(float(stats.nfe_per_sample.float().mean()), 2)
    assert "converged" not in warm
    rows = grad_modes.markdown(table).splitlines()
    assert "the first 0.5 are one shared" in rows[0] and "up to 3 cycles" in rows[0]
    assert rows[4].startswith("| warm-up |") and rows[4].endswith("| – | – |")
    with pytest.raises(SystemExit):
        grad_modes.parse(["--out", "x", "--cpu-seconds", "10", "--warm-start-seconds", "10"])


def test_the_published_card_gives_the_committed_gradient_mode_tables_as_the_writer_does():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    tables = [json.loads((root / "examples/reasoner/results" / f"{n}.json").read_text())
              for n in ("grad_modes_300s", "grad_modes_warm_300s", "grad_modes_warm32_300s",
                        "grad_modes_warm32_adjoint_300s")]
    section = write_card.grad_mode_section(tables)
    card = (root / "model_cards/trm-sudoku6/README.md").read_text()
    assert section in card
    assert "**From a random start** (300 CPU-s each)" in section and "up to 2 cycles" in section
    assert "run of 150 CPU-s" in section and "up to 8 cycles forward" in section
    assert "| ift | 85.8 | 95.6 | 1521 | 300 | 74.6 | 2.8 |" in section  # from the warm JSON's row
    assert "up to 32 cycles forward" in section
    assert "| ift | 83.8 | 96.6 | 1399 | 301 | 85.4 | 5.5 |" in section
    assert section.count("IFT's adjoint solve: up to 8 fixed_point steps to 0.0001") == 3
    assert "IFT's adjoint solve: up to 64 anderson steps to 0.0001." in section
    assert "| ift | 95.0 | 98.3 | 1324 | 302 | 95.2 | 2.5 |" in section
    assert write_card.grad_mode_section([]) == ""


@pytest.mark.parametrize("name", ["examples.reasoner.sudoku", "examples.reasoner.sudoku9"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_demo_counts_what_evaluate_counts(runs):
    from deqzoo.models.reasoner import ReasonerForGridClassification

    _, out = runs
    model = ReasonerForGridClassification.from_pretrained(out["reasoner"][0] / "checkpoint")
    line, stats = sudoku.demo(model)
    solved = round(100 * sudoku.evaluate(model, limit=100, progress=False)["exact_1x"])
    assert line.metric == f"{solved}/100 solved" and "held-out" in str(line)
    assert stats is None  # last_cycle: no fixed-point solve to report


def test_final_weights_without_trainer_state_take_the_counters_from_the_log(runs, tmp_path):
    """The committed final weights of a finished run have no trainer_state.safetensors: the card reads the
    step and CPU time from the log's final record only when told to, and says where the puzzle count is
    from when that record has none (logs written before train.py added it)."""
    root, out = runs
    src, _ = out["reasoner"]
    folder = tmp_path / "run"
    (folder / "checkpoint").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (folder / "checkpoint" / name).write_bytes((src / "checkpoint" / name).read_bytes())
    (folder / "run.json").write_text((src / "run.json").read_text())
    records = [json.loads(x) for x in (src / "log.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["final"] and final["puzzles"] == write_card.Run(src).puzzles  # train.py logs the count
    with pytest.raises(FileNotFoundError, match="--counters-from-log"):
        write_card.Run(folder)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = write_card.Run(folder, counters_from_log=True)
    assert (run.step, run.cpu_s, run.puzzles, run.puzzles_step) == (final["step"], final["cpu_s"],
                                                                    final["puzzles"], None)
    old = records[:-1] + [{k: v for k, v in final.items() if k != "puzzles"}]
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    run = write_card.Run(folder, counters_from_log=True)
    last = [r for r in records[:-1] if "puzzles" in r][-1]
    assert (run.puzzles, run.puzzles_step) == (last["puzzles"], last["step"])
    assert run.puzzles_text() == (f"{last['puzzles']:,} puzzles drawn by step {last['step']:,}, the last "
                                  "logged count")
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    with pytest.raises(ValueError, match="no final record"):
        write_card.Run(folder, counters_from_log=True)
