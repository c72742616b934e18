"""The engine under unusual inputs: every tensor torch can hand back from f (run in a subprocess, so a crash
fails the test instead of killing pytest), f keeping its inputs, one semantics per sample whatever the batch,
empty batches, budgets far beyond the work done, GMRES on NaN and singular maps, f's output checked on every
call, and a fresh process that solves without importing numba or starting a child process."""

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deqzoo.core import DEQ, DEQConfig, solve
from deqzoo.core.solvers import anderson, broyden, fixed_point, gmres


@pytest.fixture
def path():
    """One implementation per solver (the torch one); kept as a fixture so each test names what it runs."""
    return "torch"


# ------------------------------------------------------------------------------------------------ inputs

_ODD_OUTPUTS = textwrap.dedent(
    """
    import json, sys, torch
    from torch.utils._pytree import tree_map
    from deqzoo.core import solve
    from deqzoo.core.solvers import anderson, broyden
    torch.manual_seed(0)
    B, D = 4, 8
    A = 0.5 * torch.linalg.qr(torch.randn(D, D))[0]
    c = torch.randn(B, D)

    def lin(z):
        return z @ A.T + c

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

        def __init__(self, elem):
            self.elem = elem

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t.elem if isinstance(t, Wrapper) else t
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def offset(z):
        buf = torch.empty(B * D + 5)
        out = buf[5:].view(B, D)
        out.copy_(lin(z))
        return out

    CASES = {
        "zero_tensor": lambda z: torch._efficientzerotensor(B, D),
        "expanded": lambda z: (lin(z)[:1]).expand(B, D),
        "negated_view": lambda z: torch._neg_view(-lin(z)),
        "conj_imag": lambda z: torch.complex(torch.zeros_like(z), -lin(z)).conj().imag,
        "conjugated_complex": lambda z: torch.complex(lin(z), lin(z)).conj(),
        "transposed": lambda z: lin(z).t().contiguous().t(),
        "storage_offset": offset,
        "sparse": lambda z: lin(z).to_sparse(),
        "sparse_csr": lambda z: lin(z).to_sparse_csr(),
        "mkldnn": lambda z: lin(z).to_mkldnn(),
        "meta": lambda z: torch.empty(B, D, device="meta"),
        "wrapper_subclass": lambda z: Wrapper(lin(z)),
    }
    def plain(t):
        # the reference: the same values as a plain dense float32 tensor, made by hand (or the error)
        if isinstance(t, Wrapper):
            t = t.elem
        if t.is_complex():
            raise TypeError("f returned complex values")
        if t.is_meta:
            raise ValueError("f returned a meta tensor")
        if t.layout is not torch.strided:
            t = t.to_dense()
        t = torch.zeros(t.shape) + t  # materialises zero tensors, negated and conjugated views
        return torch.tensor(t.tolist(), dtype=torch.float32)

    for name, f in CASES.items():
        for solver in (anderson, broyden):
            row = {}
            for ref in (False, True):
                try:
                    g = (lambda z, f=f: plain(f(z))) if ref else f
                    z, st = solver(g, torch.zeros(B, D), max_iter=60, tol=1e-6)
                    row[ref] = {"z": z.tolist(), "nfe": st.nfe, "conv": st.converged.tolist()}
                except Exception as e:
                    row[ref] = {"error": type(e).__name__ + ": " + str(e)}
            row = {"case": name, "solver": solver.__name__, "fused": row[False], "torch": row[True]}
            print(json.dumps(row), flush=True)
    # channels-last and other memory formats of a structured state, through solve()
    w = torch.randn(3, 3, 1, 1) * 0.2
    x = torch.randn(2, 3, 4, 4)
    f4 = lambda z: (torch.nn.functional.conv2d(z, w) + x).contiguous(memory_format=torch.channels_last)
    for solver in ("anderson", "broyden"):
        row = {}
        for ref in (False, True):
            g = (lambda z: f4(z).contiguous()) if ref else f4
            z, st = solve(g, torch.zeros(2, 3, 4, 4), solver=solver, max_iter=60, tol=1e-6)
            row[ref] = {"z": z.flatten().tolist(), "nfe": st.nfe, "conv": st.converged.tolist()}
        row = {"case": "channels_last", "solver": solver, "fused": row[False], "torch": row[True]}
        print(json.dumps(row), flush=True)
    print("DONE", flush=True)
    """
)


