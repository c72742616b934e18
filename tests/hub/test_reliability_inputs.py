"""Reliability, inputs (issue 17): empty inputs give a clear error; image size, sequence length and graph
size have documented limits checked before work; sparse inputs are validated before torch touches them;
`deqzoo predict` inputs are bounded before they are read."""

from __future__ import annotations

import json
import time

import pytest
import torch

import deqzoo
from deqzoo.models.deq_transformer import modeling_deq_transformer as lm_mod
from deqzoo.models.ignn import IGNNConfig, IGNNModel
from deqzoo.models.ignn import modeling_ignn as ignn_mod
from deqzoo.models.mdeq import modeling_mdeq as mdeq_mod
from deqzoo.predict import classify_image, classify_nodes, complete_text


@pytest.fixture(scope="module")
def lm():
    return deqzoo.from_pretrained("deqzoo/deq-transformer-tiny-pydoc")


@pytest.fixture(scope="module")
def mdeq():
    return deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")


@pytest.fixture(scope="module")
def ignn():
    return deqzoo.from_pretrained("deqzoo/ignn-chains")


@pytest.mark.parametrize("shape", [(1, 0), (0, 5), (0, 0)])
def test_language_model_empty_input(lm, shape):
    with pytest.raises(ValueError, match=r"input_ids is empty \(shape"):
        lm(torch.zeros(shape, dtype=torch.long))


def test_language_model_sequence_limit_is_checked_before_work(lm, monkeypatch):
    ids = torch.zeros(1, lm_mod.MAX_SEQUENCE_LENGTH + 1, dtype=torch.long)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="8,193 tokens .* above the limit of 8,192 positions"):
        lm(ids)
    assert time.perf_counter() - start < 1
    monkeypatch.setattr(lm_mod, "MAX_SEQUENCE_LENGTH", 8)
    assert lm(torch.zeros(1, 8, dtype=torch.long)).logits.shape[1] == 8  # the limit itself is allowed


def test_language_model_float_ids(lm):
    with pytest.raises(ValueError, match="integer token ids, got dtype torch.float32"):
        lm(torch.zeros(1, 3))


@pytest.mark.parametrize("shape", [(0, 1, 28, 28), (1, 1, 0, 28), (2, 1, 28, 0)])
def test_image_model_empty_input(mdeq, shape):
    with pytest.raises(ValueError, match="pixel_values is empty"):
        mdeq(torch.zeros(shape))


def test_image_size_limit_is_checked_before_work(mdeq):
    huge = torch.zeros(1, 1, 1, 1).expand(1, 1, 4097, 4097)  # no memory behind it
    start = time.perf_counter()
    with pytest.raises(ValueError, match="4097x4097 = 16,785,409 pixels, above the limit of 16,777,216"):
        mdeq(huge)
    assert time.perf_counter() - start < 1
    assert mdeq_mod.MAX_IMAGE_PIXELS == 4096 * 4096


def _csr(crow, col, n=3):
    return torch.sparse_csr_tensor(torch.tensor(crow), torch.tensor(col), torch.ones(len(col)), (n, n),
                                   check_invariants=False)


@pytest.mark.parametrize("crow,col,message", [  # torch's own invariant checks, named in a ValueError
    ([0, 1, 5, 2], [0, 1], "CSR, a graph of 3 nodes.*crow_indices\\[..., 1:\\] - crow_indices"),
    ([1, 1, 2, 2], [0, 1], "crow_indices\\[..., 0\\] == 0"),
    ([0, 1, 2], [0, 1], "crow_indices.shape\\[-1\\] must be equal to the number of rows \\+ 1 \\(=4\\)"),
    ([0, 1, 2, 2], [0, 7], "valid indices 0..2.*0 <= col_indices < ncols"),
    ([0, 1, 2, 2], [0, -1], "0 <= col_indices < ncols"),
])
def test_invalid_csr_adjacency_is_refused_before_torch_converts_it(crow, col, message):
    """These crashed the interpreter inside torch's CSR -> COO conversion (issue 17)."""
    model = IGNNModel(IGNNConfig(in_features=2))
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(3, 2), adjacency=_csr(crow, col))


