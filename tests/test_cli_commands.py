"""`deqzoo eval`, `demo`, `convert` find the clone from the package's own location (never the working
directory) and say so from an install without one; `eval` evaluates a name given twice once; `predict`
takes a flow checkpoint's two images as two arguments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import deqzoo
from deqzoo.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def test_the_clone_is_found_from_the_package_not_the_working_directory(monkeypatch, tmp_path, capsys):
    from deqzoo.cli import _clone_root

    assert _clone_root() == ROOT
    # an installed package (no examples/ beside it), run from inside a clone: the clone is not searched for
    installed = tmp_path / "site-packages" / "deqzoo"
    installed.mkdir(parents=True)
    monkeypatch.setattr(deqzoo, "__file__", str(installed / "__init__.py"))
    monkeypatch.chdir(ROOT)
    assert _clone_root() is None
    for argv in (["demo"], ["eval", "deqzoo/mdeq-tiny-mnist"], ["convert", "list"],
                 ["train-hypersolver", "--help"]):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "not in the wheel" in err and "git clone" in err and "Traceback" not in err, (argv, err)


def test_eval_evaluates_a_name_given_twice_once(capsys, monkeypatch):
    from examples.ignn import chains

    calls = []
    evaluate = chains.evaluate
    monkeypatch.setattr(chains, "evaluate", lambda model, **kw: calls.append(1) or evaluate(model, **kw))
    assert cli_main(["eval", "deqzoo/ignn-chains", "deqzoo/ignn-chains", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(calls) == 1 and out[0].startswith("accuracy: ") and len(out) == 2, out  # no name header


def test_predict_takes_two_image_paths_for_a_flow_checkpoint(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torchvision")
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    frame = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(frame).save("a.png")
    Image.fromarray(np.roll(frame, 3, axis=1)).save("b.png")
    assert cli_main(["predict", "deqzoo/deq-flow-cpu-synth", "a.png", "b.png"]) == 0
    assert "written to flow_a_b.png" in capsys.readouterr().out and Path("flow_a_b.png").is_file()
    assert cli_main(["predict", "deqzoo/deq-flow-cpu-synth", "a.png", "b.png", "mine.png"]) == 0
    capsys.readouterr()
    assert Path("mine.png").is_file()
    assert cli_main(["predict", "deqzoo/deq-flow-cpu-synth", "a.png,b.png"]) == 0  # the comma form
    assert "flow_a_b-1.png" in capsys.readouterr().out  # never overwrites the first
    # a one-input task refuses a second input, naming the count
    assert cli_main(["predict", "deqzoo/ignn-chains", "12", "13"]) == 2
    assert "takes one INPUT, got 2" in capsys.readouterr().err
