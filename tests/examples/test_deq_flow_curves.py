"""examples/deq_flow/train.py --keep-every and examples/deq_flow/curves.py (issue #32): the long runs keep
weights-only snapshots that an interrupted and resumed run writes exactly as an uninterrupted one, and the
curves are `flow.evaluate` of those snapshots at the cards' settings, cached per snapshot."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import deqzoo
from deqzoo.configuration_utils import ConfigError
from examples.deq_flow import curves
from examples.deq_flow.flow import epe, evaluate, synthetic_batch
from examples.deq_flow.make_cards import INFERENCE_DEQ, _curve_section, _deq_recipe, _log
from examples.deq_flow.train import main as train

TINY = ["--steps", "4", "--batch-size", "1", "--keep-every", "2", "--save-every", "2", "--log-every", "2",
        "--no-progress"]


def _run(out, model="deq-flow-cpu-synth", *extra):
    assert train(["--model", model, "--out", str(out), *TINY, *extra]) == 0


def _weights(snapshot):
    return load_file(str(snapshot / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted DEQ-Flow run of 4 steps and a RAFT-twin run of 2, snapshots every 2 steps."""
    root = tmp_path_factory.mktemp("runs")
    _run(root / "deq")
    assert train(["--model", "deq-flow-cpu-raft-baseline", "--out", str(root / "raft"), *TINY,
                  "--steps", "2"]) == 0
    return root


def test_snapshots_of_an_interrupted_and_resumed_run_equal_the_uninterrupted_ones(tmp_path, runs):
    whole = runs / "deq"
    _run(tmp_path / "split", "deq-flow-cpu-synth", "--stop-after", "2")  # a killed session's leftover: step 2
    split = tmp_path / "split" / "snapshots"
    assert sorted(p.name for p in split.iterdir()) == ["step-000000", "step-000002"]
    assert not (tmp_path / "split" / "model").exists()  # stopped early: no final model yet
    kept = (split / "step-000002" / "model.safetensors").stat().st_mtime_ns
    _run(tmp_path / "split")  # rerunning the same command resumes at step 2
    names = ["step-000000", "step-000002", "step-000004"]
    for run in (whole, tmp_path / "split"):
        assert sorted(p.name for p in (run / "snapshots").iterdir()) == names
    assert (split / "step-000002" / "model.safetensors").stat().st_mtime_ns == kept  # never rewritten
    for name in names:
        a, b = _weights(whole / "snapshots" / name), _weights(split / name)
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), name
        meta = json.loads((split / name / "snapshot.json").read_text())
        assert meta["step"] == int(name[-6:])
        assert set(meta) == {"step", "elapsed", "model_seconds", "cpu_seconds"}
    cpu = [json.loads((split / n / "snapshot.json").read_text())["cpu_seconds"] for n in names]
    assert cpu[0] == 0 < cpu[1] < cpu[2]  # CPU time carried over the resume, not restarted
    first, last = _weights(split / "step-000000"), _weights(split / "step-000004")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # training moved the weights
    # the rerun resumed after step 2's line; a killed session's lines past its checkpoint (here: a stale
    # step 4 logged before the rerun's) count once, the later line, in the cards' training curves
    log = tmp_path / "split" / "log.jsonl"
    lines = log.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 4]
    log.write_text("\n".join([lines[0], lines[1].replace('"loss"', '"stale": 1, "loss"'), lines[1]]) + "\n")
    assert [(e["step"], "stale" in e) for e in _log(tmp_path / "split")] == [(2, False), (4, False)]
    final = load_file(str(tmp_path / "split" / "model" / "model.safetensors"))
    assert all(torch.equal(final[k], last[k]) for k in final)  # the last snapshot is the final model


