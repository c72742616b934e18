"""Upload a checkpoint directory to the Hub (or any endpoint speaking its API) through huggingface_hub.

The options are those of transformers' ``PreTrainedModel.push_to_hub`` (commit message and description,
revision, create_pr, private, tags, token), each passed to huggingface_hub; only the files a checkpoint needs
are uploaded (see :func:`checkpoint_upload_files`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .safetensors_io import weight_files
from .validation import is_network_error, read_json

# Top-level files a checkpoint repository consists of: configs (config.json, generation/preprocessor/
# tokenizer/scheduler configs, model_index.json, safetensors indexes), weights, tokenizer vocabularies, card.
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken")
# Text files are uploaded by name only: the vocabularies transformers' tokenizers write (vocab.txt for
# WordPiece, merges.txt for BPE). Any other *.txt (secrets.txt, wandb-key.txt, notes) stays local.
_TOKENIZER_TEXT_FILES = ("vocab.txt", "merges.txt")
_CARD_ASSET_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
CARD_NAME = "README.md"


def _component_dirs(directory: Path, card_text: str) -> set[str]:
    """Subfolders that belong to the repository: a diffusers repository's components (named in
    model_index.json) and folders the card points at as ``name/`` (e.g. an evaluator checkpoint)."""
    index = directory / "model_index.json"
    data = read_json(index) if index.is_file() else {}
    names = {k for k, v in data.items() if not k.startswith("_") and isinstance(v, list)}
    names |= {sub.name for sub in directory.iterdir() if sub.is_dir() and f"{sub.name}/" in card_text}
    return {n for n in names if (directory / n).is_dir() and not n.startswith(".")}


def checkpoint_upload_files(directory: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(files to upload, stray files left out) of a checkpoint folder, as sorted POSIX relative paths.

    Uploaded: top-level configs, weights and tokenizer files (``*.json``, ``*.safetensors``, ``vocab.txt``,
    ``merges.txt``, ``*.model``, ``*.tiktoken``), ``README.md`` and the images it references; the same kinds
    of file inside subfolders that are repository components (named in ``model_index.json`` or referenced by
    the card as ``name/``). Everything else (optimizer state, pickles, logs, hidden files, scratch folders)
    stays local.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("config.json", "model.safetensors", "optimizer.pt", "notes.log"):
        ...     _ = (d / name).write_text("x")
        >>> checkpoint_upload_files(d)
        (['config.json', 'model.safetensors'], ['notes.log', 'optimizer.pt'])
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
            keep = (rel.name in (CARD_NAME, *_TOKENIZER_TEXT_FILES) or rel.suffix in _CHECKPOINT_SUFFIXES
                    or (rel.suffix.lower() in _CARD_ASSET_SUFFIXES and rel.name in card_text))
        else:
            keep = len(parts) == 2 and parts[0] in components and (
                rel.suffix in _CHECKPOINT_SUFFIXES or rel.name in _TOKENIZER_TEXT_FILES)
        (upload if keep else stray).append(rel.as_posix())
    return upload, stray


def _tagged_card(directory: Path, tags: list[str], api, repo_id: str, revision: str | None) -> bytes:
    """The card to upload with `tags` added to its metadata: the folder's README.md (the file itself is not
    modified), else the repository's current card, else a new one (as transformers does)."""
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


def push_folder(
    directory: str | os.PathLike,
    *,
    repo_id: str,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    tags: list[str] | None = None,
    endpoint: str | None = None,
) -> str:
    """Create `repo_id` (if needed) and upload a checkpoint folder in one commit; returns the commit URL.

    The returned value is huggingface_hub's ``CommitInfo`` (a ``str``: the commit URL; ``.pr_url`` is set
    with ``create_pr=True``). ``revision`` names the branch to commit to (created from main if it does not
    exist; ``refs/pr/N`` commits to an open pull request); ``create_pr=True`` opens a pull request against it
    instead of committing; ``tags`` are added to the card's metadata in the uploaded README.md; ``private``
    applies when the repository is created. Only the files :func:`checkpoint_upload_files` selects are
    uploaded, and a folder whose weights are pickles is refused before any request.
    `endpoint` defaults to $HF_ENDPOINT read at call time, then huggingface_hub's default.

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
    files, _ = checkpoint_upload_files(directory)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        if revision is not None and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
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
