"""examples/deq_flow/make_cards.py's text from its reports: what a card says about video comes from the reuse
bench of that very checkpoint, and a pair published under other ids names the pair it did not replace."""

from __future__ import annotations

import pytest

from examples.deq_flow import make_cards


def _reuse(warp_hit: dict | None, cold_hit: dict | None, warp_change: float) -> dict:
    """The parts of a `deqzoo bench deq-flow` reuse report that the card's text reads."""
    return {
        "modes": {"warp": {"epe_change": warp_change}},
        "equal_accuracy": {
            "slack": 0.02,
            "modes": {"warp": {"at_target": warp_hit, "nfe_ratio": 0.234},
                      "none": {"at_target": cold_hit}},
        },
    }


def test_on_video_recommends_reuse_only_where_the_bench_found_it_reaches_equal_accuracy():
    found = make_cards._on_video(_reuse({"budget": 4}, None, -0.118), "deq-flow-cpu-synth")
    assert "warped start reaches with k = 4" in found and "0.23 of its steps" in found
    assert "reuse=False" not in found
    lost = make_cards._on_video(_reuse(None, {"budget": 3}, 0.5424), "deq-flow-cpu-synth-20k")
    assert "changes the EPE by +54.2%" in lost and "no reuse mode reaches" in lost
    assert "`model.estimate_sequence(frames, reuse=False, num_flow_updates=3)`" in lost
    assert "deq-flow-cpu-synth-20k" in lost and "ships with" not in lost
    # a card that ships sequence_reuse="none": reuse=True (and `deqzoo predict` on a folder) already solve
    # every pair from zero, so only the budget is left to say
    shipped = make_cards._on_video(_reuse(None, {"budget": 3}, 0.5424), "deq-flow-cpu-synth-20k", "none")
    assert 'ships with `sequence_reuse="none"`' in shipped and "because its flow depends" in shipped
    assert "(`num_flow_updates=3`)" in shipped and "reuse=False" not in shipped
    assert "reuse=False" not in make_cards._on_video(_reuse(None, None, 0.5), "x")  # no budget to give
    assert make_cards._on_video(None, "x") == ""  # no reuse bench: the card says nothing about video


def test_other_pair_names_the_pair_it_did_not_replace_with_their_card_numbers():
    from deqzoo.hub.cards import read_model_card

    def held_out(name):
        meta, _ = read_model_card(make_cards.ROOT / "model_cards" / name)
        metrics = meta["model-index"][0]["results"][0]["metrics"]
        return next(m["value"] for m in metrics if m["name"] == "Held-out synthetic EPE (px)")

    text = make_cards._other_pair(_reuse(None, {"budget": 3}, 0.5424))
    deq, twin = held_out(make_cards.DEQ_NAME), held_out(make_cards.RAFT_NAME)
    assert f"held-out EPE {deq:.4f} against {twin:.4f}" in text and "unchanged" in text
    assert "changes the EPE by +54.2%" in text
    assert "changes the EPE" not in make_cards._other_pair(_reuse({"budget": 4}, None, -0.1))


def test_ids_must_name_two_cards_of_this_kind_inside_model_cards(capsys):
    with pytest.raises(SystemExit):
        make_cards.main(["a", "b", "--ids", "same", "same"])
    # refused before anything is read or written: no card of another model is replaced, no path escapes
    for ids, said in ((["mdeq-tiny-mnist", "x-twin"], "holds another model (mdeq"),
                      (["deq-flow-cpu-raft-baseline", "x-twin"], "implicit=False"),
                      (["../outside", "x-twin"], "a card name is"), (["x", "a/b"], "a card name is")):
        with pytest.raises(SystemExit):
            make_cards.main(["missing-run", "missing-twin", "--ids", *ids])
        assert said in capsys.readouterr().err
    assert not (make_cards.ROOT / "model_cards" / "x-twin").exists()
