"""The catalog of embedded checkpoints (`deqzoo/hub/catalog.json`, written by `python -m utils.catalog` from
`model_cards/*/`): id, location, every file's sha256 (verified on load), tasks, metrics, parameter count.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

NAMESPACE = "deqzoo"
CATALOG_PATH = Path(__file__).resolve().parent / "catalog.json"
# where the package finds the embedded checkpoints: a wheel carries the catalog's files there (setup.py); in a
# clone it is a symbolic link to the repository's model_cards/, so an editable install reads them in place
PACKAGED_CARDS_DIR = Path(__file__).resolve().parent.parent / "_model_cards"


def embedded_folder(entry: dict[str, Any]) -> Path | None:
    """The folder of an embedded checkpoint inside the package (`_model_cards/<folder>`; an absolute location,
    as a catalog built for elsewhere records, is taken as is); None when this install does not carry it.

    Example:
        >>> entry = load_catalog()["deqzoo/mdeq-tiny-mnist"]
        >>> (embedded_folder(entry) / "config.json").is_file()
        True
    """
    location = Path(entry["location"])
    folder = location if location.is_absolute() else PACKAGED_CARDS_DIR / location.name
    return folder if folder.is_dir() else None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    # our own loop: huggingface_hub's `utils.sha.sha_fileobj` is not public API, and `hashlib.file_digest`
    # needs Python 3.11 (we support 3.10)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def load_catalog(path: Path | None = None, section: str = "checkpoints") -> dict[str, dict[str, Any]]:
    """{id: entry} of the embedded checkpoints ({} when no catalog has been generated); `section`
    "hypersolvers" lists the embedded hypersolvers, whose folders resolve through `embedded_folder` too.

    Example:
        >>> "deqzoo/hyperdeq-mdeq-tiny-mnist" in load_catalog(section="hypersolvers")
        True
    """
    path = Path(path) if path is not None else CATALOG_PATH  # module global read at call time (tests swap it)
    return json.loads(path.read_text()).get(section, {}) if path.is_file() else {}

