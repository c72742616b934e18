"""Converted original MDEQ checkpoints reproduce the original implementations' logits.

Fixtures (conversion/fixtures/mdeq/, described in fixtures.json) were produced once by running the upstream
code (locuslab/deq MDEQ-Vision, locuslab/mdeq, TorchDEQ deq-zoo) outside the repository: an original-format
state dict of a CIFAR TINY model and the original code's logits on a fixed input, for (a) exactly N plain
fixed-point steps from z = 0 and (b) the equilibrium (200 steps, relative residual ~1e-7).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import deqzoo
from conversion import converter_module
from conversion._common import original_returned_point
from deqzoo.core import solve

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "conversion" / "fixtures" / "mdeq"
N_STEPS = 6  # fixed-point steps of the fixtures' `logits_fixed_point`


def _load(name: str):
    return converter_module(name)


L = _load("mdeq_locuslab")
T = _load("mdeq_torchdeq")

# (format, converter module, checkpoint, io file, options the checkpoint needs)
CASES = {
    "mdeq-vision": ("mdeq-locuslab", L, "mdeq_vision_tiny.pkl", "mdeq_vision_tiny_io.safetensors", {}),
    "mdeq-2020-narrow": (
        "mdeq-locuslab",
        L,
        "mdeq2020_tiny_narrow.pkl",
        "mdeq2020_tiny_narrow_io.safetensors",
        {"num_groups": 8, "downsample_times": 0},
    ),
    "torchdeq": ("mdeq-torchdeq", T, "torchdeq_mdeq_tiny.pth.tar", "torchdeq_mdeq_tiny_io.safetensors", {}),
    # Cityscapes SMALL narrowed: 4 streams, stage0, 5x5 kernels, 2 blocks in stream 0, 3x3 final conv
    "mdeq-vision-seg": (
        "mdeq-locuslab",
        L,
        "mdeq_vision_seg_narrow.pkl",
        "mdeq_vision_seg_narrow_io.safetensors",
        {"num_groups": 8, "downsample_times": 2},
    ),
}


def _io(name: str) -> dict[str, torch.Tensor]:
    """A fixture's input and logits as float32 (an input may be stored as float16, exactly)."""
    return {k: v.float() for k, v in load_file(FIX / name).items()}


def _iters_for_steps(n: int) -> int:
    """The engine's fixed_point max_iter that returns f^n(z0) (it may report the last input or output)."""
    z0 = torch.zeros(1, 1, dtype=torch.float64)
    want = 2 * (1 - 0.5**n)  # f(z) = z/2 + 1 from 0
    for k in (n, n + 1):
        z, _ = solve(lambda z: 0.5 * z + 1, z0, solver="fixed_point", max_iter=k, tol=1e-14)
        if abs(z.item() - want) < 1e-12:
            return k
    raise AssertionError("fixed_point returns neither f^n(z0) after n nor n+1 evaluations")


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    fmt, module, ckpt, io, options = CASES[request.param]
    out = module.FORMATS[fmt](FIX / ckpt, tmp_path_factory.mktemp(request.param) / "model", **options)
    return request.param, deqzoo.from_pretrained(out).eval(), _io(io), out


def test_fixed_point_steps_match_original(converted):
    name, model, io, _ = converted
    # f's parity: N plain steps (the iterate; the converter's returned-point setting is tested below)
    model.set_deq(f_solver="fixed_point", f_max_iter=_iters_for_steps(N_STEPS), f_tol=1e-12,
                  f_final_step=False)
    with torch.no_grad():
        logits = model(io["input"]).logits
    diff = (logits - io["logits_fixed_point"]).abs().max().item()
    tol = 1e-5 * max(1.0, io["logits_fixed_point"].abs().max().item())
    assert diff < tol, f"{name}: max |deqzoo - original| = {diff:.3e} after {N_STEPS} fixed-point steps"
    # the fixture discriminates: one step more or less changes the logits far beyond the tolerance
    assert (io["logits_fixed_point"] - io["logits_equilibrium"]).abs().max() > 1e-4


def test_equilibrium_matches_original(converted):
    name, model, io, _ = converted
    model.set_deq(f_solver="anderson", f_max_iter=150, f_tol=1e-6, f_stop_mode="rel")
    with torch.no_grad():
        out = model(io["input"])
    assert bool(out.deq_stats.converged.all()), out.deq_stats
    diff = (out.logits - io["logits_equilibrium"]).abs().max().item()
    assert diff < 1e-4, f"{name}: max |deqzoo - original equilibrium| = {diff:.3e}"


