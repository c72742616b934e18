"""`deqzoo predict` prints scores: the probabilities it reports are the model's own."""

from __future__ import annotations

import json
import re

import torch

import deqzoo
from deqzoo.predict import classify_nodes, complete_text, generate_text
from examples.deq_transformer import pydoc_lm
from examples.ignn import chains


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
