"""DEQConfig: every knob of a DEQ layer, validated on construction and JSON round-trippable."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

_ON_NONCONVERGENCE = ("ignore", "warn", "raise")
_STOP_MODES = ("abs", "rel")


@dataclass
class DEQConfig:
    """Configuration of a DEQ layer (forward solver, backward mode, regularization).

    Example:
        >>> from deqzoo.core import DEQConfig
        >>> cfg = DEQConfig(f_solver="anderson", f_max_iter=30, b_mode="ift")
        >>> DEQConfig.from_json(cfg.to_json()) == cfg
        True
    """

    # forward solve
    f_solver: str = "anderson"
    f_max_iter: int = 30
    f_tol: float = 1e-4
    f_stop_mode: str = "rel"
    f_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    # backward
    b_mode: str = "ift"
    b_solver: str = "anderson"
    b_max_iter: int = 30
    b_tol: float = 1e-6
    b_stop_mode: str = "rel"
    b_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    b_mode_kwargs: dict[str, Any] = field(default_factory=dict)
    # what the caller sees when the forward solve does not reach f_tol
    on_nonconvergence: str = "ignore"

    def __post_init__(self) -> None:
        from .backward import BACKWARD_MODES
        from .solvers import SOLVERS

        _check_name("f_solver", self.f_solver, SOLVERS)
        _check_name("b_solver", self.b_solver, SOLVERS)
        _check_name("b_mode", self.b_mode, BACKWARD_MODES)
        _check_name("on_nonconvergence", self.on_nonconvergence, _ON_NONCONVERGENCE)
        _check_name("f_stop_mode", self.f_stop_mode, _STOP_MODES)
        _check_name("b_stop_mode", self.b_stop_mode, _STOP_MODES)
        for name in ("f_max_iter", "b_max_iter"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DEQConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("f_tol", "b_tol"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DEQConfig.{name} must be > 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DEQConfig:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown DEQConfig key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> DEQConfig:
        return cls.from_dict(json.loads(text))

    def update(self, **changes: Any) -> DEQConfig:
        """A validated copy with `changes` applied."""
        return replace(self, **changes)


def _check_name(field_name: str, value: str, known) -> None:
    if value not in known:
        raise ValueError(f"DEQConfig.{field_name}={value!r} is not registered; choose one of {sorted(known)}")
