"""`deqzoo predict` prints scores: the probabilities it reports are the model's own."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import deqzoo
from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification
from deqzoo.predict import classify_nodes, complete_text, generate_text, predict
from examples.deq_transformer import pydoc_lm
from examples.ignn import chains
from examples.reasoner.puzzles import load_heldout


def test_chains_predict_reports_the_models_probabilities(tmp_path):
    model = deqzoo.from_pretrained("deqzoo/ignn-chains")
    ds = chains.make_chains(chain_length=12)
    path = tmp_path / "graph.json"
    path.write_text(json.dumps({"x": ds.x.tolist(), "edge_index": ds.edge_index.tolist()}))
    line = classify_nodes(model, str(path))
    with torch.no_grad():
        probs = model(ds.x, ds.edge_index).logits.softmax(-1)
    reported = json.loads(re.search(r"probabilities (\[.*?\])", line).group(1))
    assert reported == [round(float(p), 4) for p in probs.max(-1).values]
    assert "mean probability" in classify_nodes(model, "12")


def test_pydoc_predict_is_seeded_and_scored():
    model = deqzoo.from_pretrained("deqzoo/deq-transformer-tiny-pydoc", deq={"on_nonconvergence": "ignore"})
    first = complete_text(model, "The for statement is used to")
    assert first == complete_text(model, "The for statement is used to")  # seeded decoding
    text, _, probs = generate_text(model, "The for statement is used to", scores=True)
    assert first.startswith(text) and probs.numel() == 24 and bool(((probs > 0) & (probs <= 1)).all())
    gmean = float(probs.log().mean().exp())
    assert f"geometric mean {gmean:.4f}, min {float(probs.min()):.4f}" in first
    # the demo's sample is not greedy's degenerate loop
    # greedy proper: the checkpoint's generation_config.json carries a repetition penalty, switched off here
    greedy_decoding = {"do_sample": False, "repetition_penalty": 1.0}
    greedy, _ = generate_text(model, pydoc_lm.DEMO_PROMPT, decoding=greedy_decoding)
    sampled, _ = generate_text(model, pydoc_lm.DEMO_PROMPT)
    words = sampled.split()
    assert len(set(words)) / len(words) > len(set(greedy.split())) / len(greedy.split())


def test_predict_decodes_with_each_checkpoints_own_generation_config():
    """`deqzoo predict` keeps no decoding table: it samples with the shipped generation_config.json, which the
    examples' recipes (the decoding their cards describe) must match."""
    from transformers import GenerationConfig

    from deqzoo.hub import resolve
    from examples.deq_transformer import pystd_lm

    for name, decoding in (("deqzoo/deq-transformer-tiny-pydoc", pydoc_lm.DECODING),
                           ("deqzoo/deq-transformer-small-pystd", pystd_lm.DECODING),
                           ("deqzoo/deq-transformer-small-pystd-explicit", pystd_lm.DECODING)):
        shipped = GenerationConfig.from_pretrained(resolve(name)).to_diff_dict()
        assert {k: shipped.get(k) for k in decoding} == decoding, name
        sampling = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
        assert {k for k in sampling if k in shipped} == set(decoding), name  # no other knob shipped


def test_sudoku9_predict_prints_the_models_answer_row_by_row():
    """`deqzoo predict` on a 9×9 reasoner (task sudoku9): the answer is the model's argmax, row by row, and a
    6×6 puzzle is refused by its cell count before the model runs."""
    torch.manual_seed(0)
    model = ReasonerForGridClassification(ReasonerConfig(seq_len=81, vocab_size=10, num_labels=10,
                                                         hidden_size=16, num_heads=2, halt_max_steps=2))
    puzzle = load_heldout("sudoku9_heldout")["inputs"][0]
    text = " ".join("".join(str(d) if d else "." for d in row) for row in puzzle.reshape(9, 9))
    line = predict(model, "sudoku9", [text])
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(puzzle.astype(np.int64))[None]).logits.argmax(-1)[0]
    rows = line.split(" (")[0].split(" / ")
    assert rows == ["".join(map(str, expected[9 * r:9 * r + 9].tolist())) for r in range(9)]
    assert line.endswith("(2 segments)")
    with pytest.raises(ValueError, match="81 cells"):
        predict(model, "sudoku9", ["6..... ...41. .51.6. ...3.. .....3 .6..4."])
