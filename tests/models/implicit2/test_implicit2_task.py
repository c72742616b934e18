"""The implicit2 task: data splits, PSNR, fitting with reuse/projection, evaluate/predict/demo."""

import math
import warnings

import pytest
import torch

from deqzoo.modeling_utils import DEQNonConvergenceWarning
from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
from deqzoo.tasks import implicit2 as task


def test_generalization_split_is_two_disjoint_quarters_of_the_grid():
    data = task.image_data("camera", 16, "generalization")
    assert data.train_coords.shape == (64, 2) and data.test_coords.shape == (64, 2)
    train = {tuple(c) for c in data.train_coords.tolist()}
    test = {tuple(c) for c in data.test_coords.tolist()}
    assert not train & test
    full = task.image_data("camera", 16, "full")
    img = full.image
    # train pixels are the even rows/columns of the image, test the odd ones, values in [-1, 1]
    torch.testing.assert_close(data.train_values.reshape(8, 8, 1), img[::2, ::2] * 2 - 1)
    torch.testing.assert_close(data.test_values.reshape(8, 8, 1), img[1::2, 1::2] * 2 - 1)
    rgb = task.image_data("astronaut", 8)
    assert rgb.train_values.shape == (64, 3) and float(rgb.train_values.abs().max()) <= 1


def test_bad_image_names_sizes_and_splits_are_errors():
    with pytest.raises(ValueError, match="unknown image 'lena'"):
        task.load_image("lena", 16)
    with pytest.raises(ValueError, match="size"):
        task.load_image("camera", 10**6)
    with pytest.raises(ValueError, match="split"):
        task.image_data("camera", 8, "half")


def test_psnr_matches_its_definition():
    target = torch.zeros(100, 1)
    values = torch.full((100, 1), 0.2)  # intensities 0.5 vs 0.6: mse 0.01 -> 20 dB
    assert task.psnr(values, target) == pytest.approx(20.0)
    assert task.psnr(target, target) == math.inf
    assert task.psnr(torch.full((4, 1), 5.0), torch.ones(4, 1)) == math.inf  # clamped as the original


def _tiny(filter_type="gabor", implicit=True, image="camera", size=16, split="full"):
    torch.manual_seed(0)
    cfg = Implicit2Config(
        filter_type=filter_type,
        implicit=implicit,
        hidden_size=32,
        input_scale=32.0,
        task_specific_params={"implicit2": {"image": image, "size": size, "split": split}},
    )
    return Implicit2ForSignalRepresentation(cfg)


def test_fit_improves_psnr_keeps_the_spectral_bound_and_reuses_fixed_points():
    model = _tiny()
    data = task.image_data("camera", 16)
    before = task.evaluate(model)["psnr"]
    hist = task.fit(
        model,
        data.train_coords,
        data.train_values,
        60,
        lr=3e-3,
        progress=False,
        eval_every=30,
        eval_fn=torch.no_grad()(lambda m: task.psnr(m(data.test_coords).values, data.test_values)),
    )
    after = task.evaluate(model)["psnr"]
    assert after > before + 3
    assert hist["eval"][-1][1] == pytest.approx(after, abs=0.01)
    w = model.spectral_weights()[0].detach()
    assert float(torch.linalg.matrix_norm(w, ord=2)) <= 0.97 * (1 + 1e-3)
    # reuse: later solves start at the previous fixed point (the first starts from zeros)
    assert sum(hist["nfe"][30:]) / 30 < hist["nfe"][0]
    assert model.config.deq_config.f_tol == 1e-2  # the original's tolerance
    assert max(hist["residual"]) < 1e-2  # every solve reached it
    assert hist["saved_bytes"] > 0 and len(hist["step_time"]) == 60


