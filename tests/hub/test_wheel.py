"""A regular (non-editable) install ships the library and the embedded checkpoints, none of the repository's
programs: build the wheel, install it into a fresh virtual environment, and with HF_HUB_OFFLINE=1 and an empty
Hugging Face cache load every embedded checkpoint and run `deqzoo predict` on each, from a folder outside the
repository; `deqzoo eval`, `demo`, `convert` and `app` say they run from a clone.

Slow (a wheel, two environments, a prediction per checkpoint): marked `wheel`, run by CI in its own step
(`pytest -m wheel`). Offline: the wheel is built without build isolation (setuptools from this environment)
and installed with --no-index --no-deps; the new environment reaches its dependencies (torch, transformers,
...) through a path file naming this environment's site-packages, so nothing is downloaded. The deqzoo in
that environment is only the wheel's: this environment's editable-install hook is a .pth file, which a
path file's folder does not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from deqzoo.hub.catalog import load_catalog
from utils.catalog import REPO_ROOT

# building the wheel and two environments, then the demo of every checkpoint: minutes on 2 cores
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(1800)]


def _source_copy(dest: Path) -> Path:
    """The tracked files of the checkout (git ls-files), else the tree without build and cache folders."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
                               ).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        files = None
    if files:
        for rel in filter(None, files):
            src = REPO_ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(REPO_ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "demo_output", "bench_output"))
    return dest


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, env=_env(), timeout=600)
    (wheel,) = (tmp / "dist").glob("deqzoo-*.whl")
    return wheel


def _install(wheel: Path, tmp: Path, deps_dir: str):
    """A fresh venv with the wheel installed, reaching its dependencies through a path file to `deps_dir`."""
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "zz_deqzoo_test_deps.pth").write_text(deps_dir + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, env=_env(), timeout=600)
    work = tmp / "elsewhere"  # not the repository: nothing can come from model_cards/ there
    work.mkdir()
    env = _env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "empty-hf-home"), MPLBACKEND="Agg")
    return python, purelib, work, env, wheel


@pytest.fixture(scope="module")
def wheel_env(built_wheel, tmp_path_factory):
    """The wheel with every extra's packages reachable (this environment's site-packages)."""
    return _install(built_wheel, tmp_path_factory.mktemp("full"), sysconfig.get_paths()["purelib"])


def _hard_dependency_dir(target: Path) -> Path:
    """A folder of links to the distributions deqzoo's hard dependencies need (transitively, by their
    metadata, environment markers evaluated without extras) and nothing else: a fresh install without
    extras, made from this environment's packages (no download)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r).name for r in project["dependencies"]]
    seen: set[str] = set()
    target.mkdir()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-gated dependency absent here (e.g. another platform's)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        root = Path(dist.locate_file(""))
        for entry in {Path(str(f)).parts[0] for f in dist.files or []}:
            src = root / entry
            if entry not in ("..", "bin") and src.exists() and not (target / entry).exists():
                (target / entry).symlink_to(src)
    return target


@pytest.fixture(scope="module")
def bare_env(built_wheel, tmp_path_factory):
    """The wheel with only its hard dependencies reachable: what `pip install deqzoo` gives."""
    tmp = tmp_path_factory.mktemp("bare")
    return _install(built_wheel, tmp, str(_hard_dependency_dir(tmp / "deps")))


def test_wheel_carries_every_embedded_checkpoint(wheel_env):
    import zipfile

    _, _, _, _, wheel = wheel_env
    names = set(zipfile.ZipFile(wheel).namelist())
    for cid, entry in [*load_catalog().items(), *load_catalog(section="hypersolvers").items()]:
        folder = Path(entry["location"]).name
        for rel in entry["files"]:
            assert f"deqzoo/_model_cards/{folder}/{rel}" in names, (cid, rel)


def wheel_python_lines(wheel: Path) -> int:
    """Lines of Python the wheel ships (every .py file in it)."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return sum(archive.read(n).count(b"\n") for n in archive.namelist() if n.endswith(".py"))


