"""Converters reproduce the original implementations' outputs on committed fixtures (produced once by running
SwiftieH/IGNN and TorchDEQ deq-zoo/ignn outside the repo; see conversion/fixtures/ignn/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conversion import converter_module
from deqzoo.models.ignn import IGNNForGraphClassification, IGNNForNodeClassification

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "conversion" / "fixtures" / "ignn"
# the original's deterministic solver: plain fixed-point iteration from zeros, 300 steps
DEQ = {"f_solver": "fixed_point", "f_max_iter": 300, "f_tol": 1e-6, "f_stop_mode": "abs"}


def _converter(name: str):
    return converter_module(name)


@pytest.mark.parametrize(
    "fixture, module, fmt, cls, log_softmax",
    [
        ("swiftieh_node", "ignn_swiftieh", "ignn-swiftieh", IGNNForNodeClassification, False),
        ("swiftieh_graph", "ignn_swiftieh", "ignn-swiftieh", IGNNForGraphClassification, True),
        ("torchdeq_node", "ignn_torchdeq", "ignn-torchdeq", IGNNForNodeClassification, False),
    ],
)
def test_converted_model_reproduces_original_outputs(tmp_path, fixture, module, fmt, cls, log_softmax):
    io = load_file(FIX / f"{fixture}_io.safetensors")
    mod = _converter(module)
    out = mod.FORMATS[fmt](FIX / f"{fixture}_state_dict.pt", tmp_path / "conv", deq=DEQ)
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    model = cls.from_pretrained(out).eval()
    # what the original returns (issue 58): TorchDEQ's fixed_point_iter f of the accepted iterate; SwiftieH's
    # inn_pred the iterate that passed its test (both fixtures are converged: the two points agree to 1e-6)
    assert model.config.deq["f_final_step"] == (1 if module == "ignn_torchdeq" else False)
    with torch.no_grad():
        res = model(io["x"], io["edge_index"], io["edge_weight"], io.get("batch"))
    logits = torch.log_softmax(res.logits, -1) if log_softmax else res.logits
    assert bool(res.deq_stats.converged.all())
    diff = (logits - io["logits"]).abs().max().item()
    print(f"{fixture}: max |logit diff| = {diff:.2e}, nfe {res.deq_stats.nfe}")
    assert diff < 1e-5
    if "adj_rho" in io:  # our λ_pf estimate agrees with the original's scipy eigs (which adds 1e-5)
        assert abs(res.graph.spectral_radius() - io["adj_rho"].item()) < 2e-5


def test_converter_refuses_foreign_layouts(tmp_path):
    sw, td = _converter("ignn_swiftieh"), _converter("ignn_torchdeq")
    sd = torch.load(FIX / "swiftieh_node_state_dict.pt", weights_only=True)
    sd["extra.weight"] = torch.zeros(2)
    torch.save(sd, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match="extra.weight"):
        sw.convert(tmp_path / "extra.pt", tmp_path / "o1")
    torch.save({"ignn.0.W_orig": torch.zeros(2, 2), "proj.0.weight": torch.zeros(2, 2)}, tmp_path / "ppi.pt")
    with pytest.raises(ValueError, match="PPI"):
        td.convert(tmp_path / "ppi.pt", tmp_path / "o2")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        sw.convert(tmp_path / "junk.pt", tmp_path / "o3")
