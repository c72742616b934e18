"""examples/implicit2/train_long.py: resumable long fits (issue #32). A run interrupted and resumed equals the
uninterrupted run bit for bit; its saved state is safetensors + JSON and a from_pretrained checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.implicit2 import _build
from deqzoo.models.implicit2 import Implicit2ForSignalRepresentation
from examples.implicit2 import fitting
from examples.implicit2 import images as task
from examples.implicit2 import train_long as tl

SIZE = 16


def _state(run):
    state = tl.latest_state(run)
    meta = json.loads((state / "trainer.json").read_text())
    files = ("model", "optimizer", "trainer")
    return (state, *(load_file(str(state / f"{f}.safetensors")) for f in files), meta)


def _assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("network", sorted(tl.NETWORKS))
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(tmp_path, network):
    kw = dict(size=SIZE, save_every=4, eval_every=2, progress=False)
    whole = tl.train(network, tmp_path / "whole", 6, **kw)
    first = tl.train(network, tmp_path / "split", 6, stop_after=3, **kw)  # what SIGTERM after step 3 does
    assert first["step"] == 3 and tl.latest_state(tmp_path / "split").name == "state-000003"
    resumed = tl.train(network, tmp_path / "split", 6, **kw)
    timed = ("train_seconds",)  # wall time differs run to run; everything else is equal floats, not close
    untimed = [{k: v for k, v in r.items() if k not in timed} for r in (resumed, whole)]
    assert untimed[0] == untimed[1]
    assert whole["eval_steps"] == [0, 2, 4, 6] and whole["step"] == 6
    s_whole, s_split = _state(tmp_path / "whole"), _state(tmp_path / "split")
    for a, b in zip(s_whole[1:4], s_split[1:4]):  # weights, Adam moments and steps, cache z*, projector, RNG
        _assert_same_tensors(a, b)
    implicit = tl.NETWORKS[network]["implicit"]
    assert ("cache.z" in s_whole[3]) == implicit
    assert s_whole[4]["history"]["loss"] == s_split[4]["history"]["loss"]
    assert s_whole[4]["history"]["loss"][-1] < s_whole[4]["history"]["loss"][0]
    # only the latest state is kept; a rerun at the target trains nothing and changes nothing
    assert sorted(p.name for p in (tmp_path / "split").iterdir()) == [
        "latest", "psnr.json", "run.json", "state-000006"]
    assert tl.train(network, tmp_path / "split", 6, **kw) == resumed


def test_recipe_is_the_bench_s_and_the_state_is_a_checkpoint(tmp_path):
    """The first steps equal fitting.fit on the bench's model (same seed, data, Adam, reuse, projection), and
    the saved state loads with from_pretrained and evaluates to psnr.json's last value."""
    network = "gabor-imp-1l256d"
    r = tl.train(network, tmp_path / "run", 3, size=SIZE, eval_every=3, progress=False)
    data = task.image_data("camera", SIZE)
    model = _build(tl.setting(network, SIZE), data, 0)
    hist = fitting.fit(model, data.train_coords, data.train_values, 3, progress=False)
    assert r["loss"] == hist["loss"] and r["nfe"] == hist["nfe"]
    loaded = Implicit2ForSignalRepresentation.from_pretrained(tl.latest_state(tmp_path / "run"))
    assert task.evaluate(loaded, progress=False)["psnr"] == round(r["psnr"][-1], 2)
    assert r["psnr"][-1] == tl.evaluate_psnr(model, data)[0]


def test_bad_run_folders_are_clear_errors_and_unfinished_saves_are_ignored(tmp_path):
    kw = dict(size=SIZE, eval_every=2, progress=False)
    run = tmp_path / "run"
    tl.train("siren-imp-1l256d", run, 2, **kw)
    with pytest.raises(ValueError, match="holds another run.*network"):
        tl.train("gabor-imp-1l256d", run, 2, **kw)
    with pytest.raises(ValueError, match="holds another run.*lr"):
        tl.train("siren-imp-1l256d", run, 4, size=SIZE, lr=1e-2, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="not empty and holds no run.json"):
        tl.train("siren-imp-1l256d", other, 2, **kw)
    assert (other / "notes.txt").read_text() == "a user's file"
    with pytest.raises(ValueError, match="unknown network"):
        tl.setting("siren-imp-9l", SIZE)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        tl.train("siren-imp-1l256d", run, 0, **kw)
    # a save interrupted before `latest` moved: its folder is not read, the next save replaces it
    (run / "state-000004.tmp").mkdir()
    (run / "state-000004.tmp" / "model.safetensors").write_bytes(b"half a file")
    r = tl.train("siren-imp-1l256d", run, 4, **kw)
    assert r["step"] == 4 and not (run / "state-000004.tmp").exists()
    # an incomplete state folder named by latest is an error naming what is missing
    (run / tl.latest_state(run).name / "optimizer.safetensors").unlink()
    with pytest.raises(ValueError, match="missing optimizer.safetensors"):
        tl.train("siren-imp-1l256d", run, 6, **kw)