def test_wheel_carries_the_library_only_and_the_repository_commands_say_where_they_run(wheel_env):
    """The repository's programs (the app, the evaluation and demo of examples/, the converters) are not in
    the wheel; the installed `deqzoo app`, `demo`, `eval` and `convert` refuse, saying to run from a clone."""
    import zipfile

    python, _, work, env, wheel = wheel_env
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if not n.startswith(("deqzoo/", "deqzoo-"))] == []
    assert [n for n in names if n.startswith(("deqzoo/tasks/", "deqzoo/conversion/"))] == []
    print(f"the wheel ships {wheel_python_lines(wheel):,} lines of Python")
    script = python.parent / ("deqzoo.exe" if os.name == "nt" else "deqzoo")
    proc = subprocess.run([str(script), "app"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "ships with the deqzoo repository" in proc.stderr and 'pip install -e ".[app]"' in proc.stderr
    for argv in (["demo"], ["eval", "deqzoo/mdeq-tiny-mnist"], ["convert", "list"]):
        proc = subprocess.run([str(script), *argv], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and "not in the wheel" in proc.stderr, (argv, proc.stderr[-2000:])
        assert "git clone" in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])


def test_wheel_install_loads_every_checkpoint_offline(wheel_env):
    python, purelib, work, env, _ = wheel_env
    code = (
        "import json, deqzoo\n"
        "from deqzoo.hub import resolve\n"
        "from deqzoo.hub.catalog import load_catalog\n"
        "out = {'file': deqzoo.__file__, 'models': {}}\n"
        "for cid in sorted(load_catalog()):\n"
        "    model = deqzoo.from_pretrained(cid)\n"
        "    out['models'][cid] = [type(model).__name__, str(resolve(cid))]\n"
        "hyper = 'deqzoo/hyperdeq-mdeq-tiny-mnist'\n"
        "model = deqzoo.from_pretrained('deqzoo/mdeq-tiny-mnist', hypersolver=hyper)\n"
        "out['hypersolver'] = str(resolve(hyper))\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([str(python), "-c", code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(purelib), out["file"]  # the wheel's deqzoo, not the checkout's
    assert set(out["models"]) == set(load_catalog())
    for cid, (cls, folder) in out["models"].items():
        assert folder.startswith(str(Path(purelib) / "deqzoo" / "_model_cards")), (cid, folder)
        assert cls != "NoneType"
    assert out["hypersolver"].startswith(str(Path(purelib) / "deqzoo" / "_model_cards")), out["hypersolver"]


def test_wheel_without_extras_loads_what_needs_none_and_names_the_extra_for_the_rest(bare_env):
    """Without extras: no torchvision, timm, diffusers, matplotlib, data packages; every checkpoint whose
    family needs no extra loads (hypersolver included), the others refuse naming the extra to install, and
    `deqzoo demo` refuses, saying it runs from a clone."""
    python, purelib, work, env, _ = bare_env
    code = (
        "import importlib.util, json, deqzoo\n"
        "from deqzoo.hub.catalog import load_catalog\n"
        "out = {'file': deqzoo.__file__, 'absent': [m for m in ('torchvision', 'timm', 'diffusers', "
        "'matplotlib', 'sklearn', 'cv2') if importlib.util.find_spec(m) is None], 'models': {}}\n"
        "for cid in sorted(load_catalog()):\n"
        "    try:\n"
        "        out['models'][cid] = ['loaded', type(deqzoo.from_pretrained(cid)).__name__]\n"
        "    except deqzoo.DeqzooError as err:\n"
        "        out['models'][cid] = ['refused', f'{type(err).__name__}: {err}']\n"
        "hyper = 'deqzoo/hyperdeq-mdeq-tiny-mnist'\n"
        "model = deqzoo.from_pretrained('deqzoo/mdeq-tiny-mnist', hypersolver=hyper)\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([str(python), "-c", code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(purelib), out["file"]
    assert out["absent"] == ["torchvision", "timm", "diffusers", "matplotlib", "sklearn", "cv2"]
    extras = {"deq_flow": "vision", "DDIMPipeline": "diffusion"}  # catalog model_type -> the extra it needs
    for cid, (outcome, detail) in out["models"].items():
        extra = extras.get(load_catalog()[cid]["model_type"])
        if extra is None:
            assert outcome == "loaded", (cid, detail)
        else:
            assert outcome == "refused" and f'pip install "deqzoo[{extra}]"' in detail, (cid, detail)
    assert sum(outcome == "loaded" for outcome, _ in out["models"].values()) >= 6
    script = python.parent / ("deqzoo.exe" if os.name == "nt" else "deqzoo")
    proc = subprocess.run([str(script), "demo", "--no-progress", "--output-dir", str(work / "demo")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2 and "not in the wheel" in proc.stderr, proc.stderr[-2000:]


def _predict_inputs(task: str, work: Path) -> list[str]:
    """`deqzoo predict` arguments for a checkpoint of `task`, its files written into `work`."""
    from PIL import Image

    if task == "mnist":
        Image.new("L", (28, 28), 255).save(work / "digit.png")
        return [str(work / "digit.png")]
    if task in ("pydoc_lm", "pystd_lm"):
        return ["def is_even(n):"]
    if task == "chains":
        return ["12"]
    if task == "implicit2":
        return ["16x16:" + str(work / "render.png")]
    if task == "ddim_digits":
        return [str(work / "samples.png")]
    if task == "flow":  # two image paths, as separate arguments
        gen = __import__("numpy").random.default_rng(0)
        frame = gen.integers(0, 255, (64, 64, 3), dtype="uint8")
        Image.fromarray(frame).save(work / "a.png")
        Image.fromarray(__import__("numpy").roll(frame, 2, axis=1)).save(work / "b.png")
        return [str(work / "a.png"), str(work / "b.png")]
    if task == "sudoku6":  # a held-out puzzle, row by row
        return ["6..... ...41. .51.6. ...3.. .....3 .6..4."]
    raise AssertionError(f"no predict input for task {task!r}")


def test_wheel_install_predicts_with_every_checkpoint_offline(wheel_env):
    """`deqzoo predict` (the package's own) runs every embedded checkpoint of the wheel, offline, from a
    folder outside the repository."""
    python, _, work, env, _ = wheel_env
    script = python.parent / ("deqzoo.exe" if os.name == "nt" else "deqzoo")
    for cid, entry in sorted(load_catalog().items()):
        folder = work / cid.replace("/", "_")
        folder.mkdir()
        argv = [str(script), "predict", cid, *_predict_inputs(entry["deqzoo_task"], folder)]
        proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0 and proc.stdout.strip(), (cid, proc.stdout[-2000:], proc.stderr[-3000:])
