"""Anderson and Broyden on ill-conditioned non-normal linear systems z = A z + b, against dense float64
references written here (a dense inverse-Jacobian good Broyden; Anderson with the same memory and
regularization solved by numpy), on the solvers' torch implementation.

A = Q (diag λ + c N / √d) Qᵀ with λ spread over [0, 0.95] and c setting the non-normality (c = 0: symmetric):
- "gaussian": N Gaussian, A rescaled to spectral radius 0.95; I - A has condition number 20 and more;
- "triangular": N strictly upper triangular, so the spectrum stays λ (radius 0.95) while I - A reaches
  condition number 1e8 at c = 1.5 (1e13 at c = 3, where not even the dense float64 references converge).
  Broyden only: there the NFE of either reference moves by up to 50% when b moves by 1e-15 (rounding
  decides; 20% on the symmetric Gaussian systems), so Broyden's float64 bound is taken over the reference
  and a perturbed run of it, and Anderson (whose references stall or scatter alike) is held to the Gaussian
  family, where it runs the reference's own iteration: its bound (10% over the reference's NFE, 8-13 steps)
  checks that identity, with observed differences of at most 3 steps.

float32 (issue 36): the solver's own arithmetic must not be what limits it. Broyden forms and sums every
product that decides its step in float64 on both paths (the stored steps stay float32), so its result does
not depend on how a CPU splits its reductions over vector lanes. What remains is the float32 map itself:
f(x) rounded to float32 carries ~1e-7 relative noise, which at a 1e-5 tolerance is a few percent of the last
residuals, so even an exact (dense float64) Broyden needs more steps on the float32 map than on the float64
one (1.2-1.4x at c = 0, up to 1.9x on triangular c = 1). The float32 bound is 1.6x the dense float64
reference on the float64 map (issue 35's bound) on the Gaussian non-normal family (c up to 3, observed
1.0-1.4x) and on symmetric triangular systems; on triangular c = 1 it is 1.6x the larger of that reference and
the float32 map seen by a float64 Broyden (observed up to 1.59x the first). Triangular c = 1.5 is left out in
float32: I - A has condition number 1e8, so float32 iterates (eps 6e-8) cannot carry the secant information
along its small singular directions; even the dense float64 Broyden on the exact float64 map, with only its
iterates rounded to float32, needs up to 6x its NFE there (`test_float32_iterates_alone_exceed_the_bound`).
The family also runs with the float32 inputs perturbed at their rounding level
(`test_float32_broyden_is_not_on_an_edge`)."""

from functools import cache

import numpy as np
import pytest
import torch

from deqzoo.core.solvers import anderson, broyden

D, BATCH = 128, 3
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
MAX_ITER = 1500


@cache
def _system(c: float, seed: int, kind: str = "gaussian"):
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((D, D)))[0]
    lam = rng.uniform(0.0, 0.95, D)
    if kind == "gaussian":
        N = rng.standard_normal((D, D))
        A = Q @ (np.diag(lam) + c * N / np.sqrt(D)) @ Q.T
        A *= 0.95 / np.abs(np.linalg.eigvals(A)).max()
    else:
        N = np.triu(rng.standard_normal((D, D)), 1)
        lam[0] = 0.95
        A = Q @ (np.diag(lam) + c * N / np.sqrt(D)) @ Q.T
    b = rng.standard_normal((BATCH, D))
    return A, b


def _rel(fx, x):
    return np.linalg.norm(fx - x) / (np.linalg.norm(fx) + 1e-12)


def _dense_broyden(A, b, tol, max_iter=MAX_ITER):
    """Good Broyden on the inverse Jacobian of g(x) = f(x) - x, dense float64, full memory, unit steps:
    B <- B + (Δx - BΔg) Δxᵀ B / (Δxᵀ B Δg), B_0 = -I. Returns the NFE each sample needs."""
    return [_dense_broyden_on(lambda x, r=r: A @ x + r, tol, max_iter) for r in b]


def _dense_anderson(A, b, tol, m=6, lam=1e-5, max_iter=MAX_ITER):
    """Anderson (type I, tau = 1) with memory m and relative regularization lam · max_j |g_j|², dense
    float64: alpha = (H + reg I)^{-1} 1 / (1ᵀ (H + reg I)^{-1} 1), x <- Σ alpha_j f(x_j)."""
    out = []
    for s in range(b.shape[0]):
        x = np.zeros(D)
        Fs, Gs = [], []
        nfe = 0
        while nfe < max_iter:
            fx = A @ x + b[s]
            nfe += 1
            if _rel(fx, x) < tol:
                break
            Fs, Gs = (Fs + [fx])[-m:], (Gs + [fx - x])[-m:]
            G = np.array(Gs)
            H = G @ G.T
            a = np.linalg.solve(H + lam * H.diagonal().max() * np.eye(len(Gs)), np.ones(len(Gs)))
            x = (a / a.sum()) @ np.array(Fs)
        out.append(nfe if _rel(fx, x) < tol else None)
    return out


@cache
def _reference(method: str, c: float, seed: int, tol: float, kind: str = "gaussian") -> list:
    A, b = _system(c, seed, kind)
    return (_dense_broyden if method == "broyden" else _dense_anderson)(A, b, tol)


@cache
def _float32_map_reference(c: float, seed: int, tol: float, kind: str) -> list:
    """The dense float64 Broyden on the float32 map the solver sees: x rounded to float32, A x + b formed in
    float32 (the solver's own rounding is absent; only the map's remains)."""
    A, b = _system(c, seed, kind)
    A32, b32 = A.astype(np.float32), b.astype(np.float32)
    def f32(x, row):
        return (A32 @ x.astype(np.float32) + row).astype(np.float64)

    return [_dense_broyden_on(lambda x, r=r: f32(x, r), tol) for r in b32]


