"""HyperSolverConfig: what a hypersolver is (state kind, sizes, memory m, unroll K), which model it serves."""

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from ..configuration_utils import ConfigError, ranged, strict_config

MAX_CHANNELS = 65536  # no state or injection is wider; a larger value in a config.json is an error
MAX_HIDDEN = 4096
USES = ("initializer", "hyperanderson")


class HyperSolverConfigError(ConfigError):
    """A hypersolver config value has the wrong type or is out of range (the message names the key)."""


@strict_config
@dataclass
class HyperSolverConfig:
    """Configuration of a HyperDEQ hypersolver (initializer h_φ + HyperAnderson network s_ξ).

    ``state_kind``: "multires" (MDEQ's maps), "sequence" (DEQ-Transformer's (L, d)) or "vector" (no
    initializer); ``injection_channels``: the input injection h_φ reads (0: none); ``m``: memory (m + 1
    iterates); ``unroll_steps``: K, the steps trained through; ``form``: "anderson" (Σ α_i (z_i + β g_i)) or
    "simplified" (β Σ g_i + Σ α_i z_i); ``alpha_base``: "none" (α̂ from the network, the paper) or "anderson"
    (Anderson's α + the network's correction, `deqzoo.core.hyper`); ``model_id``, ``model_fingerprint``: the
    model it serves; ``training``: free-form record; ``use``: "hyperanderson" (default) or "initializer"
    (h_φ's start, then the model's own solver: the part that pays in wall time where the mixing does not).

    Example:
        >>> cfg = HyperSolverConfig(state_kind="vector", state_channels=[8], pool=4)
        >>> HyperSolverConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    error_class = HyperSolverConfigError

    state_kind: Literal["multires", "sequence", "vector"] = "vector"
    state_channels: list[int] | tuple[int, ...] = ranged(1, MAX_CHANNELS, default_factory=lambda: [1])
    injection_channels: int = ranged(0, MAX_CHANNELS, default=0)
    init_hidden: int = ranged(1, MAX_HIDDEN, default=8)
    pool: int = ranged(1, 16, default=1)
    mix_hidden: int = ranged(1, MAX_HIDDEN, default=8)
    m: int = ranged(0, 64, default=5)
    unroll_steps: int = ranged(1, 1000, default=8)
    form: Literal["anderson", "simplified"] = "anderson"
    alpha_base: Literal["none", "anderson"] = "none"
    use: Literal["initializer", "hyperanderson"] = "hyperanderson"
    model_id: str = ""
    model_fingerprint: str = ""
    model_type: str = "hypersolver"
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state_channels = list(self.state_channels)

    def validate_kind(self) -> None:
        """A hypersolver's own config (not a model's), with one to 16 state tensors."""
        if self.model_type != "hypersolver":
            raise HyperSolverConfigError(f"key 'model_type' must be 'hypersolver', got {self.model_type!r} "
                                         "(is this a model checkpoint, not a hypersolver?)")
        if not 1 <= len(self.state_channels) <= 16:
            raise HyperSolverConfigError(f"key 'state_channels' must be a list of 1 to 16 integers, got "
                                         f"{self.state_channels!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "HyperSolverConfig":
        if not isinstance(data, dict):
            raise HyperSolverConfigError(f"{source}: a hypersolver config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HyperSolverConfigError(f"{source}: unknown hypersolver config key(s) {unknown}; known: "
                                         f"{sorted(known)}")
        try:
            return cls(**data)
        except HyperSolverConfigError as err:
            raise HyperSolverConfigError(f"{source}: {err}") from None