# the fixtures' runs of the originals' own solvers (fixtures.json), and what each returns: locuslab/deq's
# broyden its lowest iterate, TorchDEQ's anderson f of it (conversion._common.RETURNED_POINT)
SOLVER_RUNS = {
    "mdeq-vision": ("logits_solver", {"f_solver": "broyden", "f_max_iter": 18, "f_stop_mode": "rel"}),
    # locuslab/mdeq's broyden at the fixture's F_THRES=22: 22 steps after x0's evaluation, whole-batch
    # eps = 1e-5 sqrt(B D), the lowest whole-batch iterate for every sample (converter: release_2020_solver)
    "mdeq-2020-narrow": ("logits_broyden", {"f_solver": "broyden", "f_max_iter": 23, "f_stop_mode": "abs",
                                            "f_tol": 1e-5, "f_solver_kwargs": {"best": "batch"}}),
    "torchdeq": ("logits_anderson", {"f_solver": "anderson", "f_max_iter": 60, "f_tol": 1e-6,
                                     "f_stop_mode": "rel"}),
}


@pytest.mark.parametrize("name", sorted(SOLVER_RUNS))
def test_returned_point_matches_the_originals_solver(name, tmp_path):
    """Issue 58: the converted model returns what the original's solver returns. locuslab/deq MDEQ-Vision's
    broyden (F_THRES 18) returns its accepted iterate: 8.0e-7 from the fixture, where f of it is 3.8e-5
    away; TorchDEQ's anderson returns f of the iterate (converged to 1e-6 here, so both are within 3.2e-6);
    locuslab/mdeq's broyden (F_THRES 22) its lowest whole-batch iterate after 22 steps: 6.6e-7 (at this
    fixture the per-sample lowest iterate is the same point; 22 evaluations instead of 23 are 6.1e-5 away)."""
    fmt, module, ckpt, io_name, options = CASES[name]
    key, settings = SOLVER_RUNS[name]
    model = deqzoo.from_pretrained(module.FORMATS[fmt](FIX / ckpt, tmp_path / "m", **options)).eval()
    io = _io(io_name)
    final = {"mdeq-vision": False, "mdeq-2020-narrow": False, "torchdeq": 1}[name]
    origin = "torchdeq" if name == "torchdeq" else "locuslab"
    if name == "mdeq-2020-narrow":  # the converter writes the 2020 release's solver (F_THRES + 1 evaluations)
        written = model.config.deq
        assert {k: written[k] for k in settings if k != "f_max_iter"} == {
            k: v for k, v in settings.items() if k != "f_max_iter"}
    assert original_returned_point(origin, settings)["f_final_step"] == final
    tol = 1e-5 * max(1.0, io[key].abs().max().item())
    model.set_deq(**settings, f_final_step=final, on_nonconvergence="ignore")
    with torch.no_grad():
        diff = (model(io["input"]).logits - io[key]).abs().max().item()
    print(f"{name}: max |deqzoo - original solver's logits| = {diff:.2e}")
    assert diff < tol, f"{name}: max |deqzoo - original solver| = {diff:.3e}"
    if name == "mdeq-vision":  # the fixture tells the two points apart
        model.set_deq(f_final_step=1)
        with torch.no_grad():
            assert (model(io["input"]).logits - io[key]).abs().max().item() > tol
    if name == "mdeq-2020-narrow":  # the fixture tells the step count apart: F_THRES evaluations, not + 1
        for best in ("sample", "batch"):  # 1.2e-4 and 6.1e-5 away
            model.set_deq(f_max_iter=22, f_solver_kwargs={"best": best})
            with torch.no_grad():
                assert (model(io["input"]).logits - io[key]).abs().max().item() > tol


def test_converted_directory_is_a_hub_repo(converted):
    name, model, _, out = converted
    names = {"config.json", "model.safetensors", "README.md", "preprocessor_config.json"}
    assert {p.name for p in out.iterdir()} >= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mdeq"
    assert config["id2label"]["0"] == ("road" if name == "mdeq-vision-seg" else "airplane")
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: deqzoo" in card and "sha256" in card


def test_parameter_count_matches_original():
    counts = json.loads((FIX / "original_param_counts.json").read_text())
    want = counts["locuslab/deq MDEQ-Vision"]["configs"]["mdeq-cifar-tiny"]["parameters"]
    model, _ = L.convert_state_dict(
        L.canonical_locuslab(L.load_checkpoint(FIX / "mdeq_vision_tiny.pkl"), "x")
    )
    assert sum(p.numel() for p in model.parameters()) == want