def test_invalid_coo_adjacency_is_refused():
    model = IGNNModel(IGNNConfig(in_features=2))
    adj = torch.sparse_coo_tensor(torch.tensor([[0, 5], [1, 0]]), torch.ones(2), (3, 3),
                                  check_invariants=False)
    with pytest.raises(ValueError, match="COO, a graph of 3 nodes.*for dim 0, size is 3 but found index 5"):
        model(torch.zeros(3, 2), adjacency=adj)


def test_valid_csr_adjacency_matches_the_edge_list():
    torch.manual_seed(0)
    model = IGNNModel(IGNNConfig(in_features=2)).eval()
    x = torch.randn(3, 2)
    edges = torch.tensor([[0, 1, 2], [1, 2, 0]])
    dense = torch.zeros(3, 3)
    dense[edges[0], edges[1]] = 1.0
    a = model(x, adjacency=dense.to_sparse_csr()).last_hidden_state
    b = model(x, edges).last_hidden_state
    torch.testing.assert_close(a, b)


def test_graph_size_limits(monkeypatch):
    model = IGNNModel(IGNNConfig(in_features=2))
    monkeypatch.setattr(ignn_mod, "MAX_GRAPH_NODES", 4)
    with pytest.raises(ValueError, match="graph has 5 nodes, above the limit of 4"):
        model(torch.zeros(5, 2), torch.tensor([[0], [1]]))
    monkeypatch.setattr(ignn_mod, "MAX_GRAPH_EDGES", 2)
    with pytest.raises(ValueError, match="graph has 3 edges, above the limit of 2"):
        model(torch.zeros(3, 2), torch.tensor([[0, 1, 2], [1, 2, 0]]))


def test_empty_graph():
    with pytest.raises(ValueError, match="empty graph"):
        IGNNModel(IGNNConfig(in_features=2))(torch.zeros(0, 2), torch.zeros(2, 0, dtype=torch.long))


def test_predict_on_a_2mb_text_file_is_refused_unread(lm, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("word " * 400_000)  # 2 MB
    start = time.perf_counter()
    with pytest.raises(ValueError, match="2,000,000 bytes; predict takes a prompt of at most 20,000"):
        complete_text(lm, str(path))
    assert time.perf_counter() - start < 1


def test_predict_long_literal_prompt_and_empty_prompt(lm):
    with pytest.raises(ValueError, match="the prompt has 20,001 characters"):
        complete_text(lm, "a" * 20_001)
    with pytest.raises(ValueError, match="the prompt is empty"):
        complete_text(lm, "   ")


def test_predict_image_decompression_bomb(mdeq, tmp_path):
    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("1", (10_000, 10_000)).save(path)  # 100 M pixels in a few KB
    assert path.stat().st_size < 100_000
    start = time.perf_counter()
    with pytest.raises(ValueError, match="bomb.png"):
        classify_image(mdeq, str(path))
    assert time.perf_counter() - start < 5


def test_predict_image_over_the_pixel_limit_is_not_decoded(mdeq, tmp_path):
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("L", (5000, 4000)).save(path)
    with pytest.raises(ValueError, match="5000x4000 = 20,000,000 pixels, above the limit of 16,777,216"):
        classify_image(mdeq, str(path))


@pytest.mark.parametrize("content", [b"not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b""])
def test_predict_unreadable_image(mdeq, tmp_path, content):
    path = tmp_path / "digit.png"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="digit.png' is not a readable image"):
        classify_image(mdeq, str(path))


def test_predict_chain_length_limit(ignn):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="chain length 1000000000 is outside"):
        classify_nodes(ignn, "1000000000")
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("graph,message", [
    ({"x": [[0.0] * 100], "edge_index": [[0, 1, 2]]}, "edge_index must have shape \\(2, num_edges\\), got"),
    ({"x": "abc", "edge_index": [[0], [0]]}, "must be numeric arrays"),
    ({"x": [[0.0] * 100], "edge_index": [[0], [7]]}, "node indices in \\[0, 7\\]"),
    ({"edge_index": [[0], [0]]}, "missing key 'x'"),
    ([1, 2], "top level must be a JSON object"),
])
def test_predict_bad_graph_file(ignn, tmp_path, graph, message):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    with pytest.raises(ValueError, match=message):
        classify_nodes(ignn, str(path))
