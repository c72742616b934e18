"""A hypersolver as a hub artifact on huggingface_hub's `PyTorchModelHubMixin`: ``config.json`` +
``model.safetensors`` (+ ``README.md``), with deqzoo's guarantees: atomic saves that keep other files;
safetensors-only loads confined to the folder, with size limits; the config validated first; the weights'
sha256 against the one the config records; names and shapes against the config; and, when attached, the
model's fingerprint against the one it was trained for (errors name both sides).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from ..errors import CheckpointError, DeqzooError
from ..hub.catalog import sha256_file
from ..hub.loading import load_weights_file, resolve
from ..hub.saving import atomic_save
from ..hub.validation import confined, read_json
from .configuration import HyperSolverConfig, HyperSolverConfigError

__all__ = ["HyperSolverError", "check_compatible", "read_hypersolver", "model_fingerprint",
           "save_hypersolver"]

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 64 << 20


class HyperSolverError(DeqzooError, ValueError):
    """A hypersolver cannot be loaded or does not fit the model (the message names both sides)."""


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over the model type and every tensor of its state dict (name, shape, values): a hypersolver
    trained for one set of weights is refused by a retrained model of the same architecture.

    Example:
        >>> import deqzoo
        >>> a = deqzoo.create_model("mdeq-tiny-mnist"); len(model_fingerprint(a))
        64
    """
    digest = hashlib.sha256()
    digest.update(str(getattr(getattr(model, "config", None), "model_type", type(model).__name__)).encode())
    for name, t in sorted(model.state_dict().items()):
        # values as float64 / int64: exact for float32 weights, so casting the model to float64 (or moving
        # it to another device) keeps its fingerprint; other weights (retrained, quantized) change it
        t = t.detach().to("cpu", torch.float64 if t.is_floating_point() else torch.int64).contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def check_compatible(model: nn.Module, hypersolver: nn.Module) -> None:
    """Raise `HyperSolverError` unless `hypersolver` was trained for this model's weights."""
    want = hypersolver.config.model_fingerprint
    have = model_fingerprint(model)
    if want != have:
        name = getattr(model, "name_or_path", "") or type(model).__name__
        raise HyperSolverError(
            f"hypersolver trained for {hypersolver.config.model_id or '?'} (fingerprint {want[:16] or 'none'}"
            f"...) does not fit model {name} (fingerprint {have[:16]}...): it was trained against other "
            "weights; train one for this model with `deqzoo train-hypersolver`, or pass check=False to "
            "set_hypersolver at your own risk")


def save_hypersolver(hypersolver: PyTorchModelHubMixin, directory: str | os.PathLike, **kwargs) -> Path:
    """huggingface_hub's ``save_pretrained`` (the weights' sha256 in config.json; ``push_to_hub=True``),
    atomic and keeping other files; a folder holding another kind of checkpoint is refused."""
    directory = Path(directory)
    existing = directory / CONFIG_NAME
    if existing.is_file():
        try:
            kind = read_json(existing, max_bytes=MAX_CONFIG_BYTES).get("model_type")
        except CheckpointError:
            kind = None
        if kind != "hypersolver":
            raise HyperSolverError(f"{existing}: the directory holds a checkpoint that is not a hypersolver "
                                   f"(model_type {kind!r}); saving would replace its config.json and "
                                   "model.safetensors. Choose another --out")

    kwargs.pop("config", None)  # the mixin's push passes its copy; the file is always the hypersolver's own

    def write(tmp: Path) -> None:
        PyTorchModelHubMixin.save_pretrained(hypersolver, tmp, config=hypersolver.config, **kwargs)
        if (directory / "README.md").exists():
            (tmp / "README.md").unlink()  # the mixin writes a card only where there is none: keep the user's

    return atomic_save(directory, write)


def read_hypersolver(cls: type[nn.Module], name_or_path: str | os.PathLike, **hub_kwargs) -> nn.Module:
    """Load and verify a hypersolver of class `cls` (``HyperSolver.from_pretrained``; module docstring): a
    directory, an embedded id or a Hub repository (`deqzoo.hub.resolve`)."""
    try:
        folder = resolve(name_or_path, **hub_kwargs)
        cfg_path, w_path = (confined(folder, name, folder) for name in (CONFIG_NAME, WEIGHTS_NAME))
        if not w_path.is_file() or w_path.stat().st_size > MAX_WEIGHTS_BYTES:
            raise HyperSolverError(f"{w_path}: missing or larger than a hypersolver can be "
                                   f"({MAX_WEIGHTS_BYTES} bytes); a hypersolver directory holds "
                                   f"{CONFIG_NAME} and {WEIGHTS_NAME}")
        config = HyperSolverConfig.from_dict(read_json(cfg_path, max_bytes=MAX_CONFIG_BYTES), str(cfg_path))
        want, have = config.training.get("weights_sha256"), sha256_file(w_path)
        if want is not None and want != have:
            raise HyperSolverError(f"{w_path}: sha256 {have} does not match the {want} recorded in "
                                   f"{cfg_path} (hypersolver for {config.model_id or '?'}): the file is "
                                   "corrupted or replaced")
        return load_weights_file(cls(config), w_path).eval()
    except (CheckpointError, HyperSolverConfigError) as err:
        raise HyperSolverError(f"hypersolver {str(name_or_path)!r}: {err}") from None
