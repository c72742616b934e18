"""The engine options converters write to reproduce the original releases (issue 58), each against a
test-only transcription of the original's code (written here from the upstream files named below, run one
sample at a time: deqzoo halts per sample, so a sample's answer is the original's run on that sample alone).

- ``f_final_step=1``: TorchDEQ's ``fixed_point_iter`` and ``anderson`` (torchdeq/solver/*.py) and
  DEQ-Flow v2.0's (code.v.2.0/core/deq/solvers.py) return f of each sample's lowest-residual iterate;
  ``f_final_step=2``: ImpSq (modules/solvers.py forward_iteration, then models.py's layer applies f again).
- anderson ``lam_mode="abs"``: DEQ-Flow v1.0's anderson (code.v.1.0/core/lib/solvers.py) regularises the Gram
  matrix with an absolute lam (1e-4) and returns the lowest-residual iterate itself.
- broyden ``stall_window`` / ``protect_per_element``: DEQ-Flow v1.0's broyden's two extra breaks.
"""

from __future__ import annotations

import math

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig, solve
from deqzoo.core.halting import Step, rowwise
from deqzoo.core.solvers.broyden import OriginalBreaks

D = 12


def _problem(dtype=torch.float64, batch=3):
    """A nonlinear, non-normal contraction with rows that converge at different rates."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    A = (q @ torch.diag(torch.linspace(0.05, 0.9, D, dtype=torch.float64)) @ q.T
         + 0.3 * torch.triu(torch.randn(D, D, generator=g, dtype=torch.float64), 1)).to(dtype)
    scale = torch.tensor([0.3, 0.7, 0.95], dtype=dtype)[:batch, None]
    b = torch.randn(batch, D, generator=g, dtype=torch.float64).to(dtype)

    def f(z, rows=None):
        s, c = (scale, b) if rows is None else (scale[rows], b[rows])
        return s * torch.tanh(z @ A.T) + c

    return rowwise(f), torch.zeros(batch, D, dtype=dtype)


# --- transcriptions (one sample) ----------------------------------------------------------------------------

def torchdeq_fixed_point(f, x0, max_iter, tol, stop_mode):
    """torchdeq.solver.fp_iter.fixed_point_iter (tau 1, return_final False): f of the lowest iterate."""
    lowest, lowest_x, fx = math.inf, x0, x0
    for _ in range(max_iter):
        x = fx
        fx = f(x)
        a = (fx - x).norm()
        r = a if stop_mode == "abs" else a / (fx.norm() + 1e-9)
        if r < lowest:
            lowest, lowest_x = r, fx
        if r < tol:
            break
    return lowest_x


def original_anderson(f, x0, max_iter, tol, stop_mode, m=6, lam=1e-4, returns="f"):
    """torchdeq.solver.anderson / DEQ-Flow v2.0 anderson (returns="f": F of the lowest iterate) and
    DEQ-Flow v1.0 anderson (returns="x": X of the lowest iterate, rel with 1e-5 in the denominator)."""
    d = x0.numel()
    X, F = x0.new_zeros(m, d), x0.new_zeros(m, d)
    X[0], F[0] = x0, f(x0)
    X[1], F[1] = F[0], f(F[0])
    H = x0.new_zeros(m + 1, m + 1)
    H[0, 1:] = H[1:, 0] = 1
    y = x0.new_zeros(m + 1, 1)
    y[0] = 1
    lowest, lowest_x = math.inf, x0
    for k in range(2, max_iter):
        n = min(k, m)
        G = F[:n] - X[:n]
        H[1:n + 1, 1:n + 1] = G @ G.T + lam * torch.eye(n, dtype=x0.dtype)
        alpha = torch.linalg.solve(H[:n + 1, :n + 1], y[:n + 1])[1:n + 1, 0]
        X[k % m] = alpha @ F[:n]
        F[k % m] = f(X[k % m])
        a = (F[k % m] - X[k % m]).norm()
        r = a if stop_mode == "abs" else a / (F[k % m].norm() + (1e-9 if returns == "f" else 1e-5))
        if r < lowest:
            lowest, lowest_x = r, (F[k % m] if returns == "f" else X[k % m]).clone()
        if r < tol:
            break
    return lowest_x


def v1_breaks(trace, tol, window, protect):
    """DEQ-Flow v1.0 broyden's extra breaks on its residual trace (trace[j]: x_{j+1}'s residual, nstep = j+1):
    the nstep at which it breaks, or None."""
    for j, r in enumerate(trace):
        nstep = j + 1
        if r < tol:
            return None  # the ordinary stop, not an extra break
        last = trace[max(0, j + 1 - window):j + 1]
        if window and r < 3 * tol and nstep > window and max(last) / min(last) < 1.3:
            return nstep
        if protect and r > trace[0] * protect:
            return nstep
    return None


def _per_row(original, f, x0, **kw):
    return torch.cat([original(lambda z, i=i: f(z[None], torch.tensor([i]))[0], x0[i], **kw)[None]
                      for i in range(x0.shape[0])])


# --- f of the accepted iterate ------------------------------------------------------------------------------

@pytest.mark.parametrize("stop_mode", ["abs", "rel"])
@pytest.mark.parametrize("tol, budget", [(1e-4, 40), (1e-12, 8)])  # per-sample halting / the budget
def test_final_step_always_returns_what_torchdeqs_fixed_point_iter_returns(stop_mode, tol, budget):
    f, x0 = _problem()
    want = _per_row(torchdeq_fixed_point, f, x0, max_iter=budget, tol=tol, stop_mode=stop_mode)
    got, st = solve(f, x0, solver="fixed_point", max_iter=budget, tol=tol, stop_mode=stop_mode,
                    final=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    plain, _ = solve(f, x0, solver="fixed_point", max_iter=budget, tol=tol, stop_mode=stop_mode)
    assert float((plain - want).abs().max()) > 1e3 * 1e-13  # the iterate itself is not what it returns
    # the statistics describe the returned point: its own residual, measured
    r = (f(got) - got).norm(dim=1)
    torch.testing.assert_close(st.abs_residual, r, rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_final_step_always_returns_what_torchdeqs_anderson_returns(dtype):
    f, x0 = _problem(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    want = _per_row(original_anderson, f, x0, max_iter=30, tol=tol, stop_mode="abs")
    cfg = DEQConfig(f_solver="anderson", f_max_iter=30, f_tol=tol, f_stop_mode="abs", f_final_step=1,
                    f_solver_kwargs={"m": 6, "lam": 1e-4, "lam_mode": "abs"})
    with torch.no_grad():
        got, st = DEQ(cfg)(f, x0)
    atol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    with torch.no_grad():  # f_final_step=True keeps the iterate where f of it is not better
        better_only, _ = DEQ(cfg.update(f_final_step=True))(f, x0)
    assert st.nfe >= 1 and torch.isfinite(better_only).all()


def test_final_step_always_evaluates_f_at_an_answer_that_is_not_the_last_iterate():
    """A growing residual: the answer is x0, and the original returns f(x0), not f of the last iterate."""
    f = lambda z: 2 * z + 1  # noqa: E731 - iterates 0, 1, 3 with residuals 1, 2, 4
    got, st = solve(f, torch.zeros(1, 1, dtype=torch.float64), solver="fixed_point", max_iter=3, tol=1e-9,
                    stop_mode="abs", final=1)
    want = torchdeq_fixed_point(f, torch.zeros(1, 1, dtype=torch.float64), 3, 1e-9, "abs")
    assert got.item() == want.item() == 1.0
    assert st.nfe == 5 and st.abs_residual.item() == 2.0  # f at x0, then f at f(x0) to measure it


def impsq_forward(f, x0, max_iter, tol):
    """ImpSq: forward_iteration (whole-signal rel residual, returns the last f output), then the layer's f."""
    fx = x0
    for k in range(1, max_iter + 1):
        x = x0 if k == 1 else fx
        fx = f(x)
        if (fx - x).norm() / (fx.norm() + 1e-9) < tol:
            break
    return f(fx)


