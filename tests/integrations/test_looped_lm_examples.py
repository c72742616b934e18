"""The looped-LM example programs (`examples/looped_lm/`): the evaluation's decoding and window runs against
the stock model's own loss, per-token halting against the own loop, the targets' arithmetic, the drifting
configuration, and the card writer's refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def model():
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(0)
    cfg = HrmTextConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, head_dim=16, H_cycles=4, L_cycles=1, prefix_lm=False,
                        initializer_range=0.1)  # fmt: skip
    return HrmTextForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 50, (1, 13), generator=torch.Generator().manual_seed(1))


def _stock_nll(model, ids) -> float:
    with torch.no_grad():
        logits = model(ids[:, :-1], use_cache=False).logits
    return float(F.cross_entropy(logits[0], ids[0, 1:], reduction="sum"))


def test_own_loop_decoding_and_window_give_the_stock_loss(model, ids):
    from deqzoo.integrations.looped_lm import LoopedLM
    from examples.looped_lm.evaluate import run_decoding, run_window

    own = LoopedLM.own_loop(model)
    with torch.no_grad():
        dec, win = run_decoding(own, ids), run_window(own, ids)
    ref = _stock_nll(model, ids)
    assert dec["nll"] == pytest.approx(ref, rel=1e-5) and win["nll"] == pytest.approx(ref, rel=1e-5)
    assert dec["nfe"] == [4] * 12 and win["nfe"] == [4] * 12 and win["window_calls"] == 4


def test_halting_is_the_own_loop_cut_short_per_token(model, ids):
    from deqzoo.integrations.looped_lm import LoopedLM
    from examples.looped_lm.evaluate import run_decoding

    never = LoopedLM.from_model(model, solver="fixed_point", max_iter=4, tol=1e-30, answer="last")
    loose = LoopedLM.from_model(model, solver="fixed_point", max_iter=4, tol=0.2, answer="last")
    with torch.no_grad():
        a, b = run_decoding(never, ids), run_decoding(loose, ids)
    assert a["nll"] == pytest.approx(_stock_nll(model, ids), rel=1e-5)  # no token stops: the own loop
    assert a["nfe"] == [4] * 12 and not any(a["converged"])
    assert all(1 <= n <= 4 for n in b["nfe"]) and b["converged"] == [n < 4 or r < 0.2
                                                                     for n, r in zip(b["nfe"], b["residual"])]


def test_verdict_arithmetic():
    from examples.looped_lm.evaluate import verdict

    def r(loss, calls):
        import math

        return {"held_out_loss": loss, "perplexity": math.exp(loss), "f_calls_per_token": calls}

    results = {"own loop (8 calls)": r(2.0, 8), "anderson tol 0.3": r(2.1, 3), "anderson tol 0.1": r(1.99, 5),
               "halting tol 0.3": r(2.02, 4), "halting tol 0.1": r(2.005, 5.5)}  # fmt: skip
    v = verdict(results, 8, "own loop (8 calls)")
    assert v["anderson_reaching_own_loss"] == {"setting": "anderson tol 0.1", "calls_ratio": 5 / 8,
                                               "target": 0.6, "met": False}  # fmt: skip
    # exp(0.02) - 1 = 2.0% > 1%: only tol 0.1 (0.5%) counts, saving 1 - 5.5 / 8
    halt = v["halting_within_1pct_ppl"]
    assert halt["setting"] == "halting tol 0.1" and halt["saving"] == pytest.approx(0.3125) and halt["met"]
    assert v["anderson_lowest_loss"]["setting"] == "anderson tol 0.1"


def test_drifting_model_leaves_the_model_alone_and_is_reported_per_token(model, ids):
    from deqzoo.integrations.looped_lm import LoopedLM
    from examples.looped_lm.evaluate import drifting_model, run_decoding

    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = drifting_model(model, 20.0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    changed = [k for k, v in bad.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == ["model.H_module.layers.0.mlp.down_proj.weight",
                               "model.H_module.layers.0.self_attn.o_proj.weight"]  # fmt: skip
    looped = LoopedLM.from_model(bad, solver="anderson", max_iter=8, tol=1e-3, solver_kwargs={"m": 5})
    with torch.no_grad():
        out = run_decoding(looped, ids)
    assert len(out["converged"]) == 12 and not all(out["converged"])


def test_write_card_refuses_an_unfinished_run_and_an_existing_folder(tmp_path, monkeypatch, capsys):
    from examples.looped_lm import write_card

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"steps": "100"}))
    (run / "state.json").write_text(json.dumps({"step": 40, "log": [], "seconds": 1.0}))
    results = tmp_path / "eval.json"
    results.write_text("{}")
    argv = ["write_card.py", "--run", str(run), "--results", str(results), "--out", str(tmp_path / "card")]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match="step 40 of 100: the run is not finished"):
        write_card.main()
    assert not (tmp_path / "card").exists()
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "mine.txt").write_text("keep")
    (run / "state.json").write_text(json.dumps({"step": 100, "log": [], "seconds": 1.0}))
    with pytest.raises(SystemExit, match="exists: write_card.py creates a new folder"):
        write_card.main()
    assert (tmp_path / "card" / "mine.txt").read_text() == "keep"
