"""Repository tooling: (re)generate `deqzoo/hub/catalog.json` from `model_cards/*/`, and the two tables made
from it (README.md's, docs/hub.md's).

Run after adding or retraining a checkpoint, from the repository root::

    python -m utils.catalog            # write the catalog, refresh README.md's and docs/hub.md's tables
    python -m utils.catalog --check    # exit 1 if the catalog or either table is out of date
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from deqzoo.hub.cards import CARD_NAME, card_metrics, read_model_card
from deqzoo.hub.catalog import CATALOG_PATH, NAMESPACE, sha256_file
from deqzoo.hub.safetensors_io import WEIGHTS_NAME
from utils.cards import card_headline

REPO_ROOT = Path(__file__).resolve().parent.parent
CARDS_DIR = REPO_ROOT / "model_cards"


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
    from deqzoo.factory import parameter_count

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


README_START, README_END = "<!-- catalog:start -->", "<!-- catalog:end -->"


def _hypersolver_rows(catalog: dict[str, Any], root: Path) -> list[tuple[str, str, int, str, float]]:
    """(id, card location, parameters, base model, size in MB) per hypersolver, read from its folder."""
    from safetensors import safe_open

    rows = []
    for hid, entry in sorted((catalog.get("hypersolvers") or {}).items()):
        folder = Path(entry["location"])
        folder = folder if folder.is_absolute() else root / folder
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as handle:
            parameters = sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys())
        rows.append((hid, entry["location"], parameters, entry.get("model_id") or "?",
                     entry["size_bytes"] / 1e6))
    return rows


def catalog_markdown(catalog: dict[str, Any], root: Path = REPO_ROOT) -> str:
    """The README's checkpoint table (links to the cards in the clone), then its hypersolvers, if any."""
    lines = ["| Checkpoint | Parameters | Headline result (data set) | Size |", "|---|---|---|---|"]
    for cid, entry in sorted(catalog["checkpoints"].items()):
        metrics = entry.get("headline") or \
            ", ".join(f"{k} {v}" for k, v in (entry.get("metrics") or {}).items())
        lines.append(f"| [`{cid}`]({entry['location']}/README.md) | "
                     f"{entry.get('parameters', 0):,} | {metrics} | {entry['size_bytes'] / 1e6:.2f} MB |")
    if not catalog["checkpoints"]:
        lines.append("| (none yet) | | | |")
    hyper = _hypersolver_rows(catalog, root)
    if hyper:
        lines += ["", "Hypersolvers: " + "; ".join(
            f"[`{hid}`]({location}/README.md) for `{base}` ({parameters:,} parameters, {size:.2f} MB)"
            for hid, location, parameters, base, size in hyper) + "."]
    return "\n".join(lines)


def docs_catalog_markdown(catalog: dict[str, Any], root: Path = REPO_ROOT) -> str:
    """docs/hub.md's tables, from the same catalog as the README's: every metric of every checkpoint (links
    to the Hub repositories: the site has no copy of the cards), then every hypersolver."""
    lines = ["| Checkpoint | Task | Parameters | Metrics | Size |", "|---|---|---|---|---|"]
    for cid, entry in sorted(catalog["checkpoints"].items()):
        metrics = ", ".join(f"{k} {v}" for k, v in (entry.get("metrics") or {}).items())
        lines.append(f"| [`{cid}`](https://huggingface.co/{cid}) | {entry.get('task')} | "
                     f"{entry.get('parameters', 0):,} | {metrics} | {entry['size_bytes'] / 1e6:.2f} MB |")
    hyper = _hypersolver_rows(catalog, root)
    if hyper:
        lines += ["", "| Hypersolver | For checkpoint | Parameters | Size |", "|---|---|---|---|"]
        lines += [f"| [`{hid}`](https://huggingface.co/{hid}) | `{base}` | {parameters:,} | {size:.2f} MB |"
                  for hid, _, parameters, base, size in hyper]
    return "\n".join(lines)


def update_readme(catalog: dict[str, Any], readme: Path, render=catalog_markdown) -> bool:
    """Replace the table between the catalog markers in `readme` (or docs/hub.md, with
    `render=docs_catalog_markdown`); returns True if the file changed."""
    text = readme.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{readme}: no {README_START} ... {README_END} markers")
    new = f"{text[:start]}{README_START}\n{render(catalog)}\n{text[end:]}"
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.catalog", description=__doc__.splitlines()[0])
    parser.add_argument("--cards-dir", type=Path, default=CARDS_DIR)
    parser.add_argument("--output", type=Path, default=CATALOG_PATH)
    parser.add_argument("--check", action="store_true", help="exit 1 if the catalog on disk is out of date")
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md",
                        help="README whose catalog table is refreshed (skipped if it has no markers)")
    parser.add_argument("--docs", type=Path, default=None,
                        help="docs page whose catalog tables are refreshed (default: docs/hub.md when the "
                             "catalog is the repository's own)")
    parser.add_argument("--skip-incomplete", action="store_true",
                        help="leave out folders still missing config.json, model.safetensors or README.md")
    args = parser.parse_args(argv)
    catalog = build_catalog(args.cards_dir, skip_incomplete=args.skip_incomplete)
    if args.docs is None and args.cards_dir == CARDS_DIR and args.output == CATALOG_PATH:
        args.docs = REPO_ROOT / "docs" / "hub.md"
    pages = [(path, render) for path, render in ((args.readme, catalog_markdown),
                                                 (args.docs, docs_catalog_markdown))
             if path is not None and path.is_file() and README_START in path.read_text()]
    if args.check:
        current = json.loads(args.output.read_text()) if args.output.is_file() else None
        if current != catalog:
            print(f"{args.output} is out of date; run `python -m utils.catalog`")
            return 1
        for path, render in pages:
            text = path.read_text()
            if f"{README_START}\n{render(catalog)}\n{README_END}" not in text:
                print(f"{path}'s catalog table is out of date; run `python -m utils.catalog`")
                return 1
        print(f"{args.output} is up to date ({len(catalog['checkpoints'])} checkpoints)")
        return 0
    write_catalog(catalog, args.output)
    for path, render in pages:
        update_readme(catalog, path, render)
    total = sum(e["size_bytes"] for e in catalog["checkpoints"].values())
    print(f"wrote {args.output}: {len(catalog['checkpoints'])} checkpoints, {total / 1e6:.2f} MB")
    for entry in catalog["checkpoints"].values():
        print(f"  {entry['id']}: {entry['task']}, {entry['parameters']:,} parameters, "
              f"metrics {entry['metrics']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
