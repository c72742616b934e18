"""Registry, Auto classes, pipeline, embedded catalog (offline, sha256), model cards and the CLI."""

from __future__ import annotations

import importlib
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import deqzoo
from deqzoo.cli import main as cli_main
from deqzoo.hub import CheckpointError, read_model_card, resolve
from deqzoo.hub import catalog as catalog_mod
from utils import catalog as catalog_tool

toy = importlib.import_module("deqzoo_hub_toy_family")


@pytest.fixture
def embedded(toy_checkpoint, tmp_path, monkeypatch):
    """A catalog (in tmp) listing the toy checkpoint as embedded `deqzoo/toy-deq-tiny`."""
    directory, model = toy_checkpoint
    cat = catalog_tool.build_catalog(directory.parent, root=tmp_path / "elsewhere")  # absolute locations
    path = catalog_tool.write_catalog(cat, tmp_path / "catalog.json")
    monkeypatch.setattr(catalog_mod, "CATALOG_PATH", path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return directory, model, cat


def test_auto_classes_and_pipeline_load_checkpoint(toy_checkpoint):
    directory, model = toy_checkpoint
    config = transformers.AutoConfig.from_pretrained(directory)
    assert isinstance(config, toy.ToyDEQConfig) and config.deq_config.f_max_iter == 40
    auto = transformers.AutoModelForImageClassification.from_pretrained(directory)
    assert type(auto) is toy.ToyDEQForImageClassification
    assert all(torch.equal(v, auto.state_dict()[k]) for k, v in model.state_dict().items())
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    assert isinstance(processor, toy.ToyImageProcessor)

    image = Image.fromarray((np.random.default_rng(0).random((16, 16, 3)) * 255).astype("uint8"))
    pipe = transformers.pipeline("image-classification", model=str(directory))
    result = pipe(image, top_k=3)
    # The pipeline's answer equals running processor + model by hand.
    with torch.no_grad():
        probs = auto(**processor(image, return_tensors="pt")).logits.softmax(-1)[0]
    best = int(probs.argmax())
    assert result[0]["label"] == model.config.id2label[best]
    assert result[0]["score"] == pytest.approx(float(probs[best]), abs=1e-6)


def test_set_deq_and_from_pretrained_deq_change_solver(toy_checkpoint):
    directory, _ = toy_checkpoint
    model = deqzoo.from_pretrained(directory, deq={"f_solver": "fixed_point", "f_max_iter": 3})
    assert model.deq.config.f_solver == "fixed_point" and model.config.deq["f_max_iter"] == 3
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        assert model(x).deq_stats.nfe <= 4
    model.set_deq(f_max_iter=60, f_solver="anderson", f_tol=1e-8)
    with torch.no_grad():
        long = model(x)
    assert long.deq_stats.nfe > 4 and float(long.deq_stats.residual.max()) < 1e-5
    with pytest.raises(ValueError, match="not registered"):
        model.set_deq(f_solver="no-such-solver")


def test_create_model_and_list_models(toy_family):
    model = deqzoo.create_model("toy-deq-tiny", hidden_size=5, deq={"f_max_iter": 7})
    assert isinstance(model, toy.ToyDEQForImageClassification)
    assert model.mix.weight.shape == (5, 5) and model.deq.config.f_max_iter == 7
    rows = {m.name: m for m in deqzoo.list_models()}
    info = rows["toy-deq-tiny"]
    expected = sum(p.numel() for p in deqzoo.create_model("toy-deq-tiny").parameters())
    assert (info.kind, info.task, info.parameters) == ("architecture", "image-classification", expected)
    with pytest.raises(ValueError, match="toy-deq-tiny"):
        deqzoo.create_model("nonexistent-arch")
    # a v4-style config (keys as __init__ arguments, not dataclass fields): a typo is still refused
    with pytest.raises(ValueError, match="ToyDEQConfig: unknown key 'hiden_size'. Did you mean 'hidden_size"):
        deqzoo.create_model("toy-deq-tiny", hiden_size=5)


def test_embedded_checkpoint_loads_offline_and_verifies_sha256(embedded):
    directory, model, cat = embedded
    entry = cat["checkpoints"]["deqzoo/toy-deq-tiny"]
    assert set(entry["files"]) == {"README.md", "config.json", "model.safetensors",
                                   "preprocessor_config.json"}
    assert entry["parameters"] == sum(p.numel() for p in model.parameters())  # buffers are not parameters
    assert entry["task"] == "image-classification" and entry["deqzoo_task"] == toy.TOY_MODULE
    assert resolve("deqzoo/toy-deq-tiny") == directory and resolve("toy-deq-tiny") == directory
    loaded = deqzoo.from_pretrained("deqzoo/toy-deq-tiny")
    assert torch.equal(loaded.head.weight, model.head.weight)
    listed = {m.name: m for m in deqzoo.list_models("checkpoint")}["deqzoo/toy-deq-tiny"]
    assert listed.metrics == entry["metrics"] and "mean_max_prob" in listed.metrics

    cfg = json.loads((directory / "config.json").read_text())
    cfg["hidden_size"] = 16  # same value, different bytes: the sha256 check must still notice
    (directory / "config.json").write_text(json.dumps(cfg, indent=4))
    with pytest.raises(CheckpointError, match=r"config\.json: sha256 .* does not match the catalog"):
        deqzoo.from_pretrained("deqzoo/toy-deq-tiny")


def test_shipped_checkpoint_skips_only_the_meta_precheck(embedded, tmp_path, monkeypatch):
    """A verified embedded checkpoint loaded as shipped skips `precheck` (its meta-device build); every other
    load runs it: overrides, a copy in a user folder, the embedded folder once a file differs from the
    catalog. The budget is checked either way."""
    import shutil

    from deqzoo.hub import loading

    directory, model, _ = embedded
    calls = []
    real_precheck = loading.precheck
    monkeypatch.setattr(loading, "precheck", lambda *a, **k: calls.append(a[2]) or real_precheck(*a, **k))
    for name in ("deqzoo/toy-deq-tiny", directory):
        loaded = deqzoo.from_pretrained(name)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert calls == []
    count = sum(t.numel() for t in model.state_dict().values())
    with pytest.raises(CheckpointError, match=f"allocate {count:,} parameters and buffers .* budget of 10"):
        deqzoo.from_pretrained("deqzoo/toy-deq-tiny", max_parameters=10)
    monkeypatch.setenv("DEQZOO_MAX_PARAMETERS", "10")
    with pytest.raises(CheckpointError, match="budget of 10"):
        deqzoo.from_pretrained("deqzoo/toy-deq-tiny")
    monkeypatch.delenv("DEQZOO_MAX_PARAMETERS")
    assert calls == []

    overridden = deqzoo.from_pretrained("deqzoo/toy-deq-tiny", output_hidden_states=True)
    assert overridden.config.output_hidden_states
    shutil.copytree(directory, tmp_path / "copy")
    deqzoo.from_pretrained(tmp_path / "copy")
    (directory / "README.md").write_text("edited\n")  # not shipped any more: loads by path, prechecked
    deqzoo.from_pretrained(directory)
    assert calls == [directory, tmp_path / "copy", directory]


def test_every_shipped_checkpoint_passes_the_precheck():
    """What lets a shipped checkpoint skip `precheck` at load time: for each one, the model its config builds
    on the meta device matches the weights' headers exactly (no missing, unexpected, mis-shaped or mistyped
    key), under the class its config names, and the budget holds."""
    from deqzoo.factory import _model_class
    from deqzoo.hub.catalog import embedded_folder, load_catalog
    from deqzoo.hub.loading import check_state_dict, header_state, is_shipped, load_config, precheck
    from deqzoo.models.registry import family_for

    checked = []
    for cid, entry in sorted(load_catalog().items()):
        folder = embedded_folder(entry)
        if folder is None or not (folder / "config.json").is_file():  # a diffusers pipeline folder
            continue
        assert is_shipped(folder), cid
        raw = json.loads((folder / "config.json").read_text())
        cls = _model_class(family_for(raw["model_type"]), architectures=raw["architectures"])
        assert cls.__name__ in raw["architectures"], cid
        config, _, _ = load_config(cls.config_class, folder)
        assert precheck(cls, config, folder) is None, cid  # no base-model bridging
        with torch.device("meta"):
            meta = cls(config)
        check_state_dict(meta, header_state(folder)[0], cid, strict=True)
        checked.append(cid)
    assert "deqzoo/mdeq-tiny-mnist" in checked and len(checked) >= 5


def test_model_card_metadata(toy_checkpoint):
    directory, _ = toy_checkpoint
    meta, body = read_model_card(directory)
    for key in ("license", "library_name", "tags", "datasets", "metrics", "pipeline_tag", "model-index",
                "deqzoo_task"):
        assert key in meta, key
    assert meta["library_name"] == "deqzoo" and meta["license"] == "apache-2.0"
    result = meta["model-index"][0]["results"][0]
    assert result["task"]["type"] == "image-classification"
    assert result["metrics"][0]["type"] == "mean_max_prob"
    assert "## Training" in body and "## Evaluation" in body and "deqzoo eval DIR" in body
    from huggingface_hub import ModelCard

    card = ModelCard.load(directory / "README.md")  # the Hub's own parser accepts it
    assert card.data.library_name == "deqzoo"
    assert card.data.eval_results[0].metric_value == result["metrics"][0]["value"]


def test_cli_list_info_eval_predict(embedded, capsys):
    directory, model, cat = embedded
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "toy-deq-tiny" in out and "deqzoo/toy-deq-tiny" in out
    assert "Mean max prob 0." in out and "(random pixels)" in out  # the card's headline with its data set
    assert cli_main(["info", "deqzoo/toy-deq-tiny"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["task"] == "image-classification" and info["deq"]["f_max_iter"] == 40
    assert cli_main(["eval", "deqzoo/toy-deq-tiny", "--no-progress"]) == 0
    card_value = cat["checkpoints"]["deqzoo/toy-deq-tiny"]["metrics"]["mean_max_prob"]
    assert capsys.readouterr().out.strip() == f"mean_max_prob: {card_value:.4f}"
    assert cli_main(["eval", "deqzoo/toy-deq-tiny", str(directory), "--no-progress"]) == 0  # side by side
    assert capsys.readouterr().out.splitlines() == [
        "deqzoo/toy-deq-tiny", f"  mean_max_prob: {card_value:.4f}",
        str(directory), f"  mean_max_prob: {card_value:.4f}"]
    assert cli_main(["eval", "deqzoo/toy-deq-tiny", "deqzoo/nope", "--no-progress"]) == 2
    assert capsys.readouterr().out == ""  # the bad second name fails before the first is evaluated
    assert cli_main(["predict", "deqzoo/toy-deq-tiny", "sample.png"]) == 0
    assert capsys.readouterr().out.startswith("sample.png: class ")
    assert cli_main(["info", "deqzoo/nope"]) == 2


def test_cli_demo_writes_png_per_model(embedded, tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert cli_main(["demo", "--output-dir", str(out_dir), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "toy-deq-tiny" in text and "NFE" in text and "residual" in text
    # a 100-column terminal (the path of index.html is as long as the folder the user named)
    assert max(len(line) for line in text.splitlines() if str(out_dir) not in line) <= 100
    assert f"  {out_dir / 'index.html'}" in text.splitlines()
    rows = json.loads((out_dir / "summary.json").read_text())
    assert rows[0]["model"] == "deqzoo/toy-deq-tiny" and rows[0]["card"] and int(rows[0]["NFE"]) > 0
    assert {r["solver"] for r in rows} >= {"fixed_point", "anderson", "broyden"}  # one row per solver
    pngs = list(out_dir.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out_dir / "index.html").read_text(encoding="utf-8")
    assert re.findall(r'<img src="([^"]+)"', page) == [pngs[0].name]  # every PNG written, linked relatively


def test_cli_demo_comparison_solvers_do_not_warn_about_the_card(tmp_path):
    """The demo also runs the solvers the card does not use, for the plot; on the DEQ-Transformer plain
    fixed-point iteration stops at its 30 steps above the 1e-3 tolerance (asserted through the same solve),
    which the plot shows: it must not surface as a non-convergence warning."""
    from deqzoo.cli import load_checkpoint as _load
    from deqzoo.modeling_utils import DEQNonConvergenceWarning
    from examples.demo import run_demo
    from examples.deq_transformer import pydoc_lm

    name = "deqzoo/deq-transformer-tiny-pydoc"
    model = _load(name)[0]
    model.set_deq(f_solver="fixed_point", on_nonconvergence="ignore")
    _, stats = pydoc_lm.demo(model)
    assert not bool(stats.converged.all())  # the comparison run really misses the tolerance
    with warnings.catch_warnings(record=True) as caught:  # the card's own solver may still warn
        warnings.simplefilter("always")
        rows, failures = run_demo([name], tmp_path, progress=False)
    assert not failures and rows[0]["model"] == name
    ours = [str(w.message) for w in caught if issubclass(w.category, DEQNonConvergenceWarning)]
    assert not any("fixed_point" in m or "broyden" in m for m in ours), ours
    assert (tmp_path / "deq-transformer-tiny-pydoc_residuals.png").is_file()


def test_cli_demo_without_checkpoints_exits_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(catalog_mod, "CATALOG_PATH", tmp_path / "missing.json")
    assert cli_main(["demo", "--output-dir", str(tmp_path / "d")]) == 0
    assert "no embedded checkpoints" in capsys.readouterr().out


def test_cli_convert_discovers_formats(tmp_path, capsys, monkeypatch):
    import conversion as converters

    def convert(src, out, scale=1):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "seen.txt").write_text(f"{src} {scale}")
        return Path(out)

    monkeypatch.setattr(converters, "_REGISTERED", {})
    converters.register_converter("toy-upstream", convert)
    assert cli_main(["convert"]) == 0
    listed = capsys.readouterr().out
    assert "toy-upstream" in listed and "mdeq-locuslab" in listed  # registered and the shipped ones
    out = tmp_path / "out"
    assert cli_main(["convert", "toy-upstream", "SRC", str(out), "--option", "scale=3"]) == 0
    assert (out / "seen.txt").read_text() == "SRC 3"
    capsys.readouterr()
    assert cli_main(["convert", "nope", "a", "b"]) == 2
    assert "toy-upstream" in capsys.readouterr().err


def test_catalog_cli_writes_and_checks(toy_checkpoint, tmp_path):
    directory, _ = toy_checkpoint
    path = tmp_path / ".out" / "catalog.json"  # hidden folders under model_cards/ are skipped
    path.parent.mkdir()
    readme = path.parent / "README.md"
    readme.write_text("# x\n<!-- catalog:start -->\nold\n<!-- catalog:end -->\ntail\n")
    args = ["--cards-dir", str(directory.parent), "--output", str(path), "--readme", str(readme)]
    assert catalog_tool.main([*args, "--check"]) == 1  # nothing written yet
    assert catalog_tool.main(args) == 0
    assert catalog_tool.main([*args, "--check"]) == 0
    table = readme.read_text()
    assert "| [`deqzoo/toy-deq-tiny`]" in table and "old" not in table and table.endswith("tail\n")
    (directory / "README.md").write_text((directory / "README.md").read_text() + "\nedited\n")
    assert catalog_tool.main([*args, "--check"]) == 1


def test_cli_bench_dispatches_with_remaining_args(monkeypatch, capsys):
    import types

    seen = {}
    module = types.ModuleType("benchmarks.hubtoy")
    module.main = lambda argv=None: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(__import__("sys").modules, "benchmarks.hubtoy", module)
    assert cli_main(["bench", "hubtoy", "--quick", "--n", "3"]) == 0
    assert seen["argv"] == ["--quick", "--n", "3"]
    assert cli_main(["bench", "definitely-not-a-bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_cli_info_architecture(toy_family, capsys):
    assert cli_main(["info", "toy-deq-tiny"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_type"] == toy.TOY_FAMILY.model_type and info["task"] == "image-classification"