def test_input_scale_factor_scales_the_filters_frequencies_and_is_part_of_the_run(tmp_path):
    """--input-scale-factor multiplies the original's per-pixel frequency scale in the built model (its
    first-layer weights are the factor times the unscaled ones: same seed), is recorded in run.json, and a
    resume with another factor is refused; a run.json written before the key existed resumes at factor 1."""
    base = tl.setting("siren-imp-1l256d", SIZE)
    scaled = tl.setting("siren-imp-1l256d", SIZE, input_scale_factor=4)
    assert scaled["input_scale"] == 4 * base["input_scale"]
    data = task.image_data("camera", SIZE)
    w1 = _build(base, data, 0).base_model.init_filter.x_map.weight
    w4 = _build(scaled, data, 0).base_model.init_filter.x_map.weight
    torch.testing.assert_close(w4, 4 * w1)
    kw = dict(size=SIZE, eval_every=2, progress=False)
    run = tmp_path / "run"
    tl.train("siren-imp-1l256d", run, 2, input_scale_factor=4, **kw)
    assert json.loads((run / "run.json").read_text())["input_scale_factor"] == 4.0
    assert Implicit2ForSignalRepresentation.from_pretrained(str(tl.latest_state(run))).config.input_scale == (
        scaled["input_scale"])
    with pytest.raises(ValueError, match="holds another run.*input_scale_factor"):
        tl.train("siren-imp-1l256d", run, 4, **kw)
    with pytest.raises(ValueError, match="input_scale_factor must be a number"):
        tl.setting("siren-imp-1l256d", SIZE, input_scale_factor=0)
    old = tmp_path / "old"
    tl.train("siren-imp-1l256d", old, 2, **kw)
    record = json.loads((old / "run.json").read_text())
    del record["input_scale_factor"]  # as the runs started before the option
    (old / "run.json").write_text(json.dumps(record))
    assert tl.train("siren-imp-1l256d", old, 4, **kw)["step"] == 4


def test_plot_draws_every_run_and_reports_the_first_step_at_the_target(tmp_path):
    runs = []
    for network in ("siren-imp-1l256d", "siren-exp-4l256d"):
        tl.train(network, tmp_path / network, 4, size=SIZE, eval_every=2, progress=False)
        runs.append(tmp_path / network)
    rows = tl.plot(runs, tmp_path / "curve.png", target=10.0)
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert [r["network"] for r in rows] == ["siren-imp-1l256d", "siren-exp-4l256d"]
    for r, run in zip(rows, runs):
        p = json.loads((run / "psnr.json").read_text())
        first = next((s for s, v in zip(p["eval_steps"], p["psnr"]) if v >= 10.0), None)
        assert r["first_step_at_10dB"] == first and r["step"] == 4 and r["psnr"] == p["psnr"][-1]
        assert r["input_scale_factor"] == 1.0
    tl.train("siren-imp-1l256d", tmp_path / "x4", 2, size=SIZE, eval_every=2, progress=False,
             input_scale_factor=4)
    assert tl.plot([tmp_path / "x4"], tmp_path / "x4.png")[0]["input_scale_factor"] == 4.0
    with pytest.raises(ValueError, match="no psnr.json"):
        tl.plot([tmp_path], tmp_path / "x.png")