def test_torchdeq_fusion_weight_norm_is_folded_exactly():
    sd = L.load_checkpoint(FIX / "torchdeq_mdeq_tiny.pth.tar")
    model, info = T.convert_state_dict(sd)
    folded = [e for e in info["key_map"] if e.transform == "fold_weight_norm"]
    assert {e.target for e in folded} == {
        "mdeq.fullstage.fuse_layers.0.1.net.conv.weight",
        "mdeq.fullstage.fuse_layers.1.0.net.0.conv.weight",
    }
    g, v = (
        sd["full_stage.fuse_layers.1.0.net.0.conv.weight_g"],
        sd["full_stage.fuse_layers.1.0.net.0.conv.weight_v"],
    )
    w = model.state_dict()["mdeq.fullstage.fuse_layers.1.0.net.0.conv.weight"]
    torch.testing.assert_close(w, v * g / v.flatten(1).norm(dim=1).view(-1, 1, 1, 1), rtol=1e-6, atol=1e-7)


def _release_key_lists():
    data = json.loads(gzip.open(FIX / "original_state_dict_keys.json.gz", "rt", encoding="utf-8").read())
    for source, configs in data.items():
        if source == "description":
            continue
        for preset, entry in configs.items():
            yield pytest.param(
                source, preset, entry, id=f"{source.split(' ')[0]}-{source.split('/')[1][:8]}-{preset}"
            )


@pytest.mark.parametrize("source,preset,entry", list(_release_key_lists()))
def test_key_map_covers_every_release_config(source, preset, entry):
    """Every key of every original release config (recorded upstream) maps onto the deqzoo preset."""
    sd = {
        k: torch.empty(
            s, device="meta", dtype=torch.int64 if k.endswith("num_batches_tracked") else torch.float32
        )
        for k, s in entry["keys"]
    }
    if source.startswith("mdeq-torchdeq"):
        _, info = T.convert_state_dict(sd, {"arch": preset}, entry["yaml"], device="meta")
    else:
        _, info = L.convert_state_dict(
            L.canonical_locuslab(sd, entry["yaml"]), {}, entry["yaml"], device="meta"
        )
        # shapes alone identify the preset (locuslab/mdeq's ImageNet LARGE yaml repeats the XL widths)
        assert info["preset"] == (
            "mdeq-imagenet-xl" if "locuslab/mdeq" in source and preset == "mdeq-imagenet-large" else preset
        )
    assert all(e.transform in ("copy", "fold_weight_norm") for e in info["key_map"])


# ---- the command line ----------------------------------------------------------------------------


def test_cli_convert(tmp_path, capsys):
    from deqzoo.cli import main

    out = tmp_path / "tiny"
    assert (
        main(
            [
                "convert",
                "mdeq-torchdeq",
                str(FIX / "torchdeq_mdeq_tiny.pth.tar"),
                str(out),
                "--option",
                "arch=mdeq-cifar-tiny",
            ]
        )
        == 0
    )
    assert f"wrote {out}" in capsys.readouterr().out
    model = deqzoo.from_pretrained(out).eval()
    io = _io("torchdeq_mdeq_tiny_io.safetensors")
    # f's parity: N plain steps (the iterate; the converter's returned-point setting is tested below)
    model.set_deq(f_solver="fixed_point", f_max_iter=_iters_for_steps(N_STEPS), f_tol=1e-12,
                  f_final_step=False)
    with torch.no_grad():
        assert (model(io["input"]).logits - io["logits_fixed_point"]).abs().max() < 1e-5


# ---- containers and bad input --------------------------------------------------------------------


def _sd(name: str) -> dict[str, torch.Tensor]:
    return torch.load(FIX / name, weights_only=True)


def test_training_checkpoint_with_dataparallel_prefix(tmp_path):
    sd = _sd("mdeq_vision_tiny.pkl")
    path = tmp_path / "checkpoint.pth.tar"
    torch.save(
        {"epoch": 3, "perf": torch.tensor(0.5), "state_dict": {"module." + k: v for k, v in sd.items()}}, path
    )
    a, _ = L.convert_state_dict(L.canonical_locuslab(L.load_checkpoint(path), path))
    b, _ = L.convert_state_dict(sd)
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k], v), k


def _convert_error(tmp_path, sd, fmt="mdeq-locuslab", **options) -> str:
    path = tmp_path / "bad.pkl"
    torch.save(sd, path)
    module = L if fmt == "mdeq-locuslab" else T
    with pytest.raises(L.ConversionError) as err:
        module.FORMATS[fmt](path, tmp_path / "out", **options)
    assert str(path) in str(err.value)
    return str(err.value)


def test_unknown_key_is_named(tmp_path):
    sd = _sd("mdeq_vision_tiny.pkl")
    sd["fullstage.branches.0.blocks.0.extra.weight"] = torch.ones(3)
    assert "fullstage.branches.0.blocks.0.extra.weight" in _convert_error(tmp_path, sd)


def test_missing_key_is_named(tmp_path):
    sd = _sd("mdeq_vision_tiny.pkl")
    del sd["incre_modules.1.0.conv2.weight"]
    assert "incre_modules.1.0.conv2.weight" in _convert_error(tmp_path, sd)


