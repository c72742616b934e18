"""The catalog of embedded checkpoints (`deqzoo/hub/catalog.json`), generated from `model_cards/*/`.

Regenerate after adding or retraining a checkpoint::

    python -m deqzoo.hub.catalog

Each entry: id `deqzoo/<folder>`, location (relative to the repository root), sha256 of every file, pipeline
task, deqzoo task module, card metrics, model_type and parameter count. Loading verifies every sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..cards import CARD_NAME, card_headline, card_metrics, read_model_card
from ..safetensors_io import WEIGHTS_NAME

NAMESPACE = "deqzoo"
HUB_DIR = Path(__file__).resolve().parent.parent
PACKAGE_DIR = HUB_DIR.parent
REPO_ROOT = PACKAGE_DIR.parent
CATALOG_PATH = HUB_DIR / "catalog.json"
CARDS_DIR = REPO_ROOT / "model_cards"
# where a wheel carries the embedded checkpoints (setup.py copies the catalog's files there)
PACKAGED_CARDS_DIR = PACKAGE_DIR / "_model_cards"


def embedded_folder(entry: dict[str, Any]) -> Path | None:
    """The folder of an embedded checkpoint: in the source tree (editable install) or inside the installed
    package (a wheel); None when this install has neither.

    Example:
        >>> entry = load_catalog()["deqzoo/mdeq-tiny-mnist"]
        >>> (embedded_folder(entry) / "config.json").is_file()
        True
    """
    location = Path(entry["location"])
    candidates = [location] if location.is_absolute() else [REPO_ROOT / location,
                                                             PACKAGED_CARDS_DIR / location.name]
    return next((c for c in candidates if c.is_dir()), None)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                             for part in p.relative_to(folder).parts))


def describe_checkpoint(folder: Path, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Catalog entry for one checkpoint folder (a deqzoo model, or a diffusers repo: model_index.json)."""
    diffusers_repo = (folder / "model_index.json").is_file()
    required = ("model_index.json", CARD_NAME) if diffusers_repo else ("config.json", WEIGHTS_NAME, CARD_NAME)
    for needed in required:
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder}: a checkpoint folder needs {needed}")
    meta, _ = read_model_card(folder)
    config = json.loads((folder / ("model_index.json" if diffusers_repo else "config.json")).read_text())
    try:
        location = folder.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        location = str(folder.resolve())
    files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in _checkpoint_files(folder)}
    return {
        "id": f"{NAMESPACE}/{folder.name}",
        "location": location,
        "files": files,
        "size_bytes": sum((folder / name).stat().st_size for name in files),
        "model_type": config.get("_class_name") if diffusers_repo else config.get("model_type"),
        "task": meta.get("pipeline_tag"),
        "deqzoo_task": meta.get("deqzoo_task"),
        "metrics": card_metrics(meta),
        "headline": card_headline(meta),
        "parameters": _diffusers_parameter_count(folder) if diffusers_repo else _parameter_count(config),
        "license": meta.get("license"),
        "datasets": meta.get("datasets", []),
    }


