"""Loading a diffusers repository through deqzoo: model_index.json never chooses code to import."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

import deqzoo  # noqa: E402
from deqzoo.hub.loading import CheckpointError  # noqa: E402

REPO = Path(__file__).resolve().parents[2] / "model_cards" / "ddim-digits-16"


def _copy(tmp_path: Path, index_changes: dict) -> Path:
    target = tmp_path / "repo"
    shutil.copytree(REPO, target)
    index = json.loads((target / "model_index.json").read_text())
    index.update(index_changes)
    (target / "model_index.json").write_text(json.dumps(index))
    return target


def test_embedded_repository_loads_as_deq_ddim_pipeline():
    from deqzoo.pipelines.deq_ddim import DEQDDIMPipeline

    pipe = deqzoo.from_pretrained(REPO)
    assert isinstance(pipe, DEQDDIMPipeline)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"


@pytest.mark.parametrize("changes, fault", [
    ({"unet": ["this", "UNet2DModel"]}, "'unet'"),                       # another library: `import this`
    ({"scheduler": ["diffusers", "StableDiffusionPipeline"]}, "'scheduler'"),
    ({"safety_checker": ["transformers", "AutoModel"]}, "'safety_checker'"),
    ({"unet": "UNet2DModel"}, "'unet'"),
])
def test_model_index_cannot_choose_code(tmp_path, changes, fault):
    target = _copy(tmp_path, changes)
    sys.modules.pop("this", None)
    with pytest.raises(CheckpointError, match=fault):
        deqzoo.from_pretrained(target)
    assert "this" not in sys.modules


def test_ddpm_scheduler_is_refused_by_name(tmp_path):
    target = _copy(tmp_path, {"scheduler": ["diffusers", "DDPMScheduler"]})
    with pytest.raises(ValueError, match="DDPMScheduler"):
        deqzoo.from_pretrained(target)
