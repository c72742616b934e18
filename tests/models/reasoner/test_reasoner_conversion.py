"""HRM and TRM converters reproduce the original implementations' outputs on committed fixtures (made once by
running sapientinc/HRM and SamsungSAILMontreal/TinyRecursiveModels outside the repository at random
initialisation; conversion/fixtures/reasoner_hrm/README.md), in float32 and float64, segment by segment; and
hostile or broken release folders are refused naming the file and key, without running anything."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conversion import conversion_formats
from deqzoo.cli import main as cli_main
from deqzoo.models.reasoner import ReasonerForGridClassification

torch.set_num_threads(1)
FIX = Path(__file__).resolve().parents[3] / "conversion" / "fixtures"
# (format, fixture, options): seq_len is dataset metadata, absent from RoPE checkpoints' weights
CASES = [("hrm-sapientinc", "reasoner_hrm/hrm_rope", {"seq_len": 16}),
         ("hrm-sapientinc", "reasoner_hrm/hrm_learned", {}),
         ("trm-samsung", "reasoner_trm/trm_att", {"seq_len": 16}),
         ("trm-samsung", "reasoner_trm/trm_mlp", {})]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _convert(fmt: str, fixture: str, out: Path, **options) -> Path:
    return conversion_formats()[fmt](FIX / fixture, out, **options)


def _release(tmp_path: Path, fixture: str) -> Path:
    """A writable copy of a fixture release folder."""
    folder = tmp_path / "release"
    shutil.copytree(FIX / fixture, folder)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {fixture: _convert(fmt, fixture, root / fixture.replace("/", "_"), **opts)
            for fmt, fixture, opts in CASES}


NAMES = ("logits", "q_halt_logits", "q_continue_logits")
# make_fixtures.py's outputs of the upstream code run on THIS machine on the committed weights (README.md,
# "Same machine"); the upstream code cannot be part of the repository, so this check is opt-in
UPSTREAM_HERE = os.environ.get("DEQZOO_UPSTREAM_OUTPUTS")


def _segment_by_segment(model, inputs: torch.Tensor, segments: int) -> dict[str, torch.Tensor]:
    """Logits, Q halt and Q continue logits (batch, segments, ...) run one segment at a time from the carry,
    so that every segment is compared."""
    dtype = next(model.parameters()).dtype
    carry, mine = None, {k: [] for k in NAMES}
    with torch.no_grad():
        for _ in range(segments):
            out = model(inputs, carry=carry, num_segments=1)
            carry = out.carry
            q = model.q_head(carry[0][:, 0])  # (halt, continue) from the answer state's first position
            for k, v in zip(NAMES, (out.logits, out.q_halt_logits, q[:, 1])):
                assert v.dtype == dtype
                mine[k].append(v)
    return {k: torch.stack(v, 1) for k, v in mine.items()}


def _worst(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("fixture", [c[1] for c in CASES])
def test_converted_model_reproduces_the_original_segment_by_segment(converted, fixture, dtype):
    """float64: the original's float64 outputs within 1e-10. float32: the float32 rounding, amplified by the
    recursion, depends on the CPU's kernels (the fixtures' machine gave 0.0 against the original's float32,
    another AVX-512 Xeon 4.7e-5 on trm_att, whose original float32 run is itself 1.4e-5 from its float64
    run), so float32 is held to the original's own accuracy: within 1e-5 of the original's float32 outputs,
    or at most 5x the original float32 run's error against the exact (float64) outputs."""
    tag = "f32" if dtype == torch.float32 else "f64"
    exp = load_file(FIX / fixture / "expected.safetensors")
    segments = exp["logits_f64"].shape[1]
    # the check has resolution: each segment changes the original's logits far beyond the tolerance
    assert segments >= 2 and (exp["logits_f64"][:, 1:] - exp["logits_f64"][:, :-1]).abs().amax() > 1e-2
    model = ReasonerForGridClassification.from_pretrained(converted[fixture]).to(dtype).eval()
    assert model.config.halt_max_steps == segments
    mine = _segment_by_segment(model, exp["inputs"], segments)
    ref = {k: exp[f"{k}_{tag}"] for k in NAMES}
    assert all(mine[k].shape == ref[k].shape for k in NAMES)
    diff = _worst(mine, ref)
    print(f"{fixture} {tag}: max |diff| over {segments} segments (logits, Q halt, Q continue) = {diff:.3e}")
    if dtype == torch.float64:
        assert diff < TOL[dtype]
    else:
        exact = {k: exp[f"{k}_f64"] for k in NAMES}
        own, ours = _worst(ref, exact), _worst(mine, exact)
        print(f"  float32 error against float64: original {own:.2e}, deqzoo {ours:.2e}")
        assert diff < TOL[dtype] or ours <= 5 * own, (diff, ours, own)
    # the full budget in one call ends where the segment-by-segment run ended (same kernels: to rounding)
    with torch.no_grad():
        full = model(exp["inputs"])
    torch.testing.assert_close(full.logits, mine["logits"][:, -1], rtol=0, atol=100 * torch.finfo(dtype).eps)
    assert full.steps.tolist() == [segments] * exp["inputs"].shape[0]


