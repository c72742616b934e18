"""Reliability, CLI (issue 17): every expected failure prints one line naming the thing at fault and exits 2,
without a traceback; `--debug` shows the traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from deqzoo.cli import main as cli_main
from utils.catalog import REPO_ROOT

MNIST = "deqzoo/mdeq-tiny-mnist"


def _fails_in_one_line(capsys, argv, *needles):
    code = cli_main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (code, captured.out, err)
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"deqzoo {argv[0]}: error: "), err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err


def test_predict_missing_image(capsys, tmp_path):
    _fails_in_one_line(capsys, ["predict", MNIST, str(tmp_path / "nope.png")], "nope.png")


def test_predict_bad_image(capsys, tmp_path):
    path = tmp_path / "digit.png"
    path.write_bytes(b"not a png at all")
    _fails_in_one_line(capsys, ["predict", MNIST, str(path)], "digit.png", "not a readable image")


def test_predict_decompression_bomb(capsys, tmp_path):
    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("1", (10_000, 10_000)).save(path)
    _fails_in_one_line(capsys, ["predict", MNIST, str(path)], "bomb.png")


def test_predict_2mb_text_file(capsys, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("word " * 400_000)
    _fails_in_one_line(capsys, ["predict", "deqzoo/deq-transformer-tiny-pydoc", str(path)], "book.txt",
                       "MAX_PROMPT_CHARS")


def test_unknown_checkpoint(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails_in_one_line(capsys, ["info", "nobody/nothing"], "nobody/nothing")


def test_offline_push(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails_in_one_line(capsys, ["push", str(REPO_ROOT / "model_cards" / "ignn-chains"), "--repo-id", "me/x"],
                       "me/x", "offline")


def test_push_to_an_unreachable_endpoint(capsys):
    _fails_in_one_line(capsys, ["push", str(REPO_ROOT / "model_cards" / "ignn-chains"), "--repo-id", "me/x",
                                "--endpoint", "http://127.0.0.1:9"], "me/x", "http://127.0.0.1:9")


def test_push_a_folder_that_is_not_a_checkpoint(capsys, tmp_path):
    _fails_in_one_line(capsys, ["push", str(tmp_path), "--repo-id", "me/x"], str(tmp_path), "no config.json")


def test_convert_onto_an_existing_file(capsys, tmp_path):
    out = tmp_path / "out"
    out.write_text("mine")
    src = tmp_path / "src.pt"
    src.write_bytes(b"x")
    _fails_in_one_line(capsys, ["convert", "ignn-swiftieh", str(src), str(out)], "out", "is a file")
    assert out.read_text() == "mine"


def test_convert_missing_source(capsys, tmp_path):
    _fails_in_one_line(capsys, ["convert", "ignn-swiftieh", str(tmp_path / "nope.pt"), str(tmp_path / "o")],
                       "nope.pt")


def test_demo_output_dir_is_an_existing_file(capsys, tmp_path):
    out = tmp_path / "plots"
    out.write_text("mine")
    _fails_in_one_line(capsys, ["demo", "deqzoo/ignn-chains", "--output-dir", str(out), "--no-progress"],
                       "plots")
    assert out.read_text() == "mine"


@pytest.mark.parametrize("command", ["info", "predict", "eval"])
@pytest.mark.parametrize("content", ["[1, 2]", "null", '"text"'])
def test_config_json_that_is_not_an_object(capsys, tmp_path, command, content):
    folder = tmp_path / "ckpt"
    shutil.copytree(REPO_ROOT / "model_cards" / "ignn-chains", folder)
    (folder / "config.json").write_text(content)
    argv = [command, str(folder)] + (["40"] if command == "predict" else [])
    _fails_in_one_line(capsys, argv, folder / "config.json", "top level must be a JSON object")


def test_bad_config_value(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(REPO_ROOT / "model_cards" / "mdeq-tiny-mnist", folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_groups"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    _fails_in_one_line(capsys, ["eval", str(folder), "--limit", "2"], "config.json", "num_groups")


def test_card_without_task(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(REPO_ROOT / "model_cards" / "ignn-chains", folder)
    card = (folder / "README.md").read_text().replace("deqzoo_task:", "old_task:")
    (folder / "README.md").write_text(card)
    _fails_in_one_line(capsys, ["predict", str(folder), "40"], "README.md", "deqzoo_task")


def test_unknown_benchmark_and_convert_format(capsys):
    _fails_in_one_line(capsys, ["bench", "nope"], "nope", "known benchmarks")
    _fails_in_one_line(capsys, ["convert", "nope", "a", "b"], "nope", "known formats")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli_main(["--debug", "push", str(tmp_path), "--repo-id", "me/x"])
    with pytest.raises(FileNotFoundError):
        cli_main(["push", str(tmp_path), "--repo-id", "me/x", "--debug"])


def test_version_and_bench_help(capsys):
    import deqzoo

    with pytest.raises(SystemExit) as info:
        cli_main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"deqzoo {deqzoo.__version__}"
    with pytest.raises(SystemExit) as info:
        cli_main(["bench", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for name in ("ignn", "mdeq", "solvers"):
        assert name in out.split("available benchmarks:")[1]


def test_real_process_exit_code_and_single_line(tmp_path):
    """The installed entry point's behaviour in a real process: exit status 2, one stderr line."""
    result = subprocess.run([sys.executable, "-m", "deqzoo.cli", "push", str(tmp_path), "--repo-id", "me/x"],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert str(tmp_path) in result.stderr


@pytest.mark.parametrize("limit", ["0", "-3", "two"])
def test_eval_limit_must_be_a_positive_integer(capsys, limit):
    """Issue 31: `--limit 0` ended in a ZeroDivisionError after loading the model."""
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", MNIST, "--limit", limit])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--limit" in err and "positive integer" in err and "Traceback" not in err


def test_convert_option_fixed_by_the_weights_names_it(capsys, tmp_path):
    """Issue 31: `--option hidden_size=-1` escaped as a TypeError traceback (the keyword passed twice)."""
    src = REPO_ROOT / "conversion" / "fixtures" / "implicit2" / "impsq_gabor_1l_implicit_state_dict.pt"
    out = tmp_path / "out"
    argv = ["convert", "implicit2-impsq", str(src), str(out), "--option", "hidden_size=-1"]
    _fails_in_one_line(capsys, argv, "hidden_size=-1", "the checkpoint fixes it")
    assert not out.exists()