@pytest.mark.parametrize("tol, budget", [(1e-3, 30), (1e-12, 6)])
def test_two_final_steps_return_what_impsq_returns(tol, budget):
    f, x0 = _problem(batch=1)
    want = impsq_forward(f, x0, budget, tol)
    cfg = DEQConfig(f_solver="fixed_point", f_max_iter=budget, f_tol=tol, f_stop_mode="rel", f_final_step=2)
    with torch.no_grad():
        got, st = DEQ(cfg)(f, x0)
        one, _ = DEQ(cfg.update(f_final_step=1))(f, x0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert float((one - want).abs().max()) > 1e-9  # one step fewer is another point
    torch.testing.assert_close(st.abs_residual, (f(got) - got).norm(dim=1), rtol=1e-9, atol=1e-300)


def test_final_step_config_values():
    assert DEQConfig(f_final_step=2).f_final_step == 2
    for bad in ("always", 0, -1, 1.5):
        with pytest.raises((TypeError, ValueError), match="f_final_step"):
            DEQConfig(f_final_step=bad)


# --- DEQ-Flow v1.0's absolute Anderson regularisation -------------------------------------------------------

def test_anderson_absolute_lam_is_deq_flow_v1s_anderson():
    # residuals of ~1e-2 make an absolute 1e-4 a strong regulariser (the Gram entries are ~1e-4)
    f0, x0 = _problem()
    f = rowwise(lambda z, rows=None: 0.01 * f0(z / 0.01, rows))
    want = _per_row(original_anderson, f, x0, max_iter=12, tol=1e-14, stop_mode="abs", returns="x")
    kw = dict(solver="anderson", max_iter=12, tol=1e-14, stop_mode="abs", m=6, lam=1e-4)
    got, _ = solve(f, x0, lam_mode="abs", **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    relative, _ = solve(f, x0, **{**kw, "lam": 1e-5})  # deqzoo's default regularisation is another method
    assert float((relative - want).abs().max()) > 1e-6
    with pytest.raises(ValueError, match="lam_mode"):
        solve(f, x0, lam_mode="absolute", **kw)


# --- DEQ-Flow v1.0's Broyden breaks -------------------------------------------------------------------------

def _feed(rule, traces, tol):
    """Run a rule over per-row residual traces (trace[j] is the residual at nfe j + 1) beside the solve's own
    stop (residual < tol, reported as None); the nfe at which the rule halts each row, or None."""
    b, n = traces.shape
    rule.start(b, torch.device("cpu"))
    halted = [None] * b
    for j in range(n):
        rows = torch.tensor([i for i in range(b) if halted[i] is None])
        if rows.numel() == 0:
            break
        r = traces[rows, j]
        nfe = torch.full_like(rows, j + 1)
        stop = rule(Step(torch.zeros(len(rows), 1), torch.zeros(len(rows), 1), rows, nfe, r, r))
        for i, s, below in zip(rows.tolist(), stop.tolist(), (r < tol).tolist()):
            if below:
                halted[i] = "converged"
            elif s:
                halted[i] = j + 1
    return [None if h == "converged" else h for h in halted]
    return halted


@pytest.mark.parametrize("seed", range(4))
def test_v1_broyden_breaks_match_the_transcription_on_random_traces(seed):
    g = torch.Generator().manual_seed(seed)
    b, n, tol, dim = 16, 80, 1e-3, 5
    level = torch.exp(torch.empty(b, 1).uniform_(-7.5, -4.5, generator=g))  # around 3 tol: some stall
    wobble = 1 + torch.empty(b, n).uniform_(-0.15, 0.15, generator=g) * torch.rand(b, 1, generator=g) * 2
    traces = (level * wobble).double()
    traces[:, 0] = 2 * tol  # a first residual above tol, small enough that growth trips the protection
    traces[: b // 2, 40:] *= torch.logspace(0, 9, n - 40, dtype=torch.float64)  # half the rows blow up
    for window, protect in ((30, 0.0), (0, 200.0), (30, 200.0), (10, 1e3)):
        rule = OriginalBreaks(tol, "abs", window, protect, dim)
        got = _feed(rule, torch.cat([torch.full((b, 1), math.inf, dtype=torch.float64), traces], 1), tol)
        want = [v1_breaks(t.tolist(), tol, window, protect * dim) for t in traces]
        assert got == [None if w is None else w + 1 for w in want], (window, protect)
        assert any(w is not None for w in want)


def test_broyden_with_v1_breaks_stops_where_the_transcription_says():
    f = lambda z: torch.cat([0.5 * z[:, :1] + 1, z[:, 1:] + 2e-3 + 1e-4 * torch.cos(z[:, 1:])], 1)  # noqa: E731
    x0 = torch.zeros(1, 2, dtype=torch.float64)
    kw = dict(solver="broyden", max_iter=100, stop_mode="abs")
    for tol in (1e-3, 1.5e-3):
        _, plain = solve(f, x0, tol=tol, **kw)
        _, st = solve(f, x0, tol=tol, stall_window=30, **kw)
        trace = plain.trace.tolist()[1:]  # the original traces x_1, x_2, ...
        stop = v1_breaks(trace, tol, 30, 0.0)
        assert st.nfe == (plain.nfe if stop is None else stop + 1)
    assert stop is not None and st.nfe < plain.nfe  # at 1.5e-3 the stall rule ends the solve early
