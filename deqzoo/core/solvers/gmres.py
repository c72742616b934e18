"""GMRES for affine maps (the adjoint system of implicit differentiation)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._contract import _check_output, _check_solve_args, _empty_result, _Tracker, register_solver

MAX_BASIS = 1024  # Krylov vectors kept at most (memory MAX_BASIS · D per sample)


@register_solver("gmres")
@torch.no_grad()
def gmres(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", keep_steps: Iterable[int] = (),
          div_factor: float = 1e6, halt=None):
    """GMRES for an affine map g(x) = M x + c (solves (I - M) x = c), e.g. the adjoint system of IFT.

    Batched Arnoldi with classical Gram-Schmidt applied twice (one batched product each), a per-sample least
    squares problem on the small Hessenberg matrix (float64; a NaN or singular system ends that sample
    cleanly, never with a LAPACK error), and the true residual measured
    at the returned iterate. The Krylov basis grows with the steps taken, up to a documented cap of
    `MAX_BASIS` = 1024 vectors, so a huge budget never allocates by itself; a solve that reaches the cap stops
    there (unconverged unless it got there). Costs one more evaluation of g than
    steps (to get c = g(0) - ... from g(x0)).
    """
    del div_factor  # GMRES residuals are monotone; divergence cannot happen
    _check_solve_args(max_iter, tol, stop_mode)
    b, d = x0.shape
    if b == 0:
        return _empty_result(x0, "gmres", tol, stop_mode)
    tiny, eps = torch.finfo(x0.dtype).tiny, torch.finfo(x0.dtype).eps
    # GMRES keeps the whole batch (its Krylov bases advance together); rows stop (freeze) on their own
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "gmres", keep_steps, halt=halt)
    k_max = max(min(max_iter - 1, MAX_BASIS), 1)  # memory is bounded by the cap, never by max_iter
    gx0 = g(x0)
    gx0 = _check_output(gx0, x0)
    nfe = 1
    r0 = gx0 - x0  # residual of (I - M) x = c at x0
    tracker.update(x0, gx0, torch.linalg.vector_norm(r0, dim=1))
    beta = torch.linalg.vector_norm(r0, dim=1)
    basis = [torch.nan_to_num(r0 / beta.clamp_min(tiny)[:, None])]
    Hs = torch.zeros(b, 1, 0, dtype=torch.float64, device=x0.device)  # grows with the steps
    e1 = beta.double()[:, None, None]
    x = x0
    for j in range(k_max):
        if tracker.done or nfe >= max_iter:
            break
        vj = basis[j]
        fv = g(vj + x0)
        fv = _check_output(fv, x0)
        w = vj - (fv - gx0)  # (I - M) v_j, using g(v + x0) - g(x0) = M v_j
        nfe += 1
        # (I - M) v_j within the rounding of the difference that formed it is no information: the map is
        # singular along v_j. Its column is zeroed (the least squares then ignores it) rather than solved
        # for, where a noise column would send x towards 1/eps and a relative residual of ~eps (a false
        # convergence on an unsolvable map such as f(z) = z + 1)
        noise = 8 * eps * (torch.linalg.vector_norm(fv, dim=1) + torch.linalg.vector_norm(gx0, dim=1) + 1)
        signal = (torch.linalg.vector_norm(w, dim=1) > noise)[:, None]
        Vm = torch.stack(basis, 1)
        h = torch.bmm(w.unsqueeze(1), Vm.transpose(1, 2))[:, 0]
        w = w - torch.bmm(h.unsqueeze(1), Vm)[:, 0]
        h2 = torch.bmm(w.unsqueeze(1), Vm.transpose(1, 2))[:, 0]
        w = w - torch.bmm(h2.unsqueeze(1), Vm)[:, 0]
        hn = torch.linalg.vector_norm(w, dim=1)
        col = torch.cat(((h + h2).double(), hn.double()[:, None]), 1) * signal  # (B, j + 2)
        col = col[:, :, None]
        Hs = torch.cat((torch.cat((Hs, Hs.new_zeros(b, 1, j)), 1), col), 2)
        basis.append(torch.nan_to_num(w / hn.clamp_min(tiny)[:, None]))
        e = torch.cat((e1, e1.new_zeros(b, j + 1, 1)), 1)
        y = _least_squares(Hs, e)  # (B, j+1, 1), finite
        x = x0 + torch.bmm(y.transpose(1, 2).to(x0.dtype), Vm)[:, 0]
        res = torch.linalg.vector_norm(e - Hs @ y, dim=(1, 2)).to(x0.dtype)
        # ||g(x)|| >= ||x|| - residual: a conservative denominator for the relative residual
        fx_norm = (torch.linalg.vector_norm(x, dim=1) - res).clamp_min(0)
        tracker.update(x, None, res, fx_norm)
    # measure the true residual at the returned iterate (one more evaluation, keeps the stats honest)
    x_best = tracker.result()
    fx = g(x_best)
    fx = _check_output(fx, x_best)
    nfe += 1
    stats = tracker.stats(nfe)
    stats.nfe_per_sample = stats.nfe_per_sample + 1
    abs_r = torch.linalg.vector_norm(fx - x_best, dim=1)
    stats.abs_residual = abs_r
    stats.rel_residual = abs_r / (torch.linalg.vector_norm(fx, dim=1) + 1e-12)
    stats.converged = (stats.residual < tol).cpu()
    stats.nonfinite = stats.nonfinite or not bool(torch.isfinite(abs_r).all())
    return x_best, stats


def _least_squares(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """argmin |A y - rhs| per sample (float64). LAPACK asserts on non-finite input, so a sample with a NaN
    or Inf entry gets y = 0 (its residual stays the initial one and the stats flag it); a singular system
    gets the rank-revealing driver's answer on CPU, and y = 0 where a device's driver returns non-finite."""
    finite = torch.isfinite(A).flatten(1).all(1) & torch.isfinite(rhs).flatten(1).all(1)
    A = torch.where(finite[:, None, None], A, 0.0)
    rhs = torch.where(finite[:, None, None], rhs, 0.0)
    y = torch.linalg.lstsq(A, rhs).solution
    good = finite & torch.isfinite(y).flatten(1).all(1)
    return torch.where(good[:, None, None], y, 0.0)