def test_cold_probe_counts_what_a_solve_from_zeros_takes_and_no_solve_reuse():
    """Fitter.cold_nfe (the without-reuse count of the bench) equals the f-evaluations of an actual solve
    from zeros at each tolerance on the same weights; reuse_max_iter=0 solves only at the first step."""
    data = task.image_data("camera", 16)
    torch.manual_seed(0)
    model = _tiny()
    fitter = task.Fitter(model, data.train_coords, data.train_values, lr=3e-3)
    for _ in range(3):
        fitter.step()
    tols = (1e-2, 1e-3, 1e-4)
    cold = fitter.cold_nfe(tols)
    for t in tols:
        model.set_deq(f_tol=t)
        with torch.no_grad():
            assert cold[f"{t:g}"] == model(data.train_coords).deq_stats.nfe
    model.set_deq(f_tol=1e-2)
    assert model.config.deq_config.f_tol == 1e-2 and cold["0.01"] < cold["0.001"] < cold["0.0001"]

    torch.manual_seed(0)
    with warnings.catch_warnings():  # no solve was asked for on hits: no "stopped above its tolerance"
        warnings.simplefilter("error", DEQNonConvergenceWarning)
        hist = task.fit(_tiny(), data.train_coords, data.train_values, 12, lr=3e-3, reuse_max_iter=0,
                        cold_tols=(1e-2,), cold_at=(1, 12), progress=False)
    assert hist["nfe"][0] > 1 and hist["nfe"][1:] == [0] * 11  # the original: no solve after step 0
    assert all(0 < r < 1 for r in hist["residual"][1:])  # the cached state's residual, reported
    assert [st for st, _ in hist["cold_nfe"]] == [1, 12] and hist["cold_nfe"][0][1]["0.01"] == hist["nfe"][0]

    # the returned state's residual: ||f(z) - z|| / ||f(z)|| with f written out from the model's pieces
    rec = fitter.step(measure_returned=True)
    assert 0 < rec["returned_residual"] < 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner = model.implicit2
    with torch.no_grad():
        x = inner.check_coordinates(data.train_coords)
        default = torch.zeros(1, x.shape[1], model.config.hidden_size)
        z = fitter.cache.initial("default", default, key_input=x)
        assert z is not default  # the state the last step returned
        u0, responses = inner.injection(x)
        fz = inner.layer_stack(z, inner.first_offset(u0, responses), responses)
        ref = float((fz - z).norm() / fz.norm())
    assert fitter.returned_residual() == pytest.approx(ref, rel=1e-4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the probe trains nothing
    assert torch.equal(fitter.cache.initial("default", default, key_input=x), z)  # nor moves the cache


def test_predict_writes_a_png_at_2x_and_never_overwrites(tmp_path):
    from PIL import Image

    model = _tiny(size=8)
    out = tmp_path / "r.png"
    msg = task.predict(model, f"2x:{out}")
    assert "16x16" in msg and Image.open(out).size == (16, 16)
    out.write_bytes(b"user file")
    task.predict(model, f"3x5:{out}")
    assert out.read_bytes() == b"user file"  # untouched; the render went next to it
    assert Image.open(tmp_path / "r-1.png").size == (5, 3)
    for bad in ("huge", "0x5", f"2x:{tmp_path / 'a.jpg'}"):
        with pytest.raises(ValueError):
            task.predict(model, bad)


def test_evaluate_needs_the_task_settings():
    model = Implicit2ForSignalRepresentation(Implicit2Config(hidden_size=8))
    with pytest.raises(ValueError, match="task_specific_params"):
        task.evaluate(model)


def test_demo_renders_at_twice_the_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary, stats = task.demo(_tiny(size=8).eval(), output_dir=tmp_path / "out")
    assert "16x16" in summary and stats.nfe >= 1
    assert (tmp_path / "out" / "implicit2_16x16.png").exists()
    assert not (tmp_path / "demo_output").exists()  # only the folder it was given
    summary, stats = task.demo(_tiny(size=8, implicit=False).eval(), output_dir=tmp_path / "out")
    assert stats.nfe == 0
