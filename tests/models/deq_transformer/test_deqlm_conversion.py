"""Converters reproduce the original implementations' outputs on committed fixtures.

Fixtures (conversion/fixtures/deq_transformer/) were produced once by running the upstream code outside the
repo:
locuslab/deq DEQ-Sequence (its own Anderson solver to 1e-12, float64) and TorchDEQ deq-zoo/deq-lm with pip
torchdeq (12 fixed-point iterations, its eval recipe). Each holds an original-format state dict of a tiny
config
and the original log-probabilities of two consecutive 6-token segments (the second uses the first's memory).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conversion import converter_module
from deqzoo.models.deq_transformer import DEQTransformerForCausalLM

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "conversion" / "fixtures" / "deq_transformer"


def _converter(name: str):
    return converter_module(name)


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    cache, out = None, []
    with torch.no_grad():
        for s in (0, 6):
            o = model(ids[:, s:s + 6], past_key_values=cache)
            cache = o.past_key_values
            out.append(torch.log_softmax(o.logits, -1))
    return torch.cat(out, 1).float()


LOCUSLAB = json.loads((FIX / "locuslab_configs.json").read_text())
TORCHDEQ = json.loads((FIX / "torchdeq_configs.json").read_text())


@pytest.mark.parametrize("case", sorted(LOCUSLAB))
def test_locuslab_parity(case, tmp_path):
    c = LOCUSLAB[case]
    conv = _converter("deq_transformer_locuslab")
    out = conv.FORMATS["deq-transformer-locuslab"](
        FIX / f"locuslab_{case}.pth", tmp_path / case, pre_lnorm=c["pre_lnorm"], cutoffs=c["cutoffs"],
        tgt_len=6, mem_len=4,
        deq={"f_solver": "anderson", "f_max_iter": 200, "f_tol": 1e-11, "f_stop_mode": "abs"})
    model = DEQTransformerForCausalLM.from_pretrained(out).double().eval()
    assert model.config.pre_lnorm == c["pre_lnorm"] and model.config.cutoffs == c["cutoffs"]
    exp = load_file(FIX / f"locuslab_{case}.expected.safetensors")
    lp = _logprobs(model, exp["input_ids"])
    assert (lp - exp["logprobs"]).abs().max() < 1e-4
    # upstream's adaptive softmax returns NLLs grouped by cluster (keep_order=False): compare as multisets
    nll = -lp.gather(-1, exp["labels"][..., None])[..., 0]
    assert torch.allclose(nll.flatten().sort().values, exp["nll"].flatten().sort().values, atol=1e-4)


@pytest.mark.parametrize("case", sorted(TORCHDEQ))
def test_torchdeq_parity(case, tmp_path):
    c = TORCHDEQ[case]
    conv = _converter("deq_transformer_torchdeq")
    out = conv.FORMATS["deq-transformer-torchdeq"](
        FIX / f"torchdeq_{case}.pth", tmp_path / case, tgt_len=6, mem_len=4,
        deq={"f_solver": "fixed_point", "f_max_iter": 12, "f_tol": 1e-12, "f_stop_mode": "abs"})
    model = DEQTransformerForCausalLM.from_pretrained(out).double().eval()
    assert model.config.n_block == c["n_layer"] and model.config.variant == "torchdeq"
    exp = load_file(FIX / f"torchdeq_{case}.expected.safetensors")
    assert (_logprobs(model, exp["input_ids"]) - exp["logprobs"]).abs().max() < 1e-4


def test_parity_is_sensitive(tmp_path):
    """The comparison can fail: a wrong LayerNorm placement (post-LN fixture read as pre-LN) is caught."""
    conv = _converter("deq_transformer_locuslab")
    out = conv.convert(FIX / "locuslab_postln_adaptive_wnorm.pth", tmp_path / "wrong", pre_lnorm=True,
                       tgt_len=6, mem_len=4, deq={"f_solver": "anderson", "f_max_iter": 100, "f_tol": 1e-10})
    model = DEQTransformerForCausalLM.from_pretrained(out).double().eval()
    exp = load_file(FIX / "locuslab_postln_adaptive_wnorm.expected.safetensors")
    assert (_logprobs(model, exp["input_ids"]) - exp["logprobs"]).abs().max() > 1e-2


def test_bad_inputs(tmp_path):
    conv = _converter("deq_transformer_locuslab")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        conv.convert(tmp_path / "nope.pth", tmp_path / "out")
    sd = torch.load(FIX / "locuslab_preln_softmax.pth", weights_only=True)
    del sd["func.pos_ff.ff2_net.bias"]
    torch.save(sd, tmp_path / "broken.pth")
    with pytest.raises(KeyError, match="func.pos_ff.ff2_net.bias"):
        conv.convert(tmp_path / "broken.pth", tmp_path / "out", pre_lnorm=True)
    torch.save({"x": object()}, tmp_path / "pickled.pth")  # arbitrary pickled objects are refused
    with pytest.raises(ValueError, match="weights-only"):
        conv.convert(tmp_path / "pickled.pth", tmp_path / "out")
    tconv = _converter("deq_transformer_torchdeq")
    sd = torch.load(FIX / "torchdeq_one_block_softmax.pth", weights_only=True)
    sd["func.extra.weight"] = torch.zeros(2)
    torch.save(sd, tmp_path / "extra.pth")
    with pytest.raises(ValueError, match="func.extra.weight"):
        tconv.convert(tmp_path / "extra.pth", tmp_path / "out")