def _diffusers_parameter_count(folder: Path) -> int:
    """Tensor elements in the safetensors files of the components model_index.json names (headers only)."""
    from safetensors import safe_open

    index = json.loads((folder / "model_index.json").read_text())
    components = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]
    total = 0
    for path in sorted(p for c in components for p in (folder / c).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            total += sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _parameter_count(config: dict[str, Any]) -> int:
    from ...factory import parameter_count  # hub -> models through the registry, imported when needed

    return parameter_count(config)


def _is_hypersolver(folder: Path) -> bool:
    """A HyperDEQ hypersolver folder (`deqzoo.hypersolver`): a solver artifact, not a model checkpoint; it is
    loaded by id through `deqzoo.hypersolver.load_hypersolver` (its config records its weights' sha256)."""
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "hypersolver"
    except (OSError, ValueError, AttributeError):
        return False


def describe_hypersolver(folder: Path, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Catalog entry for one hypersolver folder: where it is and its files' sha256 (what a wheel carries)."""
    for needed in ("config.json", WEIGHTS_NAME, CARD_NAME):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder}: a hypersolver folder needs {needed}")
    try:
        location = folder.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        location = str(folder.resolve())
    files = {p.relative_to(folder).as_posix(): sha256_file(p) for p in _checkpoint_files(folder)}
    return {"id": f"{NAMESPACE}/{folder.name}", "location": location, "files": files,
            "size_bytes": sum((folder / name).stat().st_size for name in files),
            "model_id": json.loads((folder / "config.json").read_text()).get("model_id")}


def build_catalog(cards_dir: Path = CARDS_DIR, root: Path = REPO_ROOT, *,
                  skip_incomplete: bool = False) -> dict[str, Any]:
    """Describe every checkpoint folder (and, apart, every hypersolver folder); an incomplete folder is an
    error unless `skip_incomplete`."""
    candidates = sorted(p for p in Path(cards_dir).glob("*/") if p.is_dir() and not p.name.startswith("."))
    hypersolvers = [describe_hypersolver(p, root) for p in candidates if _is_hypersolver(p)]
    folders = [p for p in candidates if not _is_hypersolver(p)]
    entries = []
    for folder in folders:
        try:
            entries.append(describe_checkpoint(folder, root))
        except FileNotFoundError as err:
            if not skip_incomplete:
                raise
            print(f"skipping incomplete checkpoint folder: {err}")
    return {"format": 1, "checkpoints": {entry["id"]: entry for entry in entries},
            "hypersolvers": {entry["id"]: entry for entry in hypersolvers}}


def write_catalog(catalog: dict[str, Any], path: Path = CATALOG_PATH) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(catalog, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_catalog(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """{id: entry} of the embedded checkpoints ({} when no catalog has been generated)."""
    path = Path(path) if path is not None else CATALOG_PATH  # module global read at call time (tests swap it)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data.get("checkpoints", {})


def load_hypersolver_catalog(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """{id: entry} of the embedded hypersolvers (`deqzoo.hypersolver`); their folders resolve through
    `embedded_folder` like checkpoints'.

    Example:
        >>> "deqzoo/hyperdeq-mdeq-tiny-mnist" in load_hypersolver_catalog()
        True
    """
    path = Path(path) if path is not None else CATALOG_PATH
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("hypersolvers", {})


README_START, README_END = "<!-- catalog:start -->", "<!-- catalog:end -->"


def catalog_markdown(catalog: dict[str, Any]) -> str:
    """The README's checkpoint table."""
    lines = ["| Checkpoint | Task | Parameters | Headline result (data set) | Size |",
             "|---|---|---|---|---|"]
    for cid, entry in sorted(catalog["checkpoints"].items()):
        metrics = entry.get("headline") or \
            ", ".join(f"{k} {v}" for k, v in (entry.get("metrics") or {}).items())
        lines.append(f"| [`{cid}`]({entry['location']}/README.md) | {entry.get('task')} | "
                     f"{entry.get('parameters', 0):,} | {metrics} | {entry['size_bytes'] / 1e6:.2f} MB |")
    if not catalog["checkpoints"]:
        lines.append("| (none yet) | | | | |")
    return "\n".join(lines)


def update_readme(catalog: dict[str, Any], readme: Path) -> bool:
    """Replace the table between the catalog markers in `readme`; returns True if the file changed."""
    text = readme.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{readme}: no {README_START} ... {README_END} markers")
    new = f"{text[:start]}{README_START}\n{catalog_markdown(catalog)}\n{text[end:]}"
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deqzoo.hub.catalog", description=__doc__.splitlines()[0])
    parser.add_argument("--cards-dir", type=Path, default=CARDS_DIR)
    parser.add_argument("--output", type=Path, default=CATALOG_PATH)
    parser.add_argument("--check", action="store_true", help="exit 1 if the catalog on disk is out of date")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md",
                        help="README whose catalog table is refreshed (skipped if it has no markers)")
    parser.add_argument("--skip-incomplete", action="store_true",
                        help="leave out folders still missing config.json, model.safetensors or README.md")
    args = parser.parse_args(argv)
    catalog = build_catalog(args.cards_dir, skip_incomplete=args.skip_incomplete)
    if args.check:
        current = json.loads(args.output.read_text()) if args.output.is_file() else None
        if current != catalog:
            print(f"{args.output} is out of date; run `python -m deqzoo.hub.catalog`")
            return 1
        print(f"{args.output} is up to date ({len(catalog['checkpoints'])} checkpoints)")
        return 0
    write_catalog(catalog, args.output)
    if args.readme.is_file() and README_START in args.readme.read_text():
        update_readme(catalog, args.readme)
    total = sum(e["size_bytes"] for e in catalog["checkpoints"].values())
    print(f"wrote {args.output}: {len(catalog['checkpoints'])} checkpoints, {total / 1e6:.2f} MB")
    for entry in catalog["checkpoints"].values():
        print(f"  {entry['id']}: {entry['task']}, {entry['parameters']:,} parameters, "
              f"metrics {entry['metrics']}")
    return 0
