"""The fused path's iterate buffers (`deqzoo.core.solvers._contract._Iterates`): recycled when nothing but the
solver holds an iterate, never while f keeps one; no private torch / numba / CPython API in core."""

import re
from pathlib import Path

import pytest
import torch

import deqzoo.core
from deqzoo.core import _kernels
from deqzoo.core.solvers import anderson, broyden

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")


def _problem():
    W = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))[0] * 0.9
    inj = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    return lambda z: torch.tanh(z @ W.T + inj)


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_buffers_recycled_when_f_keeps_nothing(solver):
    f, seen = _problem(), set()

    def g(z):
        seen.add(z.data_ptr())
        return f(z)

    _, st = solver(g, torch.zeros(4, 32), max_iter=40, tol=1e-6)
    assert st.nfe > 10 and len(seen) <= 3, (st.nfe, len(seen))  # a ring of two (three at most)


@pytest.mark.parametrize("solver", [anderson, broyden])
def test_kept_inputs_never_change(solver):
    f, kept = _problem(), []

    def g(z):
        kept.append((z, z.clone()))
        return f(z)

    solver(g, torch.zeros(4, 32), max_iter=40, tol=1e-6)
    assert len({z.data_ptr() for z, _ in kept}) == len(kept)  # every kept iterate got a buffer of its own
    for z, copy in kept:
        assert torch.equal(z, copy)


def test_no_private_api_in_core():
    banned = re.compile(r"_use_count|_storage_Use_Count|getrefcount|_is_zerotensor|load_overload|\._cache\b")
    core = Path(deqzoo.core.__file__).parent
    hits = [f"{p.relative_to(core)}:{i}" for p in core.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]  # fmt: skip
    assert not hits, hits
