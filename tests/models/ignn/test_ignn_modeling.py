"""IGNN model: operator, projection, λ_pf, equilibrium and gradients against dense independent references;
input conventions; clear errors."""

from __future__ import annotations

import pytest
import torch

from deqzoo.models.ignn import (
    IGNNConfig,
    IGNNForGraphClassification,
    IGNNForNodeClassification,
    IGNNModel,
    augmented_normalized_adjacency,
    perron_frobenius_radius,
    project_rows_l1,
)

torch.set_num_threads(1)
TIGHT = {
    "f_solver": "fixed_point",
    "f_max_iter": 500,
    "f_tol": 1e-12,
    "f_stop_mode": "abs",
    "b_solver": "fixed_point",
    "b_max_iter": 500,
    "b_tol": 1e-12,
    "b_stop_mode": "abs",
}


def random_graph(n=15, e=40, seed=0, weighted=True):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    w = torch.rand(e, generator=g, dtype=torch.float64) + 0.5 if weighted else None
    return ei, w


def dense_operator(ei, w, n):
    """The original's formula, dense: Â = D^-1/2 (A + I) D^-1/2, D = row sums, applied transposed."""
    a = torch.zeros(n, n, dtype=torch.float64)
    a.index_put_(
        (ei[0], ei[1]), w if w is not None else torch.ones(ei.shape[1], dtype=torch.float64), accumulate=True
    )
    a = a + torch.eye(n, dtype=torch.float64)
    d = a.sum(1).pow(-0.5)
    return (d[:, None] * a * d[None, :]).T


def test_operator_matches_dense_formula():
    ei, w = random_graph()
    op = augmented_normalized_adjacency(ei, 15, w, dtype=torch.float64)
    torch.testing.assert_close(op.to_dense(), dense_operator(ei, w, 15))


def _bisection_projection(row: torch.Tensor, r: float) -> torch.Tensor:
    # independent reference: find θ with Σ max(|w| - θ, 0) = r by bisection
    if row.abs().sum() <= r:
        return row
    lo, hi = 0.0, row.abs().max().item()
    for _ in range(200):
        mid = (lo + hi) / 2
        if (row.abs() - mid).clamp_min(0).sum() > r:
            lo = mid
        else:
            hi = mid
    return row.sign() * (row.abs() - hi).clamp_min(0)


def test_l1_projection_against_bisection():
    w = torch.randn(20, 9, dtype=torch.float64)
    w[:5] *= 0.01  # rows already inside stay unchanged
    out = project_rows_l1(w, 0.9)
    ref = torch.stack([_bisection_projection(r, 0.9) for r in w])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert out.abs().sum(1).max() <= 0.9 + 1e-12
    torch.testing.assert_close(out[:5], w[:5])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_perron_frobenius_radius_upper_bound_and_tight(seed):
    ei, w = random_graph(n=30, e=120, seed=seed)
    op = augmented_normalized_adjacency(ei, 30, w, dtype=torch.float64)
    exact = torch.linalg.eigvals(op.to_dense().abs()).abs().max().item()
    est = perron_frobenius_radius(op, tol=1e-8)
    assert exact - 1e-9 <= est <= exact * (1 + 1e-5)


def test_spectral_radius_closed_form_and_signed_fallback():
    model = IGNNModel(IGNNConfig(in_features=2, hidden_size=3))
    ei, w = random_graph(n=30, e=120, seed=5)
    x = torch.zeros(30, 2, dtype=torch.float64)
    graph = model.prepare_graph(x, ei, w)
    exact = torch.linalg.eigvals(graph.operator.to_dense().abs()).abs().max().item()
    assert graph.spectral_radius() == 1.0 and abs(exact - 1.0) < 1e-9  # similar to a row-stochastic matrix
    signed = w * torch.where(torch.arange(120) % 3 == 0, -0.1, 1.0).double()  # row sums stay > 0
    graph = model.prepare_graph(x, ei, signed)
    exact = torch.linalg.eigvals(graph.operator.to_dense().abs()).abs().max().item()
    assert not graph.nonnegative and exact - 1e-9 <= graph.spectral_radius() <= exact * (1 + 1e-5)
    with pytest.raises(ValueError, match="row sum of A"):
        model.prepare_graph(x, ei, -w)