def test_curves_equal_a_direct_evaluate_of_each_snapshot_and_are_cached(tmp_path, runs, monkeypatch, capsys):
    out = tmp_path / "curves"
    args = [str(runs / "deq"), str(runs / "raft"), "--names", "deq", "raft", "--limit", "2"]
    args += ["--out", str(out)]
    assert curves.main(args) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [r["step"] for r in report["common_steps"]] == [0, 2]  # the steps both runs have
    for name, model, steps in (("deq", "deq-flow-cpu-synth", [0, 2, 4]),
                               ("raft", "deq-flow-cpu-raft-baseline", [0, 2])):
        points = report["curves"][name]
        assert [p["step"] for p in points] == steps
        for point in points:
            # the reference: the preset built afresh, the snapshot's tensors loaded, the card's solver set
            snap = runs / name / "snapshots" / f"step-{point['step']:06d}"
            ref = deqzoo.create_model(model)
            ref.load_state_dict(load_file(str(snap / "model.safetensors")))
            if model == "deq-flow-cpu-synth":
                ref.set_deq(**INFERENCE_DEQ)
                assert ref.config.deq["f_tol"] == 5e-3 and ref.config.deq["f_max_iter"] == 24
            direct = evaluate(ref, limit=2, progress=False, baselines=False)
            assert {k: point[k] for k in direct} == direct
    printed = capsys.readouterr().out
    row = report["common_steps"][-1]
    assert f"| 2 | {row['deq']:.4f} | {row['raft']:.4f} |" in printed

    # the cards' section: the rows at every 2nd step (here: all) and the last, the report's numbers
    section = _curve_section(report, every=2)
    for r in report["common_steps"]:
        assert f"| {r['step']} | {r['deq']:.4f} | {r['raft']:.4f} |" in section
    assert "(first 2)" in section and "![held-out EPE vs steps](curves.png)" in section

    def no_evaluation(*a, **k):
        raise AssertionError("a cached snapshot was evaluated again")

    monkeypatch.setattr(curves, "evaluate", no_evaluation)
    assert curves.main(args) == 0  # every snapshot cached: nothing evaluated
    assert json.loads(out.with_suffix(".json").read_text())["curves"] == report["curves"]


