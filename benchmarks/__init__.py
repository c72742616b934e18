"""Side-by-side benchmarks (scripts writing JSON + PNG), kept outside the installed package.

Run from a clone's root: ``deqzoo bench NAME [ARGS]`` or ``python -m benchmarks.NAME [ARGS]``.
"""

from __future__ import annotations

import os
from pathlib import Path

# benchmarks are repository tooling: they may know the clone
REPO_ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The environment for a benchmark's child interpreter: this clone first on its import path."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