def test_misshaped_key_names_both_shapes(tmp_path):
    sd = _sd("mdeq_vision_tiny.pkl")
    sd["final_layer.1.running_mean"] = torch.zeros(7)
    msg = _convert_error(tmp_path, sd)
    assert "final_layer.1.running_mean" in msg and "(7,)" in msg and "(200,)" in msg


def test_alias_of_2020_release_is_checked(tmp_path):
    sd = _sd("mdeq2020_tiny_narrow.pkl")
    key = "deq.func.branches.0.blocks.0.gn1.weight"
    sd[key] = sd[key].clone() + 1
    assert key in _convert_error(tmp_path, sd, num_groups=8, downsample_times=0)


def test_unmatched_shapes_ask_for_hidden_fields(tmp_path):
    msg = _convert_error(tmp_path, _sd("mdeq2020_tiny_narrow.pkl"))
    assert "num_groups" in msg and "downsample_times" in msg


def test_arch_disagreeing_with_shapes(tmp_path):
    msg = _convert_error(tmp_path, _sd("mdeq_vision_tiny.pkl"), arch="mdeq-cifar-large")
    assert "branch_channels" in msg


def test_spectral_norm_torchdeq_checkpoint_is_refused(tmp_path):
    sd = _sd("torchdeq_mdeq_tiny.pth.tar")
    sd["full_stage.post_fuse_layers.0.conv.weight_orig"] = sd.pop(
        "full_stage.post_fuse_layers.0.conv.weight_v"
    )
    assert "spectral" in _convert_error(tmp_path, sd, fmt="mdeq-torchdeq")


def test_locuslab_file_given_to_torchdeq_format(tmp_path):
    assert "mdeq-locuslab" in _convert_error(tmp_path, _sd("mdeq_vision_tiny.pkl"), fmt="mdeq-torchdeq")


class _NotAllowed:
    """Pickled by reference; a weights-only load must refuse it."""


def test_arbitrary_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pkl"
    torch.save({"fullstage.x": _NotAllowed()}, path)
    with pytest.raises(L.ConversionError, match="weights-only"):
        L.load_checkpoint(path)


def test_non_tensor_entry_is_named(tmp_path):
    path = tmp_path / "odd.pkl"
    torch.save({"classifier.weight": [1.0, 2.0]}, path)
    with pytest.raises(L.ConversionError, match="classifier.weight"):
        L.load_checkpoint(path)


_TINY_YAML = """
MODEL:
  NUM_CLASSES: 10
  NUM_GROUPS: 8
  DROPOUT: 0.25
  WNORM: true
  DOWNSAMPLE_TIMES: 0
  EXPANSION_FACTOR: 5
  POST_GN_AFFINE: false
  IMAGE_SIZE: [32, 32]
  EXTRA:
    FULL_STAGE:
      NUM_BRANCHES: 2
      BIG_KERNELS: [0, 0]
      HEAD_CHANNELS: [8, 16]
      FINAL_CHANSIZE: 200
      NUM_BLOCKS: [1, 1]
      NUM_CHANNELS: [24, 24]
DEQ:
  F_SOLVER: 'anderson'
  STOP_MODE: 'rel'
  F_THRES: 12
  B_THRES: 14
"""


def test_config_from_original_yaml(tmp_path):
    """The original experiment yaml sets the hidden fields and the solver; the weights still match."""
    cfg = tmp_path / "cls_mdeq_TINY.yaml"
    cfg.write_text(_TINY_YAML)
    out = L.convert(FIX / "mdeq_vision_tiny.pkl", tmp_path / "out", yaml=str(cfg))
    model = deqzoo.from_pretrained(out).eval()
    deq = model.config.deq_config
    assert (deq.f_solver, deq.f_max_iter, deq.f_stop_mode, deq.b_max_iter) == ("anderson", 12, "rel", 14)
    assert (model.config.num_groups, model.config.dropout, model.config.post_gn_affine) == (8, 0.25, False)
    io = _io("mdeq_vision_tiny_io.safetensors")
    # f's parity: N plain steps (the iterate; the converter's returned-point setting is tested below)
    model.set_deq(f_solver="fixed_point", f_max_iter=_iters_for_steps(N_STEPS), f_tol=1e-12,
                  f_final_step=False)
    with torch.no_grad():
        assert (model(io["input"]).logits - io["logits_fixed_point"]).abs().max() < 1e-5
    bad = tmp_path / "bad.yaml"
    bad.write_text(_TINY_YAML.replace("NUM_CHANNELS: [24, 24]", "NUM_CHANNELS: [32, 32]"))
    with pytest.raises(L.ConversionError, match="branch_channels"):
        L.convert(FIX / "mdeq_vision_tiny.pkl", tmp_path / "out2", yaml=str(bad))