def test_equilibrium_and_projection_against_dense_reference():
    ei, w = random_graph()
    x = torch.randn(15, 4, dtype=torch.float64)
    model = IGNNModel(IGNNConfig(in_features=4, hidden_size=6, deq=TIGHT)).double().eval()
    with torch.no_grad():
        model.layers[0].W.weight.mul_(4.0)  # far outside the bound: the forward must project it
        stored = model.layers[0].W.weight.clone()
        out = model(x, ei, w)
    # inference solves with the projected W and leaves the stored one as it is (one model may serve several
    # threads and graphs at once); training projects the stored W in place, as the original
    assert torch.equal(model.layers[0].W.weight, stored)
    a = dense_operator(ei, w, 15)
    rho = torch.linalg.eigvals(a.abs()).abs().max().item()
    model.train()
    model(x, ei, w)
    model.eval()
    wt, om = model.layers[0].W.weight.detach(), model.layers[0].Omega_1.weight
    assert wt.abs().sum(1).max().item() <= 0.9 / rho + 1e-9 and not torch.equal(wt, stored)
    z = torch.zeros(15, 6, dtype=torch.float64)
    for _ in range(2000):  # dense plain iteration, independent of the engine
        z = torch.relu(a @ z @ wt.T + a @ x @ om.T)
    torch.testing.assert_close(out.last_hidden_state, z, atol=1e-9, rtol=0)


def test_ift_gradients_against_unrolled_dense_autograd():
    ei, w = random_graph(seed=3)
    x = torch.randn(15, 4, dtype=torch.float64)
    labels = torch.randint(0, 3, (15,))
    cfg = IGNNConfig(in_features=4, hidden_size=6, num_labels=3, dropout=0.0, deq=TIGHT)
    model = IGNNForNodeClassification(cfg).double().train()
    model.ignn.project_weights(
        model.ignn.prepare_graph(x, ei, w)
    )  # feasible W, so the forward's projection is a no-op
    loss = model(x, ei, w, labels=labels).loss
    loss.backward()
    a = dense_operator(ei, w, 15)
    wt = model.ignn.layers[0].W.weight.detach().clone().requires_grad_(True)
    om = model.ignn.layers[0].Omega_1.weight.detach().clone().requires_grad_(True)
    v = model.classifier.weight.detach().clone().requires_grad_(True)
    z = torch.zeros(15, 6, dtype=torch.float64)
    for _ in range(300):
        z = torch.relu(a @ z @ wt.T + a @ x @ om.T)
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.normalize(z, dim=-1) @ v.T, labels)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(model.ignn.layers[0].W.weight.grad, wt.grad, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(model.ignn.layers[0].Omega_1.weight.grad, om.grad, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(model.classifier.weight.grad, v.grad, atol=1e-8, rtol=1e-6)


def test_pyg_style_and_sparse_adjacency_give_identical_outputs():
    ei, w = random_graph()
    w = w.float()
    x = torch.randn(15, 4)
    model = IGNNForNodeClassification(IGNNConfig(in_features=4, hidden_size=6, num_labels=3)).eval()
    with torch.no_grad():
        a = model(x, ei, w).logits
        coo = torch.sparse_coo_tensor(ei, w, (15, 15))
        b = model(x, adjacency=coo).logits
        c = model(x, adjacency=coo.coalesce().to_sparse_csr()).logits
    assert torch.equal(a, b) and torch.equal(a, c)


def test_pyg_data_object_gives_identical_outputs():
    pyg = pytest.importorskip("torch_geometric.data")
    ei, w = random_graph()
    x = torch.randn(15, 4)
    model = IGNNForNodeClassification(IGNNConfig(in_features=4, hidden_size=6, num_labels=3)).eval()
    data = pyg.Data(x=x, edge_index=ei, edge_weight=w.float())
    with torch.no_grad():
        assert torch.equal(model(data).logits, model(x, ei, w.float()).logits)
        assert torch.equal(model(data=data).logits, model(x, ei, w.float()).logits)


def test_graph_batch_equals_graphs_solved_separately():
    cfg = IGNNConfig(
        in_features=3,
        hidden_size=5,
        num_layers=2,
        num_labels=2,
        graph_head_hidden=4,
        spectral_radius=1.0,
        deq=TIGHT,
    )
    model = IGNNForGraphClassification(cfg).double().eval()
    x1, x2 = torch.randn(6, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    e1, e2 = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]), torch.tensor([[0, 1, 3], [2, 2, 0]])
    with torch.no_grad():
        together = model(
            torch.cat([x1, x2]), torch.cat([e1, e2 + 6], 1), batch=torch.tensor([0] * 6 + [1] * 4)
        ).logits
        apart = torch.cat([model(x1, e1).logits, model(x2, e2).logits])
    torch.testing.assert_close(together, apart, atol=1e-10, rtol=0)


def test_spectral_norm_variant_and_save_load_roundtrip(tmp_path):
    cfg = IGNNConfig(
        in_features=4,
        hidden_size=6,
        num_labels=3,
        injection="adjacency+linear",
        norm_type="spectral_norm",
        norm_clip=True,
        architectures=["IGNNForNodeClassification"],
    )
    model = IGNNForNodeClassification(cfg).eval()
    ei, _ = random_graph()
    x = torch.randn(15, 4)
    with torch.no_grad():
        before = model(x, ei).logits
    assert "ignn.layers.0.W.weight_orig" in model.state_dict()
    model.save_pretrained(tmp_path)
    loaded = IGNNForNodeClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, ei).logits, before)
    loaded.set_deq(f_max_iter=7)
    assert loaded.ignn.deq.config.f_max_iter == 7


