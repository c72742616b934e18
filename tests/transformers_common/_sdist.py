"""transformers' own common model tests, taken from the sdist of the pinned transformers at test time.

The sdist (``pip download transformers==<pin> --no-binary :all:``, hash-checked by pip against PyPI) ships
``tests/test_modeling_common.py`` and ``tests/test_configuration_common.py``. Its ``tests/*.py`` files are
extracted into a cache folder outside the repository (``$XDG_CACHE_HOME/deqzoo-tests/``, default
``~/.cache``), made an importable package, and imported from there: nothing of transformers' test code is
committed here. ``DEQZOO_TRANSFORMERS_SDIST=/path/to/transformers-<pin>.tar.gz`` uses a local copy (offline).

The sdist does not ship three sibling modules that the two import: ``tests/exporters/test_export.py``
(``ExportTesterMixin``, the torch.export tests) and ``tests/generation/test_utils.py``
(``GenerationTesterMixin``, the ``generate()`` tests) are replaced by empty classes, so those two groups of
tests are not run (they are not in the sdist); ``tests/utils/test_configuration_utils.py`` provides
``config_common_kwargs`` (every public field of ``PreTrainedConfig()`` with a non-default value, for
``ConfigTester.check_config_arguments_init``): ours is written below and checked for completeness against
the installed ``PreTrainedConfig``. Every test defined in the two shipped modules runs.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import transformers

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "transformers_sdist_tests"  # not "tests": it must not shadow this repository's own test folder
REQUIRED = ("test_modeling_common.py", "test_configuration_common.py")
# the two sibling modules the sdist lacks (see the module docstring): empty stand-ins
PLACEHOLDERS = {
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}
# ConfigTester.check_config_arguments_init builds a config from these and checks each one was kept
CONFIG_COMMON_KWARGS = {
    "architectures": ["BertModel"],
    "output_hidden_states": True,
    "output_attentions": True,
    "return_dict": False,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "id2label": {0: "label"},
    "label2id": {"label": 0},
    "problem_type": "regression",
}
PLACEHOLDERS["utils/test_configuration_utils.py"] = f"config_common_kwargs = {CONFIG_COMMON_KWARGS!r}\n"
# PreTrainedConfig's fields that are not constructor options of a model config
NOT_COMMON_KWARGS = {"transformers_version", "is_encoder_decoder"}


def check_common_kwargs() -> None:
    """CONFIG_COMMON_KWARGS names every public field of the installed PreTrainedConfig, none at its default
    (upstream keeps the same check beside its own list)."""
    from transformers import PreTrainedConfig

    base = PreTrainedConfig()
    fields = {k.lstrip("_") for k in vars(base) if not k.startswith("_") or k == "_output_attentions"}
    missing = sorted(fields - NOT_COMMON_KWARGS - set(CONFIG_COMMON_KWARGS))
    defaults = sorted(k for k, v in CONFIG_COMMON_KWARGS.items() if getattr(base, k) == v)
    if missing or defaults:
        raise RuntimeError("CONFIG_COMMON_KWARGS is out of date for transformers "
                           f"{transformers.__version__}: missing {missing}, at their default {defaults}")


def pinned_version() -> str:
    """transformers' version in constraints.txt; the installed one must be it (the tests are its own)."""
    text = (REPO_ROOT / "constraints.txt").read_text(encoding="utf-8")
    match = re.search(r"^transformers==(\S+)$", text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{REPO_ROOT / 'constraints.txt'} pins no transformers version (transformers==X)")
    version = match.group(1)
    if transformers.__version__ != version:
        raise RuntimeError(f"transformers {transformers.__version__} is installed but constraints.txt pins "
                           f"{version}: the common tests are taken from the pinned version's sdist; "
                           "install it with `pip install -c constraints.txt transformers`")
    return version


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deqzoo-tests"


def _sdist_archive(version: str, workdir: Path) -> Path:
    """The sdist tarball: $DEQZOO_TRANSFORMERS_SDIST, or pip's download of it into `workdir`."""
    local = os.environ.get("DEQZOO_TRANSFORMERS_SDIST")
    if local:
        path = Path(local)
        if not path.is_file():
            raise FileNotFoundError(f"DEQZOO_TRANSFORMERS_SDIST={local}: no such file")
        return path
    cmd = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
           "--no-deps", "--quiet", "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    archives = sorted(workdir.glob(f"transformers-{version}.tar.gz"))
    if proc.returncode != 0 or not archives:
        raise RuntimeError(f"could not download the transformers {version} sdist ({' '.join(cmd)}), exit "
                           f"{proc.returncode}:\n{proc.stderr[-2000:]}\nSet DEQZOO_TRANSFORMERS_SDIST to a "
                           "local copy to run offline.")
    return archives[0]


def _extract_tests(archive: Path, version: str, dest: Path) -> None:
    """The sdist's top-level ``tests/*.py`` (regular files only) into `dest`, as package PACKAGE."""
    prefix = f"transformers-{version}/tests/"
    package = dest / PACKAGE
    package.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if not (name.startswith(prefix) and member.isfile() and name.endswith(".py")):
                continue
            relative = name[len(prefix):]
            if "/" in relative or not re.fullmatch(r"[A-Za-z0-9_]+\.py", relative):
                continue
            source = tar.extractfile(member)
            assert source is not None
            (package / relative).write_bytes(source.read())
    missing = [f for f in REQUIRED if not (package / f).is_file()]
    if missing:
        raise RuntimeError(f"{archive}: the transformers {version} sdist has no "
                           f"tests/{', tests/'.join(missing)}")
    (package / "__init__.py").write_text("", encoding="utf-8")
    for relative, text in PLACEHOLDERS.items():
        path = package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").write_text("", encoding="utf-8")
        if path.exists():  # a later sdist that ships it: use transformers' own
            continue
        path.write_text(text, encoding="utf-8")


def tests_folder() -> Path:
    """The folder holding package PACKAGE for the pinned version, extracted on first use."""
    version = pinned_version()
    folder = cache_root() / f"transformers-{version}"
    if (folder / PACKAGE / "__init__.py").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".transformers-{version}-", dir=folder.parent))
    try:
        archive = _sdist_archive(version, work / "download")
        _extract_tests(archive, version, work / "extracted")
        try:
            (work / "extracted").rename(folder)  # atomic: a concurrent run finds all of it or nothing
        except OSError:
            if not (folder / PACKAGE / "__init__.py").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def load(module: str) -> ModuleType:
    """``<sdist tests>/<module>.py``, imported (e.g. ``load("test_modeling_common")``)."""
    folder = str(tests_folder())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"{PACKAGE}.{module}")
