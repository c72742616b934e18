"""broyden(best="batch"): the 2020 MDEQ release's returned iterate (locuslab/mdeq lib/modules/broyden.py at
20e8a40, the fixtures' commit), against a test-only transcription of that loop: no line search, first step
``update = gx`` (x1 = f(x0)), its Sherman-Morrison update, the lowest whole-batch residual norm with strict <
(x0 included), eps on the batch's norm, `threshold` steps after the first evaluation. Its memory is a ring of
min(threshold, 27) updates, deqzoo's full memory: the same below 27 steps, the only budgets used here."""

import math

import pytest
import torch

from deqzoo.core.solvers.broyden import broyden


def _original_broyden(g, x0, threshold, eps):
    """The 2020 release's loop on a (B, D) state (its (B, D, 1) einsums written for (B, D))."""
    bsz, d = x0.shape
    x, gx = x0, g(x0)
    us = torch.zeros(bsz, d, threshold, dtype=x0.dtype)
    vts = torch.zeros(bsz, threshold, d, dtype=x0.dtype)

    def matvec(u, vt, y):  # (-I + U Vᵀ) y
        return -y + torch.einsum("bdk,bk->bd", u, torch.einsum("bkd,bd->bk", vt, y))

    def rmatvec(u, vt, y):  # yᵀ (-I + U Vᵀ)
        return -y + torch.einsum("bk,bkd->bd", torch.einsum("bd,bdk->bk", y, u), vt)

    update, objective, nstep = gx, torch.norm(gx).item(), 0
    lowest, lowest_x, lowest_step = objective, x, 0
    while objective >= eps and nstep < threshold:
        x_new = x + update
        g_new = g(x_new)
        dx, dg = x_new - x, g_new - gx
        x, gx = x_new, g_new
        nstep += 1
        objective = torch.norm(gx).item()
        if objective < lowest:
            lowest, lowest_x, lowest_step = objective, x.clone(), nstep
        if objective < eps:
            break
        u_, vt_ = us[:, :, : nstep - 1], vts[:, : nstep - 1]
        vt = rmatvec(u_, vt_, dx)
        u = (dx - matvec(u_, vt_, dg)) / torch.einsum("bd,bd->b", vt, dg)[:, None]
        vts[:, nstep - 1], us[:, :, nstep - 1] = vt, u
        update = -matvec(us[:, :, :nstep], vts[:, :nstep], gx)
    return lowest_x, lowest_step, nstep


def _problem(b=4, d=12, seed=0, contraction=0.9):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(b, d, d, generator=gen, dtype=torch.float64)
    w = contraction * w / torch.linalg.matrix_norm(w, ord=2)[:, None, None]  # per-sample, different rates
    w = w * torch.linspace(0.6, 1.0, b, dtype=torch.float64)[:, None, None]
    c = torch.randn(b, d, generator=gen, dtype=torch.float64)
    return lambda z: torch.tanh(torch.einsum("bij,bj->bi", w, z) + c) + 0.3 * torch.sin(z)


@pytest.mark.parametrize("seed, contraction, threshold, rms_tol, apart",
                         [(1, 1.8, 9, 1e-14, True), (0, 0.9, 14, 1e-14, False), (0, 0.9, 25, 1e-6, False)])
def test_batch_best_matches_the_2020_release_loop(seed, contraction, threshold, rms_tol, apart):
    f = _problem(seed=seed, contraction=contraction)
    x0 = torch.zeros(4, 12, dtype=torch.float64)
    eps = rms_tol * math.sqrt(x0.numel())  # the release's eps = 1e-5 sqrt(B D): tol per element
    want, lowest_step, nstep = _original_broyden(lambda x: f(x) - x, x0, threshold, eps)
    z, st = broyden(f, x0, max_iter=threshold + 1, tol=rms_tol, stop_mode="abs", best="batch")
    assert torch.equal(st.nfe_per_sample, torch.full((4,), nstep + 1))  # the rows stop together
    assert (z - want).abs().max().item() < 1e-12
    assert lowest_step > 0
    assert (nstep < threshold) == (rms_tol > 1e-10)  # one case stops on eps, the others on the budget
    # on the non-contractive problem a sample's lowest iterate is not the batch's: the rules are told apart
    zs, _ = broyden(f, x0, max_iter=threshold + 1, tol=rms_tol, stop_mode="abs")
    if apart:
        assert (zs - want).abs().max().item() > 1e-3


def test_batch_statistics_are_the_returned_iterates():
    f = _problem(seed=1)
    x0 = torch.zeros(4, 12, dtype=torch.float64)
    z, st = broyden(f, x0, max_iter=10, tol=1e-14, stop_mode="abs", best="batch")
    torch.testing.assert_close(st.abs_residual, torch.linalg.vector_norm(f(z) - z, dim=1), rtol=1e-10, atol=0)


def test_default_is_per_sample_and_unchanged():
    f = _problem(seed=2)
    x0 = torch.zeros(4, 12, dtype=torch.float64)
    z1, s1 = broyden(f, x0, max_iter=15, tol=1e-10, stop_mode="abs")
    z2, s2 = broyden(f, x0, max_iter=15, tol=1e-10, stop_mode="abs", best="sample")
    assert torch.equal(z1, z2) and torch.equal(s1.nfe_per_sample, s2.nfe_per_sample)
    # per sample: each row is its own lowest iterate, against the same loop run on one row at a time
    for i in range(4):
        zi, _ = broyden(lambda z, i=i: f(torch.cat([z1[:i], z, z1[i + 1 :]]))[i : i + 1], x0[i : i + 1],
                        max_iter=15, tol=1e-10, stop_mode="abs")  # fmt: skip
        torch.testing.assert_close(zi[0], z1[i], rtol=0, atol=1e-12)


def test_bad_options_are_rejected():
    f, x0 = _problem(), torch.zeros(4, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="best must be"):
        broyden(f, x0, max_iter=5, tol=1e-6, best="row")
    with pytest.raises(ValueError, match="stop_mode='abs'"):
        broyden(f, x0, max_iter=5, tol=1e-6, stop_mode="rel", best="batch")
    with pytest.raises(ValueError, match="halt rules"):
        broyden(f, x0, max_iter=5, tol=1e-6, stop_mode="abs", best="batch", stall_window=30)