def test_auto_classes_roundtrip(tmp_path):
    import transformers

    import deqzoo  # noqa: F401 - registers the family

    cfg = IGNNConfig(in_features=4, hidden_size=6)
    IGNNModel(cfg).save_pretrained(tmp_path)
    __import__("deqzoo").register()  # stock transformers code: families registered explicitly
    assert type(transformers.AutoConfig.from_pretrained(tmp_path)).__name__ == "IGNNConfig"
    assert type(transformers.AutoModel.from_pretrained(tmp_path)).__name__ == "IGNNModel"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(torch.zeros(0, 4), torch.zeros(2, 0, dtype=torch.long)), "empty graph"),
        (lambda m: m(torch.randn(5, 4), torch.tensor([[0, 1], [1, 5]])), "5 nodes"),
        (lambda m: m(torch.randn(5, 4), torch.tensor([[0, -1], [1, 2]])), r"\[-1, 2\]"),
        (lambda m: m(torch.randn(5, 3), torch.tensor([[0], [1]])), "in_features=4"),
        (lambda m: m(torch.randn(5, 4), torch.tensor([[0, 1, 2]])), r"shape \(2, num_edges\)"),
        (lambda m: m(torch.randn(5, 4), torch.tensor([[0], [1]]), torch.ones(3)), "edge_weight"),
        (lambda m: m(torch.randn(5, 4), adjacency=torch.eye(6).to_sparse()), r"x has 5 nodes"),
        (lambda m: m(torch.randn(5, 4), adjacency=torch.eye(5)), "sparse"),
        (
            lambda m: m(torch.randn(5, 4), torch.tensor([[0], [1]]), batch=torch.zeros(4, dtype=torch.long)),
            "batch",
        ),
        (lambda m: m(torch.randn(5, 4)), "edge_index"),
    ],
)
def test_bad_inputs_get_clear_errors(call, message):
    model = IGNNModel(IGNNConfig(in_features=4, hidden_size=6)).eval()
    with pytest.raises((ValueError, TypeError), match=message):
        call(model)


def test_config_validation():
    with pytest.raises(ValueError, match="injection"):
        IGNNConfig(injection="nope")
    with pytest.raises(ValueError, match="hidden_size"):
        IGNNConfig(hidden_size=0)


def test_implicit_layer_init():
    """What a model built from a config starts from (the comment in IGNNImplicitLayer.reset_parameters says
    why): W ~ U(±1/sqrt(hidden)) as the original; Ω₁ ~ U(±1/sqrt(in_features)), PyTorch's Linear draw,
    narrower than the original's U(±1/sqrt(hidden)) here (200 features, hidden 16: 0.071 vs 0.25)."""
    hidden, features = 16, 200
    torch.manual_seed(0)
    layer = IGNNForNodeClassification(IGNNConfig(in_features=features, hidden_size=hidden, num_labels=2)
                                      ).ignn.layers[0]
    for w, bound in ((layer.W.weight, hidden**-0.5), (layer.Omega_1.weight, features**-0.5)):
        w = w.detach().double().flatten()
        assert float(w.abs().max()) <= bound
        # U(-b, b) with >= 256 draws: max |w| near b, std within 10% of b / sqrt(3)
        assert float(w.abs().max()) > 0.95 * bound
        assert abs(float(w.std()) - bound / 3**0.5) < 0.1 * bound / 3**0.5


@pytest.mark.parametrize("how", ["add", "mean", "max"])
def test_graph_pooling_matches_a_per_graph_reduction(how):
    from deqzoo.models.ignn.modeling_ignn import _pool

    torch.manual_seed(0)
    z = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    batch = torch.tensor([0, 0, 1, 1, 1, 3, 3])  # graph 2 has no nodes: it pools to zeros
    ref = torch.zeros(4, 3, dtype=torch.float64)
    for g in (0, 1, 3):
        rows = z[batch == g]
        ref[g] = {"add": rows.sum(0), "mean": rows.mean(0), "max": rows.amax(0)}[how]
    out = _pool(z, batch, 4, how)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(out.square().sum(), z)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), z)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
