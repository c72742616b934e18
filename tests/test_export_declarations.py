"""deqzoo.export reads what it serves from each family's ONE declaration (deqzoo.models.registry): the heads
and their wrapper kinds, refusals, the family's own preparation and the ONNX refusal. Fast checks, in the
default run: every declaration resolves to real classes and known kinds; a declaration replaced at run time
changes what export does (so no table in export.py decides it); importing deqzoo.export imports no family's
code."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deqzoo.export import _WRAPPERS, ExportError, FixedIterationDEQ, export_onnx, exportable
from deqzoo.models.mdeq import ARCHITECTURES, MDEQConfig, MDEQForImageClassification
from deqzoo.models.registry import available_families, declare_family, declared_family, forget_family

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type", sorted(available_families()))
def test_every_export_declaration_names_real_classes_and_known_kinds(model_type):
    family = available_families()[model_type]
    if isinstance(family.export, str):
        assert family.export, model_type  # the reason ExportError gives
        return
    classes = {path.rpartition(":")[2]: family.load(path) for path in [*family.models.values(),
                                                                       *family.heads.values()]}
    for head, kind in family.export.items():
        assert head in classes, (model_type, head, sorted(classes))
        assert kind in _WRAPPERS, (model_type, head, kind)
    for head, why in family.export_refused.items():
        assert head in classes and why, (model_type, head)
    if family.export_prepare:
        assert callable(family.load(family.export_prepare))


@pytest.fixture
def mdeq_declared_as():
    """Replace the mdeq declaration at run time (declare_family), restore it after."""
    original = declared_family("mdeq")

    def declare(**export) -> None:
        declare_family(dataclasses.replace(original, **export))

    yield declare
    forget_family("mdeq")
    assert declared_family("mdeq") is original


@pytest.fixture(scope="module")
def mdeq():
    torch.manual_seed(0)
    return MDEQForImageClassification(MDEQConfig(**ARCHITECTURES["mdeq-tiny-mnist"]["config"])).eval()


def test_the_declaration_decides_what_export_serves(mdeq, mdeq_declared_as, tmp_path):
    pixels = torch.rand(2, 1, 28, 28)
    module = exportable(mdeq, max_iter=3)  # as declared in registry.py
    assert module(pixels).shape == (2, 10)

    mdeq_declared_as(export="a reason declared at run time")
    with pytest.raises(ExportError, match=r"MDEQForImageClassification \(model_type 'mdeq'\) cannot be "
                                          r"exported: a reason declared at run time \(export is implemented "
                                          r"for \['deq_transformer', 'ignn', 'implicit2'\]\)"):
        exportable(mdeq)

    mdeq_declared_as(export={"MDEQForSemanticSegmentation": "image classifier"},
                     export_refused={"MDEQForImageClassification": "a refusal declared at run time"})
    with pytest.raises(ExportError, match="a refusal declared at run time; export supports "
                                          r"MDEQForSemanticSegmentation \(image classifier\)"):
        exportable(mdeq)

    mdeq_declared_as(export={"MDEQForImageClassification": "no such kind"})
    with pytest.raises(ExportError, match="wrapper kind 'no such kind' is not one of"):
        exportable(mdeq)

    mdeq_declared_as(onnx_refused="an ONNX refusal declared at run time")
    path = tmp_path / "mdeq.onnx"
    with pytest.raises(ExportError, match="ONNX export of MDEQForImageClassification is refused: an ONNX "
                                          "refusal declared at run time"):
        export_onnx(exportable(mdeq, max_iter=3), (pixels,), path)
    assert not path.exists()


seen: list = []


def _record_preparation(model, graph):
    seen.append((model, graph))
    if graph == "bad":
        raise ValueError("the preparation refuses this graph")


def test_the_declared_preparation_runs_on_the_fixed_iteration_copy(mdeq, mdeq_declared_as):
    mdeq_declared_as(export_prepare=f"{__name__}:_record_preparation")
    seen.clear()
    module = exportable(mdeq, max_iter=3, graph="a graph")
    (copy_, graph), = seen
    assert copy_ is module.model and copy_ is not mdeq and graph == "a graph"
    assert any(isinstance(m, FixedIterationDEQ) for m in copy_.modules())
    assert not any(isinstance(m, FixedIterationDEQ) for m in mdeq.modules())  # the model is untouched
    with pytest.raises(ExportError, match="MDEQForImageClassification: the preparation refuses this graph"):
        exportable(mdeq, graph="bad")


def test_importing_export_imports_no_family_code():
    code = ("import sys, json, deqzoo.export\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('deqzoo.models.') "
            "and m != 'deqzoo.models.registry')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


def test_ignn_preparation_projects_the_copy_once_for_the_graph():
    """IGNN's own preparation (deqzoo.models.ignn.modeling_ignn.prepare_export, named by its declaration):
    W of the exported copy is projected onto ||W||∞ <= κ/λ_pf for the graph given, the model keeps its
    weights and config, and the exported module equals the model's own fixed_point solve at the same budget
    (which projects per forward)."""
    from deqzoo.export import graph_operator
    from deqzoo.models.ignn import IGNNConfig, IGNNForNodeClassification

    torch.manual_seed(0)
    model = IGNNForNodeClassification(IGNNConfig(in_features=3, hidden_size=8, num_labels=2, kappa=0.9,
                                                 deq={"f_solver": "fixed_point", "f_max_iter": 40,
                                                      "f_tol": 1e-12})).eval()
    model.set_deq(on_nonconvergence="ignore")  # 40 fixed steps, as the exported program takes
    with torch.no_grad():
        model.ignn.layers[0].W.weight.mul_(10.0)  # far outside the ball: the projection changes W
    w = model.ignn.layers[0].W.weight.detach().clone()
    n = 6
    x, edges = torch.randn(n, 3), torch.stack([torch.arange(n - 1), torch.arange(1, n)])
    module = exportable(model, graph=model.ignn.prepare_graph(x, edges))
    w_export = module.model.ignn.layers[0].W.weight.detach()
    assert float(w.abs().sum(1).max()) > 2.0  # the model's W is unchanged, outside the ball
    assert torch.equal(model.ignn.layers[0].W.weight, w) and model.config.kappa == 0.9
    assert float(w_export.abs().sum(1).max()) <= 0.9 * (1 + 1e-5)  # λ_pf = 1 for nonnegative weights
    assert module.model.config.kappa is None  # no per-forward projection in the program
    with torch.no_grad():
        torch.testing.assert_close(module(x, graph_operator(model, x, edges)), model(x, edges).logits,
                                   atol=1e-5, rtol=1e-5)
