"""Embedded checkpoints in huggingface_hub's cache layout, so stock libraries (transformers, timm's
``hf-hub:``, diffusers) resolve ``deqzoo/<name>`` offline: ``python -m deqzoo.hub.hf_cache``.

Each repository folder (``models--deqzoo--<name>/snapshots/<commit>/`` with plain copies, as huggingface_hub
writes where symlinks are unavailable, and ``refs/main``) holds the embedded files byte for byte, except
that a timm-buildable checkpoint's ``config.json`` also names its timm ``architecture`` and
``pretrained_cfg``. A folder deqzoo did not write (no ``.deqzoo-embedded`` marker) is never touched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .catalog import embedded_folder, load_catalog, sha256_file
from .loading import verify_embedded
from .saving import atomic_save, write_whole

MARKER = ".deqzoo-embedded"


def _timm_config(cid: str) -> dict[str, Any] | None:
    """timm's hf-hub keys for a checkpoint timm can build (None for the others)."""
    from ..factory import model_names

    row = next((r for r in model_names() if r["hub_id"] == cid), None)
    if not row or not row["timm"]:
        return None
    import timm.models

    from ..integrations import timm as _registered  # noqa: F401 - adds the MDEQ entries to timm's registry

    cfg = timm.models.get_pretrained_cfg(row["timm"])
    pretrained = {k: v for k, v in (cfg.to_dict() if cfg is not None else {}).items() if v is not None}
    pretrained.update({"hf_hub_id": cid})
    return {"architecture": row["timm"], "pretrained_cfg": pretrained}


def snapshot_files(cid: str, entry: dict[str, Any]) -> dict[str, bytes | Path]:
    """{path in repo: source file, or bytes for a derived file} of one embedded checkpoint's snapshot."""
    folder = embedded_folder(entry)
    if folder is None:
        raise FileNotFoundError(f"{cid}: the embedded folder is not part of this install")
    verify_embedded(entry, folder)
    files: dict[str, bytes | Path] = {rel: folder / rel for rel in sorted(entry["files"])}
    timm_keys = _timm_config(cid) if "config.json" in files else None
    if timm_keys:
        config = json.loads(Path(files["config.json"]).read_text())
        files["config.json"] = (json.dumps({**config, **timm_keys}, indent=2, sort_keys=True) + "\n").encode()
    return files


def _commit(files: dict[str, str]) -> str:
    """A stable 40-hex commit id for a snapshot: sha1 over its (path, sha256) pairs."""
    return hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()


def populate_hf_cache(cache_dir: str | os.PathLike | None = None, names: list[str] | None = None
                      ) -> dict[str, str]:
    """Write every embedded checkpoint (or `names`) into the HF cache; returns {id: what happened}.

    Example:
        >>> import tempfile
        >>> status = populate_hf_cache(tempfile.mkdtemp(), names=["deqzoo/mdeq-tiny-mnist"])
        >>> status["deqzoo/mdeq-tiny-mnist"].startswith("written")
        True
    """
    from huggingface_hub import constants  # the cache huggingface_hub itself reads in this process

    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    catalog = load_catalog()
    wanted = sorted(catalog) if names is None else names
    unknown = [n for n in wanted if n not in catalog]
    if unknown:
        raise ValueError(f"not embedded checkpoints: {unknown}; embedded: {sorted(catalog)}")
    report = {}
    for cid in wanted:
        report[cid] = _populate_one(cache, cid, catalog[cid])
    return report


def _populate_one(cache: Path, cid: str, entry: dict[str, Any]) -> str:
    repo = cache / f"models--{cid.replace('/', '--')}"
    marker = repo / MARKER
    if repo.exists() and not marker.is_file():
        return f"kept: {repo} exists and was not written by deqzoo (left untouched)"
    files = snapshot_files(cid, entry)
    digests = {rel: hashlib.sha256(src).hexdigest() if isinstance(src, bytes) else sha256_file(src)
               for rel, src in files.items()}
    commit = _commit(digests)
    snapshot = repo / "snapshots" / commit
    ref = repo / "refs" / "main"
    if ref.is_file() and ref.read_text().strip() == commit and all((snapshot / r).is_file() for r in files):
        return f"present: {snapshot}"
    repo.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by `python -m deqzoo.hub.hf_cache` from deqzoo's embedded checkpoints\n")

    def write(tmp: Path) -> None:
        for rel, src in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, bytes):
                (tmp / rel).write_bytes(src)
            else:
                shutil.copyfile(src, tmp / rel)

    atomic_save(snapshot, write)  # a reader sees all of the snapshot or none of it
    ref.parent.mkdir(parents=True, exist_ok=True)
    write_whole(ref, commit)
    return f"written: {snapshot}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deqzoo.hub.hf_cache",
        description="Write deqzoo's embedded checkpoints into the Hugging Face cache (huggingface_hub's "
                    "layout) so transformers, timm (hf-hub:) and diffusers load their hub ids offline. "
                    "Entries deqzoo did not write are never touched.")
    parser.add_argument("names", nargs="*", help="hub ids (default: every embedded checkpoint)")
    parser.add_argument("--cache-dir", default=None, help="default: $HF_HUB_CACHE or $HF_HOME/hub")
    args = parser.parse_args(argv)
    report = populate_hf_cache(args.cache_dir, args.names or None)
    for cid, status in report.items():
        print(f"{cid}: {status}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