def test_max_shift_and_size_train_and_score_on_other_pairs(tmp_path, runs):
    """train.py --max-shift draws the training pairs with it (recorded in run.json; another value refused on
    resume); curves.py --max-shift / --size score held-out pairs drawn with them, cached apart."""
    _run(tmp_path / "big", "deq-flow-cpu-raft-baseline", "--steps", "2", "--max-shift", "16")
    assert json.loads((tmp_path / "big" / "run.json").read_text())["max_shift"] == 16
    default, big = _weights(runs / "raft" / "model"), _weights(tmp_path / "big" / "model")
    assert any(not torch.equal(default[k], big[k]) for k in default)  # other pairs, other weights
    with pytest.raises(SystemExit, match="max_shift"):
        _run(tmp_path / "big", "deq-flow-cpu-raft-baseline", "--steps", "2", "--max-shift", "8")
    for bad in ("-1", "64", "nan"):  # refused before any folder is made
        with pytest.raises(SystemExit):
            _run(tmp_path / "bad", "deq-flow-cpu-raft-baseline", "--max-shift", bad)
        assert not (tmp_path / "bad").exists()
    out = tmp_path / "curves"
    assert curves.main([str(tmp_path / "big"), "--limit", "2", "--max-shift", "16", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["max_shift"] == 16
    point = report["curves"]["big"][-1]
    ref = deqzoo.create_model("deq-flow-cpu-raft-baseline")
    ref.load_state_dict(load_file(str(tmp_path / "big" / "snapshots" / "step-000002" / "model.safetensors")))
    image1, image2, gt, valid = synthetic_batch(range(2), (64, 64), "held-out", max_shift=16)
    with torch.no_grad():
        assert point["epe_held_out"] == round(epe(ref.eval()(image1, image2).flow, gt, valid), 4)
    # --size: held-out pairs of another size (a run trained at train.py --size), cached apart
    sized = tmp_path / "sized"
    args = [str(tmp_path / "big"), "--limit", "2", "--size", "72", "72", "--out", str(sized)]
    assert curves.main(args) == 0
    point = json.loads(sized.with_suffix(".json").read_text())["curves"]["big"][-1]
    image1, image2, gt, valid = synthetic_batch(range(2), (72, 72), "held-out")
    with torch.no_grad():
        assert point["epe_held_out"] == round(epe(ref(image1, image2).flow, gt, valid), 4)
    cache = json.loads((tmp_path / "big" / "snapshots" / "step-000002" / curves.CACHE).read_text())
    keys = [json.loads(k) for k in cache]
    assert [(k.get("max_shift"), k.get("size")) for k in keys] == [(16, None), (None, [72, 72])]


def test_config_overrides_change_the_model_are_recorded_and_bad_ones_are_refused_before_any_folder(tmp_path):
    """train.py --config (the wide pair of issue #32; narrower here, to stay fast): the snapshots are that
    model, run.json records it, a resume with another --config is refused; an unknown key, a wrong value or a
    key that has its own option is refused before the run folder exists."""
    wide = {"hidden_dim": 24, "context_dim": 24}
    _run(tmp_path / "wide", "deq-flow-cpu-raft-baseline", "--steps", "2", "--config", json.dumps(wide))
    assert json.loads((tmp_path / "wide" / "run.json").read_text())["config"] == wide
    snap = tmp_path / "wide" / "snapshots" / "step-000002"
    assert json.loads((snap / "config.json").read_text())["hidden_dim"] == 24
    loaded = deqzoo.from_pretrained(str(snap))
    assert loaded.config.hidden_dim == 24 and loaded.config.context_dim == 24
    assert sum(p.numel() for p in loaded.parameters()) < sum(
        p.numel() for p in deqzoo.create_model("deq-flow-cpu-raft-baseline").parameters())
    with pytest.raises(SystemExit, match="config"):
        _run(tmp_path / "wide", "deq-flow-cpu-raft-baseline", "--steps", "2",
             "--config", '{"hidden_dim": 32}')
    for bad, err in (('{"hiden_dim": 24}', "unknown key 'hiden_dim'"), ('{"hidden_dim": 0}', "hidden_dim"),
                     ('{"flow_residual_weight": 1}', None), ('[1]', None)):
        with pytest.raises(ConfigError if err else SystemExit, match=err):
            _run(tmp_path / "bad", "deq-flow-cpu-raft-baseline", "--config", bad)
        assert not (tmp_path / "bad").exists()


def test_curves_refuses_a_folder_without_snapshots_and_a_foreign_report(tmp_path):
    with pytest.raises(FileNotFoundError, match="keep-every"):
        curves.snapshots(tmp_path)
    (tmp_path / "mine.json").write_text("{}")
    with pytest.raises(SystemExit):
        curves.main([str(tmp_path), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine.json").read_text() == "{}"


def test_a_rerun_with_another_recipe_is_refused(runs, capsys):
    before = sorted(p.name for p in (runs / "deq" / "snapshots").iterdir())
    with pytest.raises(SystemExit, match="steps: 4.*now steps: 6"):
        train(["--model", "deq-flow-cpu-synth", "--out", str(runs / "deq"), *TINY, "--steps", "6"])
    with pytest.raises(SystemExit, match="deq"):
        train(["--model", "deq-flow-cpu-synth", "--out", str(runs / "deq"), *TINY,
               "--deq", '{"n_states": 6}'])
    assert sorted(p.name for p in (runs / "deq" / "snapshots").iterdir()) == before


def test_card_recipe_names_the_runs_correction_states():
    assert "iterations 8, 16 and 24 " in _deq_recipe({"deq": {}})  # the preset: the embedded checkpoint's
    six = _deq_recipe({"deq": {"n_states": 6}})
    assert "iterations 4, 8, 12, 16, 20 and 24 " in six and "at most 24 steps" in six
    stage2 = _deq_recipe({"deq": {}, "steps": 600, "lr": 2e-4, "flow_residual_weight": 2}, {"steps": 1600})
    assert stage2.startswith("Stage 1 (1600 steps)") and "iterations 8, 16 and 24 " in stage2


def _without_section(text):
    """A card's text with a long-run section cut out by plain slicing (the card as make_cards wrote it)."""
    if curves.SECTION_START not in text:
        return text
    i, j = text.index(curves.SECTION_START), text.index(curves.SECTION_END) + len(curves.SECTION_END)
    assert text[j:j + 2] == "\n\n"
    return text[:i] + text[j + 2:]


def test_cards_section_is_inserted_once_replaced_in_place_and_nothing_else_changes(tmp_path, runs):
    # DEQ-Flow's run and a twin under its recipe (4 steps), their last snapshot (step 4) not there yet, and
    # a copy of a real card
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    copies = tmp_path / "runs"
    shutil.copytree(runs / "deq", copies / "deq")
    _run(copies / "raft", "deq-flow-cpu-raft-baseline")
    for name in ("deq", "raft"):
        shutil.move(copies / name / "snapshots" / "step-000004", tmp_path / f"later-{name}")
    card = tmp_path / "card"
    card.mkdir()
    original = _without_section((root / "model_cards/deq-flow-cpu-raft-baseline/README.md").read_text())
    (card / "README.md").write_text(original)
    (card / "model.safetensors").write_bytes(b"the published weights")
    out = tmp_path / "curves"
    args = [str(copies / "deq"), str(copies / "raft"), "--names", "DEQ-Flow", "RAFT twin", "--limit", "2",
            "--out", str(out), "--cards", str(card)]

    def check(steps):
        text = (card / "README.md").read_text()
        assert text.count(curves.SECTION_START) == 1 and text.count(curves.SECTION_END) == 1
        assert _without_section(text) == original  # the rest of the card byte for byte
        assert text.index(curves.SECTION_END) < text.index("\n## Results\n")
        section = text[text.index(curves.SECTION_START):text.index(curves.SECTION_END)]
        report = json.loads(out.with_suffix(".json").read_text())
        assert [r["step"] for r in report["common_steps"]] == steps
        for r in report["common_steps"]:  # every common snapshot, both EPEs and their difference
            a, b = r["DEQ-Flow"], r["RAFT twin"]
            assert f"| {r['step']} | {a:.4f} | {b:.4f} | {a - b:+.4f} |" in section
        for name, folder, total in (("DEQ-Flow", "deq", 4), ("RAFT twin", "raft", 4)):
            last = json.loads(max((copies / folder / "snapshots").glob("step-*/snapshot.json")).read_text())
            assert report["curves"][name][-1]["step"] == last["step"]  # how far each run got, and its hours
            assert (f"{name}: step {last['step']:,} of {total:,}, {last['elapsed'] / 3600:.2f} h wall clock, "
                    f"{last['cpu_seconds'] / 3600:.2f} h CPU") in section
        assert "NOT from these runs" in section and "still in progress" in section
        assert "iterations 8, 16 and 24 " in section and "batch 1 of 64x64" in section  # the runs' run.json
        assert "--cards" in section and "$RUNS/deq $RUNS/raft" in section
        assert (card / curves.SECTION_PNG).read_bytes() == out.with_suffix(".png").read_bytes()
        assert f"![held-out EPE vs steps]({curves.SECTION_PNG})" in section  # not the card's own curves.png
        assert (card / "model.safetensors").read_bytes() == b"the published weights"
        return text

    assert curves.main(args) == 0
    first = check([0, 2])
    assert curves.main(args) == 0  # the same snapshots: the same bytes
    assert (card / "README.md").read_text() == first
    for name in ("deq", "raft"):  # the runs reach step 4: the rerun replaces the section in place
        shutil.move(tmp_path / f"later-{name}", copies / name / "snapshots" / "step-000004")
    assert curves.main(args) == 0
    assert check([0, 2, 4]) != first
    assert sorted(p.name for p in card.iterdir()) == ["README.md", curves.SECTION_PNG, "model.safetensors"]

    # with an operating_point.py report: its subsection and the command that writes it join the section
    from examples.deq_flow import operating_point as op

    op_report = op.analyse(copies / "deq", copies / "raft", [2], val_pairs=2, rounds=1, limit=2)
    op_path = tmp_path / "op.json"
    op_path.write_text(json.dumps(op_report))
    assert curves.main([*args, "--operating-point", str(op_path)]) == 0
    text = check([0, 2, 4])
    section = text[text.index(curves.SECTION_START):text.index(curves.SECTION_END)]
    assert op.card_subsection(op_report) in section
    assert "examples/deq_flow/operating_point.py $RUNS/deq $RUNS/raft --out" in section
    for r in op_report["rows"]:
        twin = r["twin"]
        cell = f"{twin['val']:.4f} / {twin['held_out']:.4f} / {twin['motorcycle']:.4f}"
        assert f"| {r['step']} | {cell} |" in section
    with pytest.raises(SystemExit):  # the report goes into cards only
        curves.main([*args[:args.index("--cards")], "--operating-point", str(op_path)])


def test_cards_section_refuses_a_missing_card_and_a_card_that_cannot_take_it_before_writing(tmp_path, runs):
    good, bare, finished = tmp_path / "good", tmp_path / "bare", tmp_path / "finished"
    cards = ((good, "# card\n\nbody\n\n## Results\n\nx\n"), (bare, "# card\n\nno results heading\n"),
             (finished, "# card\n\n## Results\n"))
    for card, text in cards:
        card.mkdir()
        (card / "README.md").write_text(text)
    (finished / curves.SECTION_PNG).write_bytes(b"the finished runs' plot")
    out = tmp_path / "curves"
    base = [str(runs / "deq"), str(runs / "raft"), "--limit", "2", "--out", str(out), "--cards", str(good)]
    with pytest.raises(FileNotFoundError, match=r"missing/README\.md: no model card"):
        curves.main([*base, str(tmp_path / "missing")])
    with pytest.raises(ValueError, match=r"bare/README\.md: no long-run section markers.*## Results"):
        curves.main([*base, str(bare)])
    with pytest.raises(FileExistsError, match=r"finished/long_runs\.png exists"):
        curves.main([*base, str(finished)])
    (bare / "README.md").write_text(f"{curves.SECTION_START}\n{curves.SECTION_START}\n{curves.SECTION_END}\n")
    with pytest.raises(ValueError, match="2 start and 1 end markers"):
        curves.main([*base, str(bare)])
    # refused before any evaluation or write: no report, no card changed, no plot copied
    assert not out.with_suffix(".json").exists()
    assert (good / "README.md").read_text() == "# card\n\nbody\n\n## Results\n\nx\n"
    assert sorted(p.name for p in good.iterdir()) == ["README.md"]
    assert (finished / curves.SECTION_PNG).read_bytes() == b"the finished runs' plot"


def test_cards_section_needs_one_recipe_and_two_runs():
    point = {"step": 0, "elapsed": 1.0, "cpu_seconds": 1.0, "epe_held_out": 5.0}
    recipe = {"model": "deq-flow-cpu-synth", "steps": 10, "batch_size": 8, "size": [64, 64], "lr": 4e-4,
              "weight_decay": 1e-4, "clip": 1.0, "seed": 0, "deq": {"n_states": 6}}
    report = {"curves": {"a": [point], "b": [point]}, "limit": None,
              "common_steps": [{"step": 0, "a": 5.0, "b": 5.0}],
              "recipes": {"a": recipe, "b": {**recipe, "model": "deq-flow-cpu-raft-baseline", "deq": {}}}}
    assert "| 0 | 5.0000 | 5.0000 | +0.0000 |" in curves.progress_section(report, "cmd")
    report["recipes"]["b"]["lr"] = 2e-4
    with pytest.raises(ValueError, match=r"differ in \['lr'\]: not one recipe"):
        curves.progress_section(report, "cmd")
    with pytest.raises(ValueError, match="two runs"):
        curves.progress_section({**report, "curves": {"a": [point]}}, "cmd")


def test_operating_point_choice_rule():
    from examples.deq_flow.operating_point import choose

    val = {6: 2.0, 8: 1.9, 12: 1.8, 24: 1.7}
    assert choose(val, {6: 0.6, 8: 0.8, 12: 1.05, 24: 2.0}) == 8  # the best k costing at most the twin's time
    assert choose(val, {6: 0.6, 8: 0.8, 12: 1.0, 24: 2.0}) == 12  # "no more" includes equal
    assert choose({6: 1.9, 8: 1.9}, {6: 0.5, 8: 0.7}) == 6  # a tie goes to the cheaper k
    assert choose(val, {6: 1.1, 8: 1.2, 12: 1.3, 24: 2.0}) is None


def test_operating_point_numbers_equal_an_independent_evaluation_and_are_cached(tmp_path, runs, monkeypatch):
    from examples.deq_flow import operating_point as op

    report = op.analyse(runs / "deq", runs / "raft", [2, 3], val_pairs=3, rounds=1, limit=2)
    assert report["steps"] == [0, 2] and report["iters"] == [2, 3, 24]  # the card's cap is always included
    image1, image2, flow, valid = synthetic_batch(range(op.VAL_SEED, op.VAL_SEED + 3), (64, 64), "train")
    assert op.VAL_SEED > 8 * 20000  # never a training pair of the long runs (seed 8 s + i)
    for row in report["rows"]:
        snap = f"snapshots/step-{row['step']:06d}"
        twin = deqzoo.create_model("deq-flow-cpu-raft-baseline")
        twin.load_state_dict(load_file(str(runs / "raft" / snap / "model.safetensors")))
        with torch.no_grad():
            expected = epe(twin.eval()(image1, image2).flow, flow, valid)
        assert row["twin"]["val"] == pytest.approx(expected, rel=1e-6)
        for k in (2, 3):
            deq = deqzoo.create_model("deq-flow-cpu-synth")
            deq.load_state_dict(load_file(str(runs / "deq" / snap / "model.safetensors")))
            deq.set_deq(**{**INFERENCE_DEQ, "f_max_iter": k})
            with torch.no_grad():
                out = deq.eval()(image1, image2)
            assert out.deq_stats.nfe <= k
            assert row["deq"][str(k)]["val"] == pytest.approx(epe(out.flow, flow, valid), rel=1e-6)
            held = evaluate(deq, limit=2, progress=False, baselines=False)
            assert row["deq"][str(k)]["held_out"] == held["epe_held_out"]
    ratio, mean = report["timing"]["ratio_to_twin"], report["mean_val_epe"]
    assert report["operating_point"] == op.choose({k: mean[str(k)] for k in report["iters"]},
                                                  {k: ratio[str(k)] for k in report["iters"]})
    k = report["operating_point"]
    assert k is not None  # 2 or 3 fixed-point steps cost far less than the twin's 12 updates
    assert report["steps_at_or_below_twin_val"] == [
        r["step"] for r in report["rows"] if r["deq"][str(k)]["val"] <= r["twin"]["val"]]
    assert f"DEQ-Flow {k} steps val / held-out / motorcycle" in op.table(report)
    rows = report["rows"]
    moto = [r["step"] for r in rows if r["deq"][str(k)]["motorcycle"] <= r["twin"]["motorcycle"]]
    assert f"at or below the twin at {len(moto)} of the 2 steps" in op.card_subsection(report)

    def no_evaluation(*a, **kw):
        raise AssertionError("a cached snapshot was evaluated again")

    monkeypatch.setattr(op, "model_flow", no_evaluation)
    monkeypatch.setattr(curves, "evaluate", no_evaluation)
    monkeypatch.setattr(op, "seconds_per_pair", lambda models, val, rounds: {n: 1.0 for n in models})
    again = op.analyse(runs / "deq", runs / "raft", [2, 3], val_pairs=3, rounds=1, limit=2)
    assert again["rows"] == report["rows"]  # every number from the snapshots' caches


def test_operating_point_refuses_to_overwrite_a_foreign_report(tmp_path, runs):
    from examples.deq_flow import operating_point as op

    (tmp_path / "mine.json").write_text('{"curves": {}}')
    with pytest.raises(SystemExit):
        op.main([str(runs / "deq"), str(runs / "raft"), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine.json").read_text() == '{"curves": {}}'
    (tmp_path / "figure.png").write_bytes(b"a user's figure")  # no report beside it: not ours either
    with pytest.raises(SystemExit):
        op.main([str(runs / "deq"), str(runs / "raft"), "--out", str(tmp_path / "figure")])
    assert (tmp_path / "figure.png").read_bytes() == b"a user's figure"


def _section(text):
    return text[text.index(curves.SECTION_START):text.index(curves.SECTION_END) + len(curves.SECTION_END)]


def _command(section):
    """The words of the regenerate command a cards' section shows (its last bash block, one line)."""
    import shlex

    start = section.rindex("```bash\n") + len("```bash\n")
    return shlex.split(section[start:section.index("\n```", start)])


def test_cards_section_of_stopped_runs_from_their_report_lists_every_later_pair(tmp_path, runs, monkeypatch):
    # the long runs (DEQ-Flow and a twin under one 4-step recipe) and a later report of two more DEQ-Flow
    # runs (one with another peak lr) against that twin
    import shutil

    shutil.copytree(runs / "deq", tmp_path / "deq")
    _run(tmp_path / "raft", "deq-flow-cpu-raft-baseline")
    _run(tmp_path / "deq-lr", "deq-flow-cpu-synth", "--lr", "2e-4")
    long_runs, later = tmp_path / "long", tmp_path / "later"
    assert curves.main([str(tmp_path / "deq"), str(tmp_path / "raft"), "--names", "DEQ-Flow", "RAFT twin",
                        "--limit", "2", "--out", str(long_runs)]) == 0
    assert curves.main([str(tmp_path / "deq-lr"), str(tmp_path / "deq"), str(tmp_path / "raft"), "--names",
                        "lr", "base", "twin", "--limit", "2", "--out", str(later)]) == 0
    card = tmp_path / "card"
    card.mkdir()
    original = "# card\n\nbody\n\n## Results\n\nx\n"
    (card / "README.md").write_text(original)

    def no_evaluation(*a, **k):
        raise AssertionError("--from-report evaluates nothing")

    monkeypatch.setattr(curves, "evaluate_snapshot", no_evaluation)
    args = ["--from-report", str(long_runs.with_suffix(".json")), "--stopped", "the machine went away",
            "--also", str(later.with_suffix(".json")), str(later.with_suffix(".json")), "--cards", str(card)]
    assert curves.main(args) == 0
    text = (card / "README.md").read_text()
    section = _section(text)
    assert text.replace(section + "\n\n", "") == original  # the rest of the card byte for byte
    assert (card / curves.SECTION_PNG).read_bytes() == long_runs.with_suffix(".png").read_bytes()
    assert "stopped: held-out EPE" in section and "in progress" not in section
    assert "Still training" not in section
    assert "will not resume: the machine went away." in section and "**Where they stopped**" in section
    report = json.loads(long_runs.with_suffix(".json").read_text())
    for r in report["common_steps"]:
        a, b = r["DEQ-Flow"], r["RAFT twin"]
        assert f"| {r['step']} | {a:.4f} | {b:.4f} | {a - b:+.4f} |" in section
    # one row per later DEQ-Flow run (the report given twice adds none), at the last step both have, with
    # the options it changed from the long runs' DEQ-Flow
    later_report = json.loads(later.with_suffix(".json").read_text())
    last = {n: pts[-1] for n, pts in later_report["curves"].items()}
    rows = [line for line in section.splitlines() if line.startswith("| lr vs twin") or
            line.startswith("| base vs twin")]
    assert len(rows) == 2
    for name, changed in (("lr", "none / lr 0.0002"), ("base", "none / none")):
        a, b = last[name]["epe_held_out"], last["twin"]["epe_held_out"]
        assert last[name]["step"] == last["twin"]["step"] == 4
        assert (f"| {name} vs twin (`{later.with_suffix('.json')}`) | {changed} | 64x64 | 4 (4) | {a:.4f} | "
                f"{b:.4f} | {a - b:+.4f} |") in section
    # the command the section shows rewrites it byte for byte
    words = _command(section)
    assert words[:3] == ["PYTHONPATH=.", "python", "examples/deq_flow/curves.py"]
    stale = f"{curves.SECTION_START}\nstale\n{curves.SECTION_END}"
    (card / "README.md").write_text(text.replace(section, stale))
    assert curves.main(words[3:]) == 0
    assert (card / "README.md").read_text() == text


def test_from_report_stopped_and_also_are_refused_where_they_mean_nothing(tmp_path, runs):
    out = tmp_path / "curves"
    assert curves.main([str(runs / "deq"), "--limit", "2", "--out", str(out)]) == 0
    report = str(out.with_suffix(".json"))
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("# card\n\n## Results\n")
    for argv in (
        ["--from-report", report, str(runs / "deq"), "--cards", str(card)],  # runs come from the report
        ["--from-report", report, "--limit", "2", "--cards", str(card)],
        ["--from-report", report],  # nothing to write
        [str(runs / "deq"), "--out", str(out), "--stopped", "why"],  # --stopped without cards
        [str(runs / "deq"), "--out", str(out), "--also", report],
        [str(runs / "deq")],  # no --out
    ):
        with pytest.raises(SystemExit):
            curves.main(argv)
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"rows": []}')
    with pytest.raises(SystemExit):
        curves.main(["--from-report", report, "--also", str(foreign), "--cards", str(card)])
    with pytest.raises(ValueError, match=r"foreign\.json is not a curves report"):
        curves._curves_report(foreign)
    with pytest.raises(ValueError, match="run 'deq' needs exactly one RAFT twin"):
        curves.later_pairs({"r": json.loads(out.with_suffix(".json").read_text())}, {})
    assert (card / "README.md").read_text() == "# card\n\n## Results\n"  # nothing written


@pytest.mark.parametrize("card", ["deq-flow-cpu-synth", "deq-flow-cpu-raft-baseline"])
def test_committed_cards_long_run_section_is_what_its_command_writes(tmp_path, card, monkeypatch):
    # the section in the published card is the output of the command it shows, run on the committed reports
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "model_cards" / card / "README.md").read_text()
    section = _section(text)
    words = _command(section)
    assert words[:3] == ["PYTHONPATH=.", "python", "examples/deq_flow/curves.py"] and "--from-report" in words
    cards = words.index("--cards")
    copies = []
    for name in words[cards + 1:]:
        copy = tmp_path / Path(name).name
        copy.mkdir()
        shutil.copyfile(root / name / "README.md", copy / "README.md")
        copies.append(str(copy))
    monkeypatch.chdir(root)
    monkeypatch.setattr(curves, "evaluate_snapshot", lambda *a, **k: pytest.fail("evaluated a snapshot"))
    assert curves.main([*words[3:cards + 1], *copies]) == 0
    written = (tmp_path / card / "README.md").read_text()  # the command names the copies: name the cards
    assert written.replace(" ".join(copies), " ".join(words[cards + 1:])) == text
    published = root / "model_cards" / card / curves.SECTION_PNG
    assert (tmp_path / card / curves.SECTION_PNG).read_bytes() == published.read_bytes()
