"""A hypersolver as a hub artifact: ``config.json`` + ``model.safetensors`` (+ ``README.md``), checked.

Checks, each a clear error: the config is a hypersolver config (validated before anything is built); the
weights file's sha256 matches the one recorded in the config (a corrupted or swapped file names the file and
both digests); the tensor names and shapes match the config; and, when attached, the model's fingerprint
matches the one the hypersolver was trained for (the error names both models).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..errors import DeqzooError
from ..hub.catalog import sha256_file
from .configuration import HyperSolverConfig, HyperSolverConfigError
from .modeling import HyperSolver

__all__ = [
    "HyperSolverError",
    "check_compatible",
    "load_hypersolver",
    "model_fingerprint",
    "resolve_hypersolver",
    "save_hypersolver",
]

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
        >>> a = deqzoo.create_model("mdeq-mnist-tiny"); len(model_fingerprint(a))
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


def _model_name(model: nn.Module) -> str:
    return (
        getattr(model, "name_or_path", "")
        or getattr(getattr(model, "config", None), "_name_or_path", "")
        or type(model).__name__
    )


def check_compatible(model: nn.Module, hypersolver: HyperSolver) -> None:
    """Raise `HyperSolverError` unless `hypersolver` was trained for this model's weights."""
    want = hypersolver.config.model_fingerprint
    have = model_fingerprint(model)
    if want != have:
        raise HyperSolverError(
            f"hypersolver trained for {hypersolver.config.model_id or '?'} "
            f"(fingerprint {want[:16] or 'none'}...) "
            f"does not fit model {_model_name(model)} (fingerprint {have[:16]}...): it was trained against "
            "other weights; train one for this model with `deqzoo train-hypersolver`, or pass check=False to "
            "set_hypersolver at your own risk"
        )


def save_hypersolver(hypersolver: HyperSolver, directory: str | os.PathLike) -> Path:
    """Write config.json (with the weights' sha256) and model.safetensors into `directory`, atomically as a
    pair (`deqzoo.hub.saving.atomic_save`); other files there (a card) are kept. A directory that holds some
    other checkpoint (a config.json that is not a hypersolver's) is refused: its weights would be replaced."""
    from safetensors.torch import save_file

    from ..hub.saving import atomic_save

    directory = Path(directory)
    existing = directory / CONFIG_NAME
    if existing.is_file():
        try:
            kind = json.loads(existing.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind != "hypersolver":
            raise HyperSolverError(
                f"{existing}: the directory holds a checkpoint that is not a hypersolver (model_type "
                f"{kind!r}); saving would replace its config.json and model.safetensors. Choose another --out"
            )

    def write(tmp: Path) -> None:
        weights = tmp / WEIGHTS_NAME
        state = {k: v.detach().contiguous().cpu() for k, v in hypersolver.state_dict().items()}
        save_file(state, str(weights))
        hypersolver.config.training["weights_sha256"] = sha256_file(weights)
        (tmp / CONFIG_NAME).write_text(hypersolver.config.to_json())

    return atomic_save(directory, write)


def resolve_hypersolver(name_or_path: str | os.PathLike) -> Path:
    """A local directory, or an embedded hypersolver id ``deqzoo/hyperdeq-...`` (listed in the catalog: in
    ``model_cards/`` or, installed from a wheel, in the package)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from ..hub.catalog import embedded_folder, load_hypersolver_catalog

    name = str(name_or_path)
    embedded = load_hypersolver_catalog()  # the source tree's model_cards/ or a wheel's packaged copy
    if name in embedded:
        folder = embedded_folder(embedded[name])
        if folder is not None:
            return folder
    known = sorted(embedded)
    raise HyperSolverError(
        f"hypersolver {name!r} is neither a directory nor an embedded hypersolver; embedded: "
        f"{known or 'none'}"
    )


def load_hypersolver(name_or_path: str | os.PathLike) -> HyperSolver:
    """Load and verify a hypersolver (see the module docstring for the checks).

    Example:
        >>> hs = load_hypersolver("deqzoo/hyperdeq-mdeq-tiny-mnist")  # doctest: +SKIP
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = resolve_hypersolver(name_or_path)
    cfg_path, w_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise HyperSolverError(
                f"{p}: missing; a hypersolver directory holds {CONFIG_NAME} and {WEIGHTS_NAME}"
            )
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES or w_path.stat().st_size > MAX_WEIGHTS_BYTES:
        raise HyperSolverError(
            f"{folder}: config.json or model.safetensors is larger than a hypersolver can be "
            f"({MAX_CONFIG_BYTES} / {MAX_WEIGHTS_BYTES} bytes)"
        )
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HyperSolverError(f"{cfg_path}: not valid JSON ({err})") from None
    try:
        config = HyperSolverConfig.from_dict(data, source=str(cfg_path))
    except HyperSolverConfigError as err:
        raise HyperSolverError(str(err)) from None
    want = config.training.get("weights_sha256")
    have = sha256_file(w_path)
    if want is not None and want != have:
        raise HyperSolverError(
            f"{w_path}: sha256 {have} does not match the {want} recorded in {cfg_path} "
            f"(hypersolver for {config.model_id or '?'}): the file is corrupted or replaced"
        )
    try:
        state = load_file(str(w_path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise HyperSolverError(f"{w_path}: not a readable safetensors file ({err})") from None
    model = HyperSolver(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        shapes = [
            f"{k}: file {got[k]} vs config {expected[k]}"
            for k in sorted(set(got) & set(expected))
            if got[k] != expected[k]
        ]
        raise HyperSolverError(
            f"{w_path}: tensors do not match {cfg_path}: missing {missing}, unexpected "
            f"{unexpected}, mis-shaped {shapes}"
        )
    model.load_state_dict(state)
    return model.eval()
