"""examples/implicit2/fitting.py: the implicit2 training loop (moved out of the installed package with its
tests, from tests/models/implicit2/test_implicit2_task.py)."""

import warnings

import pytest
import torch

from deqzoo.modeling_utils import DEQNonConvergenceWarning
from deqzoo.models.implicit2 import Implicit2Config, Implicit2ForSignalRepresentation
from examples.implicit2 import fitting
from examples.implicit2 import images as task


def _tiny(filter_type="gabor", implicit=True, image="camera", size=16, split="full"):
    torch.manual_seed(0)
    cfg = Implicit2Config(
        filter_type=filter_type,
        implicit=implicit,
        hidden_size=32,
        input_scale=32.0,
        deq={"f_tol": 1e-2},  # the recipe of the embedded checkpoints (the library default is ImpSq's 1e-3)
        task_specific_params={"implicit2": {"image": image, "size": size, "split": split}},
    )
    return Implicit2ForSignalRepresentation(cfg)


def test_fit_improves_psnr_keeps_the_spectral_bound_and_reuses_fixed_points():
    model = _tiny()
    data = task.image_data("camera", 16)
    before = task.evaluate(model)["psnr"]
    hist = fitting.fit(
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
    assert model.config.deq_config.f_tol == 1e-2  # the cards' training tolerance
    assert max(hist["residual"]) < 1e-2  # every solve reached it
    assert hist["saved_bytes"] > 0 and len(hist["step_time"]) == 60


def test_cold_probe_counts_what_a_solve_from_zeros_takes_and_no_solve_reuse():
    """Fitter.cold_nfe (the without-reuse count of the bench) equals the f-evaluations of an actual solve
    from zeros at each tolerance on the same weights; reuse_max_iter=0 solves only at the first step."""
    data = task.image_data("camera", 16)
    torch.manual_seed(0)
    model = _tiny()
    fitter = fitting.Fitter(model, data.train_coords, data.train_values, lr=3e-3)
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
        hist = fitting.fit(_tiny(), data.train_coords, data.train_values, 12, lr=3e-3, reuse_max_iter=0,
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