def test_every_kind_of_tensor_from_f_gives_the_plain_tensor_result_or_a_clear_error():
    """Each odd tensor f may return ("fused" below) solves as its values copied by hand into a plain dense
    tensor ("torch"), or fails with a clear error naming what f returned."""
    proc = subprocess.run([sys.executable, "-c", _ODD_OUTPUTS], capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "DONE", (
        proc.returncode,
        lines[-2:],
        proc.stderr[-3000:],
    )
    rows = [json.loads(line) for line in lines[:-1]]
    assert {r["case"] for r in rows} >= {
        "zero_tensor", "expanded", "negated_view", "conjugated_complex", "storage_offset", "sparse", "mkldnn",
        "meta", "wrapper_subclass", "channels_last",
    }  # fmt: skip
    for r in rows:
        fused, ref = r["fused"], r["torch"]
        if "error" in fused:  # a clear error, naming what f returned
            assert "f returned" in fused["error"], r
            assert "error" in ref and ref["error"].split(":")[0] == fused["error"].split(":")[0], r
            continue
        assert "error" not in ref, r
        assert fused["nfe"] == ref["nfe"] and fused["conv"] == ref["conv"], r
        torch.testing.assert_close(torch.tensor(fused["z"]), torch.tensor(ref["z"]), rtol=1e-5, atol=1e-5)
    by_case = {r["case"]: r for r in rows}
    assert "meta tensor" in by_case["meta"]["fused"]["error"]
    assert "dtype torch.complex64" in by_case["conjugated_complex"]["fused"]["error"]
    assert by_case["zero_tensor"]["fused"]["conv"] == [True] * 4  # the fixed point of f = 0 is 0
    assert max(map(abs, by_case["zero_tensor"]["fused"]["z"][0])) == 0.0


# ------------------------------------------------------------------------------ one semantics per sample


def _staggered(dtype, b=6, d=40, seed=1):
    """A batch whose samples converge at very different steps (injections over three decades)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].to(dtype) * 0.95
    scales = torch.logspace(-1, 0.7, b, dtype=torch.float64)[:, None].to(dtype)
    inj = (torch.randn(b, d, generator=g, dtype=torch.float64).to(dtype)) * scales
    return (lambda z: torch.tanh(z @ W.T + inj)), torch.zeros(b, d, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("solver", [anderson, broyden])
def test_each_sample_is_its_own_solve_in_a_staggered_batch(solver, dtype, tol):
    """The samples of a staggered batch stop at different steps; each one's answer, NFE and residual are
    those of its own solve (f on the whole batch, not marked rowwise: the stopped rows ride along)."""
    f, x0 = _staggered(dtype)
    kw = {"return_inverse": True} if solver is broyden else {}
    z1, s1 = solver(f, x0, max_iter=300, tol=tol, **kw)
    assert s1.converged.all() and len(set(s1.nfe_per_sample.tolist())) > 2
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    for i in range(6):
        zi, si = solver(lambda z, i=i: f(z.expand(6, -1))[i : i + 1], x0[i : i + 1], max_iter=300, tol=tol,
                        **kw)  # fmt: skip
        torch.testing.assert_close(zi, z1[i : i + 1], rtol=rtol, atol=rtol * 1e-2)
        assert si.nfe_per_sample.tolist() == s1.nfe_per_sample[i : i + 1].tolist()
        if solver is broyden:  # SHINE's estimate of the sample is its own solve's (same steps; applied at
            # another rank, the batch's largest, so its triangular solve rounds differently: ~1e-7 in float64)
            v = torch.randn(1, 40, dtype=dtype, generator=torch.Generator().manual_seed(0))
            a, b = s1.extra["inverse_jacobian"], si.extra["inverse_jacobian"]
            p, q = a.rmatvec(torch.cat([v] * 6))[i : i + 1], b.rmatvec(v)
            assert float((p - q).norm() / q.norm()) < (1e-6 if dtype == torch.float64 else 1e-3)


_KEEPERS = {
    "tensor": lambda z: z,
    "view": lambda z: z[1:],
    "numpy": lambda z: z.numpy(),
    "reshaped": lambda z: z.reshape(-1),
    "graph": lambda z: _saved_for_backward(z),  # autograd holds z itself, no Python reference to it
}


def _saved_for_backward(z):
    w = torch.ones(z.shape[-1], dtype=z.dtype, requires_grad=True)
    return (z * w).sum(), w  # d/dw = z.sum(0), read from the saved z


@pytest.mark.parametrize("keep", list(_KEEPERS))
@pytest.mark.parametrize("solver", [fixed_point, anderson, broyden, gmres])
def test_f_may_keep_its_inputs(path, solver, keep):
    """f keeps every input it sees, or a view, array or autograd graph of it (no copy): none is written
    afterwards, and all are distinct buffers."""
    f, x0 = _staggered(torch.float64)
    seen, held, copies = [], [], []

    def keeper(z):
        with torch.enable_grad():
            held.append(_KEEPERS[keep](z))
        seen.append(z.data_ptr())
        copies.append(z.clone())
        return f(z)

    solver(keeper, x0, max_iter=40, tol=1e-9)
    assert len(seen) > 5
    for h, c in zip(held, copies):
        if keep == "graph":
            (g,) = torch.autograd.grad(h[0], h[1])
            assert torch.equal(g, c.sum(0))
        else:
            h = torch.as_tensor(h).reshape(-1)
            assert torch.equal(h, c.reshape(-1)[-h.numel():])
    assert len(set(seen)) == len(seen) or solver is gmres  # gmres: f on x0 + v_j, fresh, but it may re-add


# ------------------------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("solver", ["fixed_point", "anderson", "broyden", "gmres"])
def test_empty_batch_returns_empty_outputs(path, solver):
    calls = []
    z0 = (torch.zeros(0, 3, 4), torch.zeros(0, 5))
    z, st = solve(lambda zs: calls.append(1) or zs, z0, solver=solver, max_iter=10, tol=1e-6)
    assert [t.shape for t in z] == [(0, 3, 4), (0, 5)] and not calls
    assert st.nfe == 0 and st.converged.shape == (0,) and st.abs_residual.shape == (0,) and st.all_converged


@pytest.mark.parametrize("b_mode", ["ift", "shine", "jacobian_free", "phantom"])
def test_empty_batch_through_deq_forward_and_backward(path, b_mode):
    lin = torch.nn.Linear(4, 4)
    x = torch.zeros(0, 4, requires_grad=True)
    solver = "broyden" if b_mode == "shine" else "anderson"
    deq = DEQ(DEQConfig(f_solver=solver, b_mode=b_mode, f_max_iter=10, b_max_iter=10))
    z, st = deq(lambda z: torch.tanh(lin(z) + x), torch.zeros(0, 4))
    assert z.shape == (0, 4) and st.nfe == 0
    z.sum().backward()
    assert x.grad.shape == (0, 4)


# ----------------------------------------------------------------------------------- memory by work done


@pytest.mark.parametrize("solver,kw", [("broyden", {}), ("anderson", {"m": 10**9}), ("gmres", {}),
                                       ("fixed_point", {})])  # fmt: skip
def test_a_huge_budget_reserves_nothing(path, solver, kw):
    """max_iter = 1e9 for a solve that converges in a few steps: preallocating by the budget (a
    (B, max_iter, D) history, a max_iter² Hessenberg matrix) would ask for terabytes and fail at once."""
    A = 0.3 * torch.eye(64, dtype=torch.float64)
    c = torch.randn(4, 64, dtype=torch.float64)
    t = time.perf_counter()
    z, st = solve(lambda z: z @ A + c, torch.zeros(4, 64, dtype=torch.float64), solver=solver,
                  max_iter=10**9, tol=1e-5, **kw)  # fmt: skip
    assert st.converged.all() and st.nfe < 60 and time.perf_counter() - t < 30
    torch.testing.assert_close(z, c / 0.7, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------- gmres failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gmres_on_nan_and_singular_maps_ends_with_flags(dtype):
    x0 = torch.zeros(3, 6, dtype=dtype)
    c = torch.ones(3, 6, dtype=dtype)
    z, st = gmres(lambda z: z * float("nan") + c, x0, max_iter=20, tol=1e-6)
    assert z.shape == (3, 6) and not st.converged.any() and st.nonfinite
    # I - M = 0: (I - M) x = c has no solution; the Krylov basis degenerates after one step (in relative
    # terms a far-away x looks converged, |c| / |x + c| -> 0, so the absolute residual is the test here)
    z, st = gmres(lambda z: z + c, x0, max_iter=20, tol=1e-6, stop_mode="abs")
    assert torch.isfinite(z).all() and not st.converged.any()
    # a singular but consistent system: M = I on half the coordinates, c = 0 there
    M = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.5, 0.5, 0.5], dtype=dtype))
    c2 = torch.cat((torch.zeros(3, 3, dtype=dtype), torch.ones(3, 3, dtype=dtype)), 1)
    z, st = gmres(lambda z: z @ M + c2, x0, max_iter=20, tol=1e-5)
    assert st.converged.all()
    torch.testing.assert_close(z[:, 3:], torch.full((3, 3), 2.0, dtype=dtype))


# ------------------------------------------------------------------------------------ f checked every call


@pytest.mark.parametrize("solver", ["fixed_point", "anderson", "broyden", "gmres"])
def test_f_output_checked_on_every_call(path, solver):
    calls = []

    def f(z):
        calls.append(1)
        out = 0.5 * z + 1
        if len(calls) == 3:
            return out[:, :-1]
        if len(calls) == 4:
            return out.double()
        return out

    x0 = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*\(2, 5\)"):
        solve(f, x0, solver=solver, max_iter=20, tol=1e-9)
    with pytest.raises(TypeError, match="float64.*float32"):
        solve(f, x0, solver=solver, max_iter=20, tol=1e-9)
    calls.clear()
    g = get = {"fixed_point": fixed_point, "anderson": anderson, "broyden": broyden, "gmres": gmres}[solver]
    del get
    with pytest.raises(ValueError, match=r"f returned shape \(2, 4\), expected \(2, 5\)"):
        g(f, x0, max_iter=20, tol=1e-9)


@pytest.mark.parametrize("solver", ["anderson", "broyden"])
def test_compiled_f(path, solver):
    """A torch.compile'd f (traced by dynamo and AOT autograd; the aot_eager backend skips the C++ build)
    gives the same solve as the plain f on both paths: fresh inputs of one shape each step."""
    torch._dynamo.reset()
    f, x0 = _staggered(torch.float64)
    fc = torch.compile(f, backend="aot_eager", dynamic=False)
    z, st = solve(fc, x0, solver=solver, max_iter=300, tol=1e-9)
    z_ref, st_ref = solve(f, x0, solver=solver, max_iter=300, tol=1e-9)
    assert st.converged.all() and st.nfe == st_ref.nfe
    torch.testing.assert_close(z, z_ref)


# ------------------------------------------------------------------------------------------------ first use

_FRESH = textwrap.dedent(
    """
    import os, sys, torch
    from deqzoo.core import solve
    A = 0.5 * torch.eye(64)
    c = torch.randn(8, 64)
    for solver in ("fixed_point", "anderson", "broyden", "hyperanderson"):
        kw = {}
        if solver == "hyperanderson":
            from deqzoo.core.hyper import MeanPoolNet
            kw = {"net": MeanPoolNet(), "m": 0}
        z, st = solve(lambda z: torch.tanh(z @ A + c), torch.zeros(8, 64), solver=solver, tol=1e-5, **kw)
        assert bool(st.converged.all()), solver
    me = os.getpid()
    children = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == me:
                        children.append(pid)
            except OSError:
                pass
    print("numba" in sys.modules, children, flush=True)
    """
)


def test_a_fresh_process_solves_without_numba_or_a_child_process():
    """A solve in a new process imports no numba, starts no child process and prints nothing."""
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False []", proc.stdout
    assert proc.stderr == "", proc.stderr[-2000:]