@pytest.mark.skipif(not UPSTREAM_HERE, reason="opt-in: DEQZOO_UPSTREAM_OUTPUTS, the upstream code's outputs "
                    "made on this machine (conversion/fixtures/reasoner_hrm/README.md, 'Same machine')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("fixture", [c[1] for c in CASES])
def test_converted_model_equals_the_upstream_code_run_on_the_same_machine(converted, fixture, dtype):
    """Issue #56 item 7's bounds as written (1e-5 in float32, 1e-10 in float64) against the upstream code run
    on this machine on the committed weights: across machines the upstream's own float32 outputs move by
    more than 1e-5 (the test above), on one machine deqzoo and the upstream code compute the same numbers."""
    tag = "f32" if dtype == torch.float32 else "f64"
    exp = load_file(FIX / fixture / "expected.safetensors")
    here = load_file(Path(UPSTREAM_HERE) / fixture.split("/")[1] / "expected.safetensors")
    torch.testing.assert_close(here["inputs"], exp["inputs"], rtol=0, atol=0)
    # the same weights: the upstream's float64 run agrees with the committed one to float64 rounding
    assert _worst({k: here[f"{k}_f64"] for k in NAMES}, {k: exp[f"{k}_f64"] for k in NAMES}) < 1e-10
    model = ReasonerForGridClassification.from_pretrained(converted[fixture]).to(dtype).eval()
    mine = _segment_by_segment(model, exp["inputs"], exp["logits_f64"].shape[1])
    diff = _worst(mine, {k: here[f"{k}_{tag}"] for k in NAMES})
    print(f"{fixture} {tag}: deqzoo vs the upstream code on this machine, max |diff| = {diff:.3e}")
    assert diff < TOL[dtype]


@pytest.mark.parametrize("fmt, fixture, opts", CASES)
def test_converted_config_carries_the_original_halting_and_step_settings(converted, fmt, fixture, opts):
    arch = yaml.safe_load((FIX / fixture / "all_config.yaml").read_text())["arch"]
    cfg = ReasonerForGridClassification.from_pretrained(converted[fixture]).config
    assert (cfg.h_cycles, cfg.l_cycles, cfg.halt_max_steps) == (arch["H_cycles"], arch["L_cycles"],
                                                                arch["halt_max_steps"])
    assert cfg.halt_exploration_prob == arch["halt_exploration_prob"]
    assert cfg.num_layers == arch["L_layers"] and cfg.hidden_size == arch["hidden_size"]
    assert cfg.rms_norm_eps == arch.get("rms_norm_eps", 1e-5) and cfg.halting == "budget"
    if fmt == "hrm-sapientinc":
        assert cfg.architecture == "hrm" and cfg.h_layers == arch["H_layers"] and cfg.grad_mode == "one_step"
    else:
        assert cfg.architecture == "trm" and cfg.grad_mode == "last_cycle"
        assert cfg.mixer == ("mlp" if arch["mlp_t"] else "attention")
    card = (converted[fixture] / "README.md").read_text()
    assert "library_name: deqzoo" in card and f"H_cycles={arch['H_cycles']}" in card


def test_cli_converts_with_options_and_keeps_the_source(tmp_path, capsys):
    src = _release(tmp_path, "reasoner_trm/trm_att")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "out"
    assert cli_main(["convert", "trm-samsung", str(src), str(out), "--option", "seq_len=16",
                     "--option", "halting=act"]) == 0
    assert "wrote" in capsys.readouterr().out
    cfg = ReasonerForGridClassification.from_pretrained(out).config
    assert cfg.halting == "act" and cfg.seq_len == 16 and cfg.num_prefix_tokens == 3
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert "hrm-sapientinc" in conversion_formats() and "trm-samsung" in conversion_formats()


# ---------------------------------------------------------------------------------------- hostile files
class _Payload:
    """Unpickling this runs `touch marker` (os.system): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.mark.parametrize("writer", ["torch.save", "raw pickle"])
def test_pickle_payload_is_refused_without_running(tmp_path, writer):
    src = _release(tmp_path, "reasoner_hrm/hrm_learned")
    marker = tmp_path / "pwned"
    sd = torch.load(src / "step_12", weights_only=True)
    sd["model.inner.lm_head.weight"] = _Payload(marker)
    if writer == "torch.save":
        torch.save(sd, src / "step_12")
    else:  # protocol 2, the one torch.load's unpickler reads: the payload's global is reached
        payload = {"model.inner.lm_head.weight": _Payload(marker)}
        (src / "step_12").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ValueError, match=r"step_12.*weights-only") as err:
        _convert("hrm-sapientinc", str(src), tmp_path / "out")
    assert "system" in str(err.value)  # refused at the global it names, before any call
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the payload is genuinely malicious: an unrestricted load (which the converter never does) runs it
    if writer == "torch.save":
        torch.load(src / "step_12", weights_only=False)
    else:
        pickle.loads((src / "step_12").read_bytes())
    assert marker.exists()


def test_yaml_payload_is_refused_without_running(tmp_path):
    src = _release(tmp_path, "reasoner_hrm/hrm_learned")
    marker = tmp_path / "pwned"
    text = (src / "all_config.yaml").read_text()
    (src / "all_config.yaml").write_text(text + f"hook: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="all_config.yaml: not a plain YAML"):
        _convert("hrm-sapientinc", src, tmp_path / "out")
    assert not marker.exists()


def _edit(src: Path, edit) -> None:
    sd = torch.load(src / "step_12", weights_only=True)
    edit(sd)
    torch.save(sd, src / "step_12")


@pytest.mark.parametrize("edit, pattern", [
    (lambda sd: sd.__setitem__("model.inner.extra.weight", torch.zeros(2)),
     r"step_12: unexpected key 'inner.extra.weight'"),
    (lambda sd: sd.__setitem__("optimizer.state", torch.zeros(2)),
     r"step_12: unexpected key 'optimizer.state'"),
    (lambda sd: sd.pop("model.inner.q_head.bias"), r"step_12: .*missing \['q_head.bias'\]"),
    (lambda sd: sd.pop("model.inner.puzzle_emb.weights"), r"step_12: missing key 'inner.puzzle_emb.weights'"),
    (lambda sd: sd.__setitem__("model.inner.L_level.layers.0.mlp.gate_up_proj.weight", torch.zeros(510, 8)),
     r"step_12: .*reasoner.l_net.layers.0.mlp.gate_up.weight: checkpoint \(510, 8\) vs model \(512, 8\)"),
    (lambda sd: sd.__setitem__("model.inner.embed_tokens.embedding_weight", torch.zeros(7, 6)),
     r"step_12: key 'inner.embed_tokens.embedding_weight' has shape \(7, 6\); all_config's hidden_size is 8"),
    (lambda sd: sd.__setitem__("model.inner.puzzle_emb.weights", torch.zeros(4, 12)),
     r"step_12: key 'inner.puzzle_emb.weights' holds 4 puzzle-identifier embeddings"),
])
def test_wrong_keys_and_shapes_are_refused_naming_file_and_key(tmp_path, edit, pattern):
    src = _release(tmp_path, "reasoner_hrm/hrm_learned")
    _edit(src, edit)
    with pytest.raises(ValueError, match=pattern):
        _convert("hrm-sapientinc", src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_puzzle_identifier_picks_one_row_of_a_multi_puzzle_table(tmp_path):
    src = _release(tmp_path, "reasoner_hrm/hrm_learned")
    table = torch.randn(4, 12)
    _edit(src, lambda sd: sd.__setitem__("model.inner.puzzle_emb.weights", table))
    out = _convert("hrm-sapientinc", src, tmp_path / "out", puzzle_identifier=2)
    prefix = ReasonerForGridClassification.from_pretrained(out).reasoner.prefix.detach()
    assert torch.equal(prefix.flatten()[:12], table[2]) and not prefix.flatten()[12:].any()  # zero padding
    with pytest.raises(ValueError, match=r"puzzle_identifier=4 must be an integer in \[0, 4\)"):
        _convert("hrm-sapientinc", src, tmp_path / "out2", puzzle_identifier=4)


def _edit_yaml(src: Path, **arch) -> None:
    data = yaml.safe_load((src / "all_config.yaml").read_text())
    data["arch"].update(arch)
    (src / "all_config.yaml").write_text(yaml.dump(data))


def test_unsupported_or_inconsistent_settings_are_refused_naming_the_key(tmp_path):
    src = _release(tmp_path, "reasoner_trm/trm_att")
    with pytest.raises(ValueError, match="pass --option seq_len=N"):
        _convert("trm-samsung", src, tmp_path / "o1")
    with pytest.raises(ValueError, match=r"key 'arch.name' is 'recursive_reasoning.trm@"):
        _convert("hrm-sapientinc", src, tmp_path / "o2", seq_len=16)  # a TRM folder given as HRM
    with pytest.raises(ValueError, match="option h_cycles=5 cannot be set: the checkpoint fixes it"):
        _convert("trm-samsung", src, tmp_path / "o3", seq_len=16, h_cycles=5)
    _edit_yaml(src, puzzle_emb_ndim=0)
    with pytest.raises(ValueError, match=r"all_config.yaml: key 'arch.puzzle_emb_ndim' is 0"):
        _convert("trm-samsung", src, tmp_path / "o4", seq_len=16)
    _edit_yaml(src, puzzle_emb_ndim=8, H_cycles="3")
    with pytest.raises(ValueError, match=r"key 'arch.H_cycles' must be int, got '3'"):
        _convert("trm-samsung", src, tmp_path / "o5", seq_len=16)
    learned = _release(tmp_path / "b", "reasoner_hrm/hrm_learned")
    with pytest.raises(ValueError, match="option seq_len=16 disagrees with .*step_12: its weights hold 11"):
        _convert("hrm-sapientinc", learned, tmp_path / "o6", seq_len=16)
    (learned / "all_config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="all_config.yaml does not exist"):
        _convert("hrm-sapientinc", learned, tmp_path / "o7")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))
