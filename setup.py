"""Build hook: a wheel carries the embedded checkpoints.

The checkpoints live in ``model_cards/`` at the repository root (each folder a Hub repository). A regular
(non-editable) build copies the files the catalog lists (``deqzoo/hub/catalog.json``: checkpoints and
hypersolvers, with their sha256) into the package as ``deqzoo/_model_cards/<folder>/``, where
:func:`deqzoo.hub.catalog.embedded_folder` finds them; in a clone ``deqzoo/_model_cards`` is a link to
``model_cards/``, so an editable install reads them in place.
Everything else is in pyproject.toml.
"""

import hashlib
import json
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCheckpoints(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        catalog = json.loads((ROOT / "deqzoo" / "hub" / "catalog.json").read_text())
        target_root = Path(self.build_lib) / "deqzoo" / "_model_cards"
        entries = [*catalog.get("checkpoints", {}).values(), *catalog.get("hypersolvers", {}).values()]
        for entry in entries:
            source = ROOT / entry["location"]
            target = target_root / Path(entry["location"]).name
            for rel, digest in entry["files"].items():
                src = source / rel
                if hashlib.sha256(src.read_bytes()).hexdigest() != digest:
                    raise SystemExit(f"{src}: sha256 differs from deqzoo/hub/catalog.json; "
                                     "run `python -m utils.catalog` before building")
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, target / rel)


setup(cmdclass={"build_py": BuildPyWithCheckpoints})
