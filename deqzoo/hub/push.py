"""Upload a checkpoint directory to the Hub (or any endpoint speaking its API) through huggingface_hub."""

from __future__ import annotations

import os
from pathlib import Path

from .safetensors_io import weight_files
from .validation import is_network_error


def push_folder(
    directory: str | os.PathLike,
    *,
    repo_id: str,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload deqzoo checkpoint",
    endpoint: str | None = None,
) -> str:
    """Create `repo_id` (if needed) and upload `directory` in one commit; returns the commit URL.

    Only safetensors weights are accepted (a folder with pickle weights is refused before any upload).
    `endpoint` defaults to $HF_ENDPOINT read at call time, then huggingface_hub's default.

    Example:
        >>> push_folder("model_cards/mdeq-tiny-mnist", repo_id="me/mdeq-tiny-mnist")  # doctest: +SKIP
    """
    from huggingface_hub import HfApi

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: not a checkpoint directory (no config.json)")
    weight_files(directory)  # refuses pickle-only folders
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(directory), commit_message=commit_message,
                                 ignore_patterns=[".*", "**/.*", "__pycache__/*"], repo_type="model")
    except Exception as err:
        if not is_network_error(err):
            raise
        where = endpoint or "the Hugging Face Hub"
        raise ConnectionError(f"push of {directory} to {repo_id} at {where} failed "
                              f"({type(err).__name__}: {err})") from err
    return str(getattr(info, "commit_url", info))