def test_make_cards_long_mode_writes_the_card_from_the_latest_state_with_the_twin_curve(tmp_path):
    from deqzoo.hub.cards import read_model_card
    from examples.implicit2 import make_cards

    runs, cards = tmp_path / "runs", tmp_path / "cards"
    for network in ("siren-imp-1l256d", "siren-exp-4l256d"):
        tl.train(network, runs / network, 4, size=SIZE, eval_every=2, progress=False)
    assert make_cards.main(["--long", str(runs), "--cards-dir", str(cards)]) == 0
    assert not (cards / "implicit2-igabor-mfn-camera").exists()  # no Gabor run: skipped
    card = cards / "implicit2-isiren-camera"
    imp = json.loads((runs / "siren-imp-1l256d" / "psnr.json").read_text())
    exp = json.loads((runs / "siren-exp-4l256d" / "psnr.json").read_text())
    state = tl.latest_state(runs / "siren-imp-1l256d")
    assert (card / "model.safetensors").read_bytes() == (state / "model.safetensors").read_bytes()
    meta, _ = read_model_card(card)
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    psnr = next(m["value"] for m in metrics if m["type"] == "psnr")
    # the card's number is what the checkpoint gives as shipped (ImpSq's 1e-3, not training's 1e-2): what
    # `deqzoo eval` prints, recomputed here from the card folder
    from deqzoo.models.implicit2 import Implicit2ForSignalRepresentation
    from examples.implicit2.images import evaluate

    shipped = Implicit2ForSignalRepresentation.from_pretrained(card)
    assert shipped.config.deq_config.f_tol == make_cards.CARD_EVAL_TOL
    assert psnr == evaluate(shipped, progress=False)["psnr"]
    assert abs(psnr - imp["psnr"][-1]) < 0.5  # the training log's last value, at the looser tolerance
    text = (card / "README.md").read_text()
    for st in (2, 4):  # the side-by-side curve at the common evaluated steps
        a, b = imp["psnr"][imp["eval_steps"].index(st)], exp["psnr"][exp["eval_steps"].index(st)]
        assert f"| {st} | {a:.2f} | {b:.2f} | {a - b:+.2f} |" in text
    assert "train_long train siren-imp-1l256d --steps 4" in text
    with pytest.raises(SystemExit):
        make_cards.main(["--cards-dir", str(cards)])  # neither a bench folder nor --long


def test_make_cards_long_mode_states_a_scaled_recipe_and_the_replaced_checkpoint(tmp_path):
    """A card from runs at another frequency scale says so (recipe, input scale, the train commands' flag)
    and notes the checkpoint it replaced; at factor 1 none of that text appears."""
    from examples.implicit2 import make_cards

    for factor, runs in ((4, tmp_path / "x4"), (1, tmp_path / "x1")):
        for network in ("siren-imp-1l256d", "siren-exp-4l256d"):
            tl.train(network, runs / network, 2, size=SIZE, eval_every=2, progress=False,
                     input_scale_factor=factor)
        cards = tmp_path / f"cards{factor}"
        assert make_cards.main(["--long", str(runs), "--cards-dir", str(cards)]) == 0
        text = (cards / "implicit2-isiren-camera" / "README.md").read_text()
        scale = tl.setting("siren-imp-1l256d", SIZE, input_scale_factor=factor)["input_scale"]
        scaled = [f"Recipe (the original's, at {factor}x its frequency scale)",
                  f"--eval-every 25 --input-scale-factor {factor} --out RUNS/siren-imp-1l256d",
                  f"--eval-every 25 --input-scale-factor {factor} --out RUNS/siren-exp-4l256d",
                  "This checkpoint replaced an earlier one",
                  f"input scale {scale:g} / sqrt(2) at {SIZE} px"]
        for phrase in scaled[:4]:
            assert (phrase in text) == (factor != 1), phrase
        assert scaled[4] in text


@pytest.mark.extended  # two evaluations at 256² (~10 s on a free core, 35 s on the shared machine)
def test_make_cards_rewrites_the_embedded_cards_byte_for_byte_from_the_committed_records(tmp_path):
    """The embedded cards come from long fits (--long); rebuilt from the committed records (run.json and the
    trainer.json of the state used) and the embedded checkpoints, they regenerate unchanged, evaluation
    included (a card's numbers are what `deqzoo eval` prints)."""
    from examples.implicit2 import make_cards

    names = [name for name, *_ in make_cards.CARDS.values()]
    assert make_cards.main(["--records", "--cards-dir", str(tmp_path)]) == 0
    for name in names:
        want = (make_cards.ROOT / "model_cards" / name / "README.md").read_text()
        assert (tmp_path / name / "README.md").read_text() == want


def test_a_resumed_run_keeps_its_own_solver_settings_when_the_defaults_change(tmp_path, monkeypatch):
    """A run continues with the config it saved (e.g. f_tol 1e-2), even if the code's defaults moved (a
    later checkout building the network with another tolerance): the result equals the uninterrupted run."""
    network, kw = "gabor-imp-1l256d", dict(size=SIZE, eval_every=2, progress=False)
    whole = tl.train(network, tmp_path / "whole", 4, **kw)
    tl.train(network, tmp_path / "split", 4, stop_after=2, **kw)
    build = tl._build

    def moved_defaults(setting, data, seed):
        model = build(setting, data, seed)
        model.set_deq(f_tol=1e-6)  # what a changed default tolerance would build
        return model

    monkeypatch.setattr(tl, "_build", moved_defaults)
    resumed = tl.train(network, tmp_path / "split", 4, **kw)
    assert resumed["loss"] == whole["loss"] and resumed["psnr"] == whole["psnr"]
    assert resumed["nfe"] == whole["nfe"]
