"""Upload a checkpoint directory to the Hub (or any endpoint speaking its API) through huggingface_hub, in one
commit of the files an allow-list names as a checkpoint's.

The options are those of transformers' ``PreTrainedModel.push_to_hub`` (commit message and description,
revision, create_pr, private, tags, token), each passed to huggingface_hub; what the allow-list leaves out
(optimizer state, logs, ``credentials.json``, ``notes.txt``) is named in a warning (and by ``deqzoo push``).
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path

from .safetensors_io import weight_files
from .validation import is_network_error, read_json

logger = logging.getLogger("deqzoo")
CARD_NAME = "README.md"
# The files a checkpoint repository consists of, by name (top level, and inside a diffusers component folder
# such as unet/ or scheduler/): card, configs, weights and their index, tokenizer / processor / scheduler
# files, and the training records deqzoo's cards report. A JSON file is not a config because of its suffix:
# credentials.json or secret_token.json stays local.
CHECKPOINT_FILES = (
    CARD_NAME, "config.json", "generation_config.json", "model_index.json", "*.safetensors",
    "*.safetensors.index*.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "scheduler_config.json",
    "train_log.json", "trainer_state.json", "*_results.json", "measurements.json", "bench_*.json")
# Files the card links by name are part of the repository too (its figures, a results table).
_CARD_LINKED_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".json")


def _allowed(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_FILES)


def _component_dirs(directory: Path, card_text: str) -> set[str]:
    """Subfolders that belong to the repository: a diffusers repository's components (named in
    model_index.json) and folders the card points at as ``name/`` (e.g. an evaluator checkpoint)."""
    index = directory / "model_index.json"
    data = read_json(index) if index.is_file() else {}
    names = {k for k, v in data.items() if not k.startswith("_") and isinstance(v, list)}
    names |= {sub.name for sub in directory.iterdir() if sub.is_dir() and f"{sub.name}/" in card_text}
    return {n for n in names if (directory / n).is_dir() and not n.startswith(".")}


def checkpoint_upload_files(directory: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(files to upload, files left out) of a checkpoint folder, sorted relative paths: the files
    `CHECKPOINT_FILES` names, at the top level and in component folders (``model_index.json``'s, or named
    by the card as ``name/``), and the figures and JSON files the card names; nothing else.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("config.json", "model.safetensors", "optimizer.pt", "credentials.json"):
        ...     _ = (d / name).write_text("x")
        >>> checkpoint_upload_files(d)
        (['config.json', 'model.safetensors'], ['credentials.json', 'optimizer.pt'])
    """
    directory = Path(directory)
    card = directory / CARD_NAME
    card_text = card.read_text(errors="replace") if card.is_file() else ""
    components = _component_dirs(directory, card_text)
    root = directory.resolve()
    upload, stray = [], []
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(directory)
        parts = rel.parts
        hidden = any(p.startswith(".") or p == "__pycache__" for p in parts)
        if hidden or not path.resolve().is_relative_to(root):  # a link never exports a file from outside
            keep = False
        elif len(parts) == 1:
            linked = rel.suffix.lower() in _CARD_LINKED_SUFFIXES and rel.name in card_text
            keep = _allowed(rel.name) or linked
        else:
            keep = len(parts) == 2 and parts[0] in components and _allowed(rel.name)
        (upload if keep else stray).append(rel.as_posix())
    return upload, stray


def _tagged_card(directory: Path, tags: list[str], api, repo_id: str, revision: str | None) -> bytes:
    """The card to upload with `tags` added: the folder's (not modified), the repository's, or a new one."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    local = directory / CARD_NAME
    if local.is_file():
        card = ModelCard(local.read_text())
    else:
        try:
            remote = api.hf_hub_download(repo_id, CARD_NAME, revision=revision)
            card = ModelCard(Path(remote).read_text())
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            card = ModelCard.from_template(ModelCardData(library_name="deqzoo", tags=[]),
                                           model_description="A deqzoo deep equilibrium model.")
    if card.data.tags is None:
        card.data.tags = []
    for tag in tags:
        if tag not in card.data.tags:
            card.data.tags.append(tag)
    return str(card).encode()


def push_folder(directory: str | os.PathLike, *, repo_id: str, commit_message: str | None = None,
                commit_description: str | None = None, private: bool | None = None,
                token: str | bool | None = None, revision: str | None = None, create_pr: bool = False,
                tags: list[str] | None = None, endpoint: str | None = None) -> str:
    """Create `repo_id` (if needed) and upload the files :func:`checkpoint_upload_files` selects in one commit
    (the others named in a warning; pickle weights refused before any request). Returns huggingface_hub's
    ``CommitInfo`` (the commit URL; ``.pr_url`` with ``create_pr=True``). ``revision``: the branch (created
    if missing; ``refs/pr/N``: an open pull request); ``tags`` go into the uploaded card's metadata;
    ``endpoint`` defaults to $HF_ENDPOINT, then huggingface_hub's.

    Example:
        >>> push_folder("model_cards/mdeq-tiny-mnist", repo_id="me/mdeq-tiny-mnist",  # doctest: +SKIP
        ...             revision="v2", create_pr=True, commit_message="Retrained", tags=["mnist"])
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a checkpoint directory (no such folder)")
    if not (directory / "config.json").is_file() and not (directory / "model_index.json").is_file():
        raise FileNotFoundError(f"{directory}: not a checkpoint directory (no config.json)")
    if (directory / "config.json").is_file():
        weight_files(directory)  # refuses pickle-only folders
    if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags)):
        raise ValueError(f"tags must be a list of non-empty strings, got {tags!r}")
    files, left_out = checkpoint_upload_files(directory)
    if left_out:
        logger.warning("%s: not uploading %d file(s) a checkpoint does not consist of: %s", directory,
                       len(left_out), ", ".join(left_out))
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        # one create_commit, not upload_folder: huggingface_hub's upload_folder (with hf_xet) commits a folder
        # in batches, so a reader could see half a checkpoint, and it opens pull requests against main only
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(directory / name))
                      for name in files if not (tags and name == CARD_NAME)]
        if tags:
            operations.append(CommitOperationAdd(path_in_repo=CARD_NAME,
                                                 path_or_fileobj=_tagged_card(directory, list(tags), api,
                                                                              repo_id, revision)))
        info = api.create_commit(repo_id, operations, commit_message=commit_message or "Upload deqzoo model",
                                 commit_description=commit_description, revision=revision,
                                 create_pr=create_pr, repo_type="model")
    except Exception as err:
        if not is_network_error(err):
            raise
        where = endpoint or "the Hugging Face Hub"
        raise ConnectionError(f"push of {directory} to {repo_id} at {where} failed "
                              f"({type(err).__name__}: {err})") from err
    return info
