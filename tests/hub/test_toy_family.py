"""A family costs its two files and one declaration: a toy family package holding exactly
`configuration_toyfam.py`, `modeling_toyfam.py` and an `__init__.py` with its one `Family` declaration, placed
among deqzoo's families (on `deqzoo.models.__path__`, as a folder `deqzoo/models/toyfam/` would be) with
nothing else edited, goes through list_models, create_model (by its one name: published model = preset),
the name table, save_pretrained, deqzoo.from_pretrained, transformers' Auto classes after deqzoo.register()
and the app's checkpoint list, in a fresh interpreter (registration state is what is under test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFIGURATION = '''
from deqzoo.modeling_utils import DEQPretrainedConfig

ARCHITECTURES = {"toyfam-tiny-demo": {"task": "feature-extraction", "auto": "AutoModel",
                                      "config": {"hidden_size": 6}, "description": "toy"}}


class ToyFamConfig(DEQPretrainedConfig):
    model_type = "toyfam"

    def __init__(self, hidden_size: int = 4, **kwargs):
        self.hidden_size = hidden_size
        super().__init__(**kwargs)
'''

MODELING = '''
import torch
from torch import nn

from deqzoo.core import DEQ
from deqzoo.modeling_utils import DEQPreTrainedModel

from .configuration_toyfam import ToyFamConfig


class ToyFamModel(DEQPreTrainedModel):
    config_class = ToyFamConfig
    base_model_prefix = "toyfam"

    def __init__(self, config):
        super().__init__(config)
        self.inject = nn.Linear(3, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.deq = DEQ(config.deq_config)
        self.post_init()

    def forward(self, x):
        u = self.inject(x)
        w = 0.5 * self.mix.weight / torch.linalg.matrix_norm(self.mix.weight, 2)
        z, _ = self.deq(lambda z: torch.tanh(z @ w.T + u), torch.zeros_like(u))
        return z
'''

DECLARATION = '''
from ..registry import Family

FAMILY = Family(model_type="toyfam", config=f"{__name__}.configuration_toyfam:ToyFamConfig",
                models={"AutoModel": f"{__name__}.modeling_toyfam:ToyFamModel"},
                architectures=f"{__name__}.configuration_toyfam:ARCHITECTURES",
                names=("toyfam-tiny-demo",), app=("toyfam-tiny-demo",))
'''

SCRIPT = '''
import json, sys, torch, transformers
import deqzoo.models
deqzoo.models.__path__.append(sys.argv[2])  # the folder holding toyfam/, as deqzoo/models/ holds ours
import deqzoo
from deqzoo.factory import canonical_name, model_names
from deqzoo.models.registry import app_checkpoints
out = {}
rows = {m.name: m for m in deqzoo.list_models("architecture")}
out["listed"] = [rows["toyfam-tiny-demo"].model_type, rows["toyfam-tiny-demo"].parameters]
torch.manual_seed(0)
model = deqzoo.create_model("toyfam-tiny-demo").eval()          # the published name is its preset's
out["created"] = [type(model).__name__, model.config.hidden_size, canonical_name("toyfam_tiny_demo")]
out["names"] = [r for r in model_names() if r["name"] == "toyfam-tiny-demo"]
out["app"] = app_checkpoints().get("toyfam")
model.save_pretrained(sys.argv[1])
x = torch.randn(2, 3)
loaded = deqzoo.from_pretrained(sys.argv[1]).eval()
out["registered"] = "toyfam" in deqzoo.register()
auto = transformers.AutoModel.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    out["equal"] = [bool(torch.equal(model(x), loaded(x))), bool(torch.equal(model(x), auto(x)))]
out["auto"] = [type(transformers.AutoConfig.from_pretrained(sys.argv[1])).__name__, type(auto).__name__]
print(json.dumps(out))
'''


def test_a_family_is_two_files_and_one_declaration(tmp_path):
    package = tmp_path / "models" / "toyfam"
    package.mkdir(parents=True)
    (package / "configuration_toyfam.py").write_text(CONFIGURATION)
    (package / "modeling_toyfam.py").write_text(MODELING)
    (package / "__init__.py").write_text(DECLARATION)
    # the places a family touches: its two files and its package's one declaration, nothing in deqzoo
    assert sorted(p.name for p in package.iterdir()) == ["__init__.py", "configuration_toyfam.py",
                                                         "modeling_toyfam.py"]
    assert DECLARATION.count("Family(") == 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "saved"), str(tmp_path / "models")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["listed"] == ["toyfam", 3 * 6 + 6 + 6 * 6]  # inject (weight + bias) + mix, on the meta device
    assert out["created"] == ["ToyFamModel", 6, "toyfam-tiny-demo"]
    assert out["names"] == [{"name": "toyfam-tiny-demo", "hub_id": "deqzoo/toyfam-tiny-demo",
                             "preset": "toyfam-tiny-demo", "timm": None}]
    assert out["app"] == ["deqzoo/toyfam-tiny-demo"] and out["registered"]
    assert out["equal"] == [True, True]
    assert out["auto"] == ["ToyFamConfig", "ToyFamModel"]
