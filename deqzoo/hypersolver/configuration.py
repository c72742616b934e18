"""HyperSolverConfig: what a hypersolver is (state kind, sizes, memory m, unroll K), which model it serves."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import DeqzooError

STATE_KINDS = ("multires", "sequence", "vector")
MAX_CHANNELS = 65536  # no state or injection is wider; a larger value in a config.json is an error
MAX_HIDDEN = 4096


class HyperSolverConfigError(DeqzooError, ValueError):
    """A hypersolver config value has the wrong type or is out of range (the message names the key)."""


@dataclass
class HyperSolverConfig:
    """Configuration of a HyperDEQ hypersolver (initializer h_φ + HyperAnderson network s_ξ).

    ``state_kind``: "multires" (MDEQ: one image map per resolution), "sequence" (DEQ-Transformer: (L, d)) or
    "vector" (any flat state; no initializer). ``injection_channels``: channels of the model's input
    injection the initializer reads (0: no initializer). ``state_channels``: channels per state tensor.
    ``m``: memory (the window holds m + 1 iterates); ``unroll_steps``: K, the steps trained through;
    ``form``: "anderson" (Σ α_i (z_i + β g_i)) or "simplified" (β Σ g_i + Σ α_i z_i); ``alpha_base``: "none"
    (the paper: α̂ from the network alone) or "anderson" (α̂ = Anderson's least-squares α + the network's
    correction; see `deqzoo.core.hyper`). ``model_id`` and
    ``model_fingerprint`` name the model it was trained for (`deqzoo.hypersolver.model_fingerprint`).
    ``training`` records how it was trained (free-form, shown in the card).

    Example:
        >>> cfg = HyperSolverConfig(state_kind="vector", state_channels=[8], pool=4)
        >>> HyperSolverConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    state_kind: str = "vector"
    state_channels: list[int] = field(default_factory=lambda: [1])
    injection_channels: int = 0
    init_hidden: int = 8
    pool: int = 1
    mix_hidden: int = 8
    m: int = 5
    unroll_steps: int = 8
    form: str = "anderson"
    alpha_base: str = "none"
    model_id: str = ""
    model_fingerprint: str = ""
    model_type: str = "hypersolver"
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def integer(key, low, high):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise HyperSolverConfigError(
                    f"HyperSolverConfig: key {key!r} must be an integer in [{low}, {high}], got {v!r}"
                )

        if self.state_kind not in STATE_KINDS:
            raise HyperSolverConfigError(
                f"HyperSolverConfig: key 'state_kind' must be one of {STATE_KINDS}, got {self.state_kind!r}"
            )
        if self.model_type != "hypersolver":
            raise HyperSolverConfigError(
                f"HyperSolverConfig: key 'model_type' must be 'hypersolver', got "
                f"{self.model_type!r} (is this a model checkpoint, not a hypersolver?)"
            )
        if self.form not in ("anderson", "simplified"):
            raise HyperSolverConfigError(
                f"HyperSolverConfig: key 'form' must be 'anderson' or 'simplified', got {self.form!r}"
            )
        if (
            not isinstance(self.state_channels, (list, tuple))
            or not 1 <= len(self.state_channels) <= 16
            or any(
                isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CHANNELS
                for c in self.state_channels
            )
        ):
            raise HyperSolverConfigError(
                "HyperSolverConfig: key 'state_channels' must be a list of 1 to 16 "
                f"integers in [1, {MAX_CHANNELS}], got {self.state_channels!r}"
            )
        self.state_channels = list(self.state_channels)
        if self.alpha_base not in ("none", "anderson"):
            raise HyperSolverConfigError(
                f"HyperSolverConfig: key 'alpha_base' must be 'none' or 'anderson', got {self.alpha_base!r}"
            )
        integer("injection_channels", 0, MAX_CHANNELS)
        integer("init_hidden", 1, MAX_HIDDEN)
        integer("pool", 1, 16)
        integer("mix_hidden", 1, MAX_HIDDEN)
        integer("m", 0, 64)
        integer("unroll_steps", 1, 1000)
        for key in ("model_id", "model_fingerprint"):
            if not isinstance(getattr(self, key), str):
                raise HyperSolverConfigError(f"HyperSolverConfig: key {key!r} must be a string")
        if not isinstance(self.training, dict):
            raise HyperSolverConfigError("HyperSolverConfig: key 'training' must be a mapping")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> HyperSolverConfig:
        if not isinstance(data, dict):
            raise HyperSolverConfigError(f"{source}: a hypersolver config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HyperSolverConfigError(
                f"{source}: unknown hypersolver config key(s) {unknown}; known: {sorted(known)}"
            )
        try:
            return cls(**data)
        except HyperSolverConfigError as err:
            raise HyperSolverConfigError(f"{source}: {err}") from None