def _dense_broyden_on(fn, tol, max_iter=MAX_ITER, float32_iterates=False):
    """`_dense_broyden` for one sample of map `fn`; returns its NFE (None if it stalls). With
    `float32_iterates`, each iterate is rounded to float32 (and the step taken is the rounded one)."""
    x = np.zeros(D)
    B = -np.eye(D)
    fx = fn(x)
    g = fx - x
    nfe = 1
    while _rel(fx, x) >= tol and nfe < max_iter:
        dx = -B @ g
        if float32_iterates:
            dx = (x + dx).astype(np.float32).astype(np.float64) - x
        x = x + dx
        fx = fn(x)
        nfe += 1
        g_new = fx - x
        Bdg = B @ (g_new - g)
        B = B + np.outer(dx - Bdg, dx @ B) / (dx @ Bdg)
        g = g_new
    return nfe if _rel(fx, x) < tol else None


def broyden_bound(kind: str, dtype: torch.dtype, c: float, seed: int) -> float:
    """The NFE bound of Broyden on one system (see the module docstring)."""
    tol = TOL[dtype]
    ref = _reference("broyden", c, seed, tol, kind)
    assert None not in ref, ref  # the reference converges on every system of the family
    if dtype == torch.float32 and (kind == "gaussian" or c == 0.0):
        return 1.6 * max(ref)  # issue 35's bound: 1.6x the dense float64 reference on the float64 map
    if dtype == torch.float32:
        ref32 = _float32_map_reference(c, seed, tol, kind)
        assert None not in ref32, ref32
        return 1.6 * max(ref + ref32)
    return 1.3 * max(ref + _perturbed_reference(c, seed, tol, kind))


@pytest.fixture
def path():
    """One implementation per solver (torch); a fixture so each test names what it runs."""
    return "torch"


CASES = [
    *[("gaussian", dt, c, seed) for dt in (torch.float64, torch.float32) for c in (0.0, 1.0, 1.5, 3.0)
      for seed in (0, 1, 2)],
    *[("triangular", torch.float64, c, seed) for c in (0.0, 1.0, 1.5) for seed in (0, 1, 2)],
    *[("triangular", torch.float32, c, seed) for c in (0.0, 1.0) for seed in (0, 1, 2)],
]  # fmt: skip


@cache
def _perturbed_reference(c: float, seed: int, tol: float, kind: str) -> list:
    """The dense Broyden on b (1 + 1e-15 ε): the reference's own rounding spread (at tol 1e-10 it moves the
    NFE by up to 20% on symmetric systems and 50% on triangular ones)."""
    A, b = _system(c, seed, kind)
    eps = np.random.default_rng(5).standard_normal(b.shape)
    return _dense_broyden(A, b * (1 + 1e-15 * eps), tol)


@pytest.mark.parametrize(("kind", "dtype", "c", "seed"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_broyden_and_anderson_match_dense_references(path, kind, dtype, c, seed):
    A, b = _system(c, seed, kind)
    tol = TOL[dtype]
    At, bt = torch.from_numpy(A).to(dtype), torch.from_numpy(b).to(dtype)
    f = lambda z: z @ At.T + bt  # noqa: E731
    x0 = torch.zeros(BATCH, D, dtype=dtype)

    bound = broyden_bound(kind, dtype, c, seed)
    _, st = broyden(f, x0, max_iter=MAX_ITER, tol=tol)
    assert st.converged.all(), (path, st.summary(), bound)
    assert st.nfe <= bound, (path, st.nfe, bound)
    if kind == "triangular":
        return

    ref = _reference("anderson", c, seed, tol)
    assert None not in ref, ref
    _, st = anderson(f, x0, max_iter=MAX_ITER, tol=tol)
    assert st.converged.all(), (path, st.summary(), ref)
    assert st.nfe <= 1.1 * max(ref), (path, st.nfe, ref)


@pytest.mark.parametrize("c", [0.0, 1.0])
def test_float32_broyden_is_not_on_an_edge(path, c):
    """float32 Broyden on the triangular family with b moved at float32's rounding level (1e-7 relative,
    four draws): the rounding differences another CPU's reduction order makes are of this size, so each
    draw must converge within the same bound as the unperturbed system."""
    for seed in (0, 1, 2):
        A, b = _system(c, seed, "triangular")
        bound = broyden_bound("triangular", torch.float32, c, seed)
        At = torch.from_numpy(A).float()
        for draw in range(4):
            eps = np.random.default_rng(100 + draw).standard_normal(b.shape)
            bt = torch.from_numpy(b * (1 + 1e-7 * eps)).float()
            _, st = broyden(lambda z: z @ At.T + bt, torch.zeros(BATCH, D), max_iter=MAX_ITER, tol=1e-5)  # noqa: B023
            assert st.converged.all() and st.nfe <= bound, (path, seed, draw, st.summary(), bound)


def test_float32_iterates_alone_exceed_the_bound():
    """Why triangular c = 1.5 has no float32 case: the dense float64 Broyden on the exact float64 map, whose
    only change is that every iterate is rounded to float32 (as any solver with float32 states must hand
    f), needs more than 2x its own float64 NFE on these systems (observed 1.5-6.4x by seed): the limit is
    the state's precision, not the solver's arithmetic."""
    worst = 0.0
    for seed in (0, 1, 2):
        A, b = _system(1.5, seed, "triangular")
        ref = _reference("broyden", 1.5, seed, 1e-5, "triangular")
        nfe = [_dense_broyden_on(lambda x, A=A, r=r: A @ x + r, 1e-5, float32_iterates=True) for r in b]
        worst = max(worst, max(MAX_ITER if n is None else n for n in nfe) / max(ref))
    assert worst > 2.0, worst
