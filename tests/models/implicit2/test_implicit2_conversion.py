"""The ImpSq converter reproduces the original implementation's outputs on committed fixtures (produced
once by
running locuslab/ImpSq's modules on CPU outside the repo; see conversion/fixtures/implicit2/README.md)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conversion import converter_module
from deqzoo.models.implicit2 import Implicit2ForSignalRepresentation

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "conversion" / "fixtures" / "implicit2"
TIGHT = {"f_solver": "fixed_point", "f_max_iter": 2000, "f_tol": 1e-7}


@pytest.mark.parametrize(
    "tag, implicit, kind, layers",
    [
        ("siren_like_1l_implicit", True, "siren", 1),
        ("gabor_1l_implicit", True, "gabor", 1),
        ("fourier_2l_explicit", False, "fourier", 2),
    ],
)
def test_converted_model_reproduces_the_original(tmp_path, tag, implicit, kind, layers):
    io = load_file(FIX / f"impsq_{tag}_io.safetensors")
    convert = converter_module("implicit2_impsq").FORMATS["implicit2-impsq"]
    out = convert(FIX / f"impsq_{tag}_state_dict.pt", tmp_path / "conv", implicit=implicit, deq=TIGHT)
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    model = Implicit2ForSignalRepresentation.from_pretrained(out).eval()
    assert (model.config.filter_type, model.config.num_layers, model.config.implicit) == (
        kind,
        layers,
        implicit,
    )
    with torch.no_grad():
        res = model(io["coords"])
    diff = (res.values - io["output"]).abs().max().item()
    print(f"{tag}: max |output diff| = {diff:.2e}")
    assert diff < 1e-5
    # the fold matters: the stored W has σ ≈ 3x the bound, the converted one is rescaled to it
    w = model.implicit2.layers[0].z_map.weight
    assert float(torch.linalg.matrix_norm(w, ord=2)) == pytest.approx(0.97, rel=1e-3)


@pytest.mark.parametrize("tag", ["siren_like_1l_implicit", "gabor_1l_implicit"])
def test_converted_model_returns_what_impsq_returns_at_its_own_tolerance(tmp_path, tag):
    """Issue 58: at the release's settings (rel 1e-3, 100 steps) ImpSq returns f applied twice to its last
    iterate (forward_iteration's last f output, then the layer's f); the converter writes f_final_step=2.
    Max |deqzoo - ImpSq| against the fixture's `output_release_tol` (siren / gabor): the iterate (before)
    1.4e-3 / 7.2e-5, one f of it 8.3e-4 / 2.9e-5, the written two 3.3e-7 / 2.2e-8."""
    io = load_file(FIX / f"impsq_{tag}_io.safetensors")
    convert = converter_module("implicit2_impsq").FORMATS["implicit2-impsq"]
    model = Implicit2ForSignalRepresentation.from_pretrained(
        convert(FIX / f"impsq_{tag}_state_dict.pt", tmp_path / "conv")).eval()
    assert model.config.deq["f_final_step"] == 2 and model.config.deq["f_tol"] == 1e-3
    want = io["output_release_tol"]
    with torch.no_grad():
        diff = float((model(io["coords"]).values - want).abs().max())
        print(f"{tag}: max |deqzoo - ImpSq at its tolerance| = {diff:.2e}")
        assert diff < 1e-5, diff
        model.set_deq(f_final_step=1)  # one f step fewer: another point, at least for the slower siren
        fewer = float((model(io["coords"]).values - want).abs().max())
    assert fewer > (1e-5 if tag.startswith("siren") else diff), fewer


def test_converter_refuses_foreign_or_incomplete_state_dicts(tmp_path):
    convert = converter_module("implicit2_impsq").FORMATS["implicit2-impsq"]
    sd = torch.load(FIX / "impsq_gabor_1l_implicit_state_dict.pt", weights_only=True)
    broken = {k: v for k, v in sd.items() if k != "output_map.weight"}
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(KeyError, match="output_map.weight"):
        convert(tmp_path / "broken.pt", tmp_path / "o1")
    torch.save({**sd, "extra.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match="unexpected key"):
        convert(tmp_path / "extra.pt", tmp_path / "o2")
    torch.save({"foo": torch.zeros(1)}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="layers"):
        convert(tmp_path / "foreign.pt", tmp_path / "o3")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="weights-only"):
        convert(tmp_path / "pickled.pt", tmp_path / "o4")


def test_converter_writes_the_originals_evaluation_settings(tmp_path):
    """ImpSq evaluates with construct_model_args' tol=1e-3 (forward_iter, rel, max_iter 100), read from
    locuslab/ImpSq modules/modeling_utils.py and models.py; written out here, not imported."""
    convert = converter_module("implicit2_impsq").FORMATS["implicit2-impsq"]
    out = convert(FIX / "impsq_gabor_1l_implicit_state_dict.pt", tmp_path / "conv")
    model = Implicit2ForSignalRepresentation.from_pretrained(out).eval()
    deq = model.config.deq
    written = (deq["f_solver"], deq["f_max_iter"], deq["f_tol"], deq["f_stop_mode"])
    assert written == ("fixed_point", 100, 1e-3, "rel")
    assert deq["b_mode"] == "phantom" and deq["b_mode_kwargs"]["variant"] == "npg"
    assert "below 0.001" in (out / "README.md").read_text()
    io = load_file(FIX / "impsq_gabor_1l_implicit_io.safetensors")
    with torch.no_grad():
        res = model(io["coords"])
    assert bool(res.deq_stats.converged.all()) and float(res.deq_stats.rel_residual.max()) <= 1e-3
    # at the release tolerance the output stays within what a 1e-3 relative residual allows of the original
    # solved to 1e-10 (the fixture), and closer than the former 1e-2 setting gets
    loose = Implicit2ForSignalRepresentation.from_pretrained(out, deq={"f_tol": 1e-2}).eval()
    with torch.no_grad():
        loose_diff = float((loose(io["coords"]).values - io["output"]).abs().max())
    diff = float((res.values - io["output"]).abs().max())
    assert diff < loose_diff, (diff, loose_diff)
    assert convert(FIX / "impsq_gabor_1l_implicit_state_dict.pt", tmp_path / "o2",
                   deq={"f_tol": 1e-4}) and Implicit2ForSignalRepresentation.from_pretrained(
        tmp_path / "o2").config.deq["f_tol"] == 1e-4  # an explicit deq= still overrides


def test_default_solver_settings_are_the_originals_and_the_converters():
    """A model built from Implicit2Config() evaluates as ImpSq does (construct_model_args' tol=1e-3,
    forward_iter to max_iter 100 on the whole signal's relative residual, read from locuslab/ImpSq
    modules/modeling_utils.py), and the converter writes the same settings, so a fresh model and a
    converted one solve alike."""
    from deqzoo.models.implicit2 import Implicit2Config

    original = {"f_solver": "fixed_point", "f_max_iter": 100, "f_tol": 1e-3, "f_stop_mode": "rel"}
    default = Implicit2Config().deq_config
    assert {k: getattr(default, k) for k in original} == original
    eval_deq = converter_module("implicit2_impsq").EVAL_DEQ
    assert {k: getattr(default, k) for k in eval_deq} == eval_deq


@pytest.mark.parametrize("card", ["implicit2-isiren-camera", "implicit2-igabor-mfn-camera"])
def test_embedded_checkpoints_keep_their_stored_tolerance(card):
    """The embedded checkpoints were trained at f_tol 1e-2 and ship ImpSq's 1e-3 (issue 58), the tolerance
    their cards' numbers were evaluated at; config.json stores it, so a change of the family's default does
    not change what `deqzoo eval` prints for them (tests/models/implicit2/test_implicit2_checkpoints.py
    compares those numbers with the cards)."""
    import json

    stored = json.loads((ROOT / "model_cards" / card / "config.json").read_text())["deq"]
    assert stored["f_tol"] == 1e-3
    model = Implicit2ForSignalRepresentation.from_pretrained(ROOT / "model_cards" / card)
    assert model.config.deq_config.f_tol == 1e-3
    readme = (ROOT / "model_cards" / card / "README.md").read_text(encoding="utf-8")
    assert "relative residual of 0.001" in readme  # the card says which tolerance its numbers use
