"""`import deqzoo` and `deqzoo --help` import only what they need; a family registers with transformers when
deqzoo first needs it (no import hook), so loading one checkpoint imports only its family; `deqzoo.register()`
registers every family for stock transformers / timm code, whatever the import order. Each case runs in a
fresh interpreter: import state is what is under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "timm", "numba", "diffusers", "safetensors", "numpy")


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_import_deqzoo_imports_no_heavy_library():
    code = ("import sys, json, deqzoo; print(json.dumps(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {HEAVY!r})))")
    assert json.loads(_python(code).stdout) == []


def test_cli_help_imports_no_heavy_library_and_is_fast():
    code = ("import sys, json, contextlib, io\nfrom deqzoo.cli import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'bench' in buf.getvalue()\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))")
    assert json.loads(_python(code).stdout) == []
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deqzoo.cli", "--help"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=60)
    # <= 3 s is the bar on an idle machine; the suite may share a loaded one, so allow slack here
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("first", ["deqzoo", "transformers", "timm", "PreTrainedModel", "pipeline"])
def test_stock_transformers_auto_classes_find_the_families(first):
    """After `deqzoo.register()`, whatever was imported before it, the Auto classes find the families and no
    family fails to register (warnings are errors here)."""
    imports = {"deqzoo": "import deqzoo\nimport transformers\n",
               "transformers": "import transformers\nfrom transformers import AutoConfig\nimport deqzoo\n",
               "timm": "import deqzoo\nimport timm\nimport transformers\n",
               "PreTrainedModel": ("import deqzoo\nfrom transformers import PreTrainedModel\n"
                                   "import transformers\n"),
               "pipeline": "import deqzoo\nfrom transformers import pipeline\nimport transformers\n"}[first]
    code = "import warnings\nwarnings.simplefilter('error', UserWarning)\n" + imports + (
        "deqzoo.register()\n"
        "from deqzoo.hub import resolve\n"
        "mnist, lm_dir = resolve('deqzoo/mdeq-tiny-mnist'), resolve('deqzoo/deq-transformer-tiny-pydoc')\n"
        "model = transformers.AutoModelForImageClassification.from_pretrained(mnist)\n"
        "lm = transformers.AutoModelForCausalLM.from_pretrained(lm_dir)\n"
        "tok = transformers.AutoTokenizer.from_pretrained(lm_dir)\n"
        "print(type(model).__name__, type(lm).__name__, type(tok).__name__)\n")
    out = _python(code).stdout.split()
    assert out[:2] == ["MDEQForImageClassification", "DEQTransformerForCausalLM"]


def test_stock_pipeline_and_timm_after_register():
    code = ("import deqzoo\nfrom transformers import pipeline\nimport timm, torch\n"
            "deqzoo.register()\n"
            "from deqzoo.hub import resolve\n"
            "clf = pipeline('image-classification', model=str(resolve('deqzoo/mdeq-tiny-mnist')))\n"
            "net = timm.create_model('mdeq_tiny_mnist', pretrained=True)\n"
            "print(type(clf).__name__, type(net).__name__, tuple(net(torch.zeros(1, 1, 28, 28)).shape))\n")
    assert _python(code).stdout.split()[:2] == ["ImageClassificationPipeline", "MDEQTimm"]


def test_no_import_hook_is_installed():
    code = "import sys, deqzoo\nprint(sum(type(f).__module__.startswith('deqzoo') for f in sys.meta_path))\n"
    assert _python(code).stdout.strip() == "0"


def test_loading_one_checkpoint_imports_only_its_family_and_costs_little_cpu():
    """`deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")` in a fresh process: no other family's modules, none
    of torchvision, timm, diffusers, matplotlib imported by it (transformers' own PreTrainedModel import pulls
    torchvision in when it is installed: that happens before, in the baseline); deqzoo's CPU time beyond
    `import torch, transformers` (and the transformers modules any PreTrainedModel load uses) is bounded.
    `deqzoo bench load-time` (benchmarks/load_time.py) runs the same measurement over many processes."""
    from benchmarks.load_time import FOREIGN, measure_once

    assert "deqzoo.models.deq_transformer" in FOREIGN and "deqzoo.pipelines" in FOREIGN
    result = measure_once(ROOT, "deqzoo/mdeq-tiny-mnist")
    assert result["cls"] == "MDEQForImageClassification"
    assert result["bad"] == [], result["bad"]
    print(f"deqzoo CPU time beyond torch + transformers: {result['cpu']:.3f} s")
    # the target is 0.3 s on an idle machine; the suite shares a loaded one, so allow slack here
    assert result["cpu"] < 1.0, result


def test_lipschitz_callback_is_imported_on_first_use_and_projects():
    """Importing the MDEQ family does not import transformers' Trainer machinery; the Trainer callback is
    one class from the package and from its own module, pickles, and runs `project_lipschitz` on the model
    (the same result as calling it directly on a copy)."""
    code = ("import sys, deqzoo.models.mdeq\n"
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.trainer', "
            "'transformers.training_args'))))\n")
    assert _python(code).stdout.strip() == "[]"

    import copy
    import pickle

    from transformers import TrainerCallback, TrainerControl

    import deqzoo
    from deqzoo.models.mdeq import LipschitzProjectionCallback, conv_operator_norm, project_lipschitz
    from deqzoo.models.mdeq import lipschitz_callback as callback_module

    assert LipschitzProjectionCallback is callback_module.LipschitzProjectionCallback
    assert issubclass(LipschitzProjectionCallback, TrainerCallback)
    assert type(pickle.loads(pickle.dumps(LipschitzProjectionCallback()))) is LipschitzProjectionCallback
    model = deqzoo.create_model("lipschitz-mdeq-tiny-mnist")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # far outside the constraints
    reference = copy.deepcopy(model)
    stats = project_lipschitz(reference)
    assert stats["projected"] > 0
    control = TrainerControl()
    assert LipschitzProjectionCallback().on_step_end(None, None, control, model=model) is control
    projected = reference.state_dict()
    assert all(torch.equal(value, projected[key]) for key, value in model.state_dict().items())
    convs = [m for m in model.modules() if getattr(m, "_deqzoo_lipschitz_conv", False)]
    assert max(conv_operator_norm(c.weight, model.config.spectral_fft_size) for c in convs) <= (
        model.config.conv_norm * (1 + 1e-5))
