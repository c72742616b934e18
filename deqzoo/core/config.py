"""DEQConfig: every knob of a DEQ layer, validated on construction and JSON round-trippable."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

_ON_NONCONVERGENCE = ("ignore", "warn", "raise")
_STOP_MODES = ("abs", "rel")


@dataclass
class DEQConfig:
    """Configuration of a DEQ layer (forward solver, backward mode, regularization).

    Forward: ``f_solver`` (a registered solver), ``f_max_iter``, ``f_tol``, ``f_stop_mode`` ("rel" or "abs"),
    ``f_solver_kwargs`` (e.g. ``{"m": 6, "tau": 1.0}`` for anderson, ``{"m": 20}`` for limited-memory
    broyden).
    ``f_max_iter_min`` > 0 randomizes the iteration budget in training: each forward with autograd enabled
    draws f_max_iter uniformly from [f_max_iter_min, f_max_iter] (torch's RNG, so seeding applies).
    ``f_final_step`` returns f(z) from the solver's best z where that point's residual, measured with one more
    evaluation of f, is lower (`deqzoo.core.solvers.final_step`; the statistics describe the returned point).
    ``f_compact`` (default True): when f is marked `deqzoo.core.halting.rowwise`, call it on the samples
    still iterating only (False: on the whole batch every step, the stopped samples at their answer).

    Backward: ``b_mode`` ("ift", "phantom", "jacobian_free", "shine", "unrolled", "reversible" or a
    registered mode; "reversible" replaces the solve by f_max_iter coupled steps, see deqzoo.core.reversible),
    ``b_mode_kwargs`` (see deqzoo.core.backward), and for the adjoint solve ``b_solver``, ``b_max_iter``,
    ``b_tol``, ``b_stop_mode``, ``b_solver_kwargs``.

    Fixed-point correction: ``n_states`` > 0 returns n states at evenly spaced iterations
    (round(f_max_iter·i/n) for i = 1..n), or ``state_indices`` lists the iterations explicitly; they appear in
    ``stats.states`` (first to last; an iteration >= f_max_iter is the output itself). Each earlier state is
    the solver's best iterate at that iteration followed by ``correction_k`` damped phantom steps
    (``correction_tau``) with gradient; combine them with `deqzoo.core.fp_correction`.

    Regularization: ``jac_reg_samples`` > 0 puts a Hutchinson estimate of ||J_f||_F²/dim at z* (with graph)
    into ``stats.jac_loss`` when autograd is enabled.

    ``on_nonconvergence``: "ignore", "warn" or "raise" (`DEQConvergenceError`, carrying the stats) when the
    forward solve ends above f_tol.

    Example:
        >>> from deqzoo.core import DEQConfig
        >>> cfg = DEQConfig(f_solver="anderson", f_max_iter=30, b_mode="phantom", b_mode_kwargs={"k": 5})
        >>> DEQConfig.from_json(cfg.to_json()) == cfg
        True
    """

    # forward solve
    f_solver: str = "anderson"
    f_max_iter: int = 30
    f_tol: float = 1e-4
    f_stop_mode: str = "rel"
    f_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    f_max_iter_min: int = 0
    f_final_step: bool = False
    f_compact: bool = True
    # backward
    b_mode: str = "ift"
    b_solver: str = "anderson"
    b_max_iter: int = 30
    b_tol: float = 1e-6
    b_stop_mode: str = "rel"
    b_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    b_mode_kwargs: dict[str, Any] = field(default_factory=dict)
    # fixed-point correction
    n_states: int = 0
    state_indices: list[int] | None = None
    correction_k: int = 1
    correction_tau: float = 1.0
    # what the caller sees when the forward solve does not reach f_tol
    on_nonconvergence: str = "ignore"
    # regularization: Hutchinson samples for stats.jac_loss (0 = off; only computed when grad is enabled)
    jac_reg_samples: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.f_final_step, bool):
            raise TypeError(f"DEQConfig.f_final_step must be a bool, got {self.f_final_step!r}")
        if not isinstance(self.f_compact, bool):
            raise TypeError(f"DEQConfig.f_compact must be a bool, got {self.f_compact!r}")
        from .backward import BACKWARD_MODES, MODE_KWARGS
        from .solvers import SOLVERS, solver_kwarg_names
        from .solvers._contract import _check_tau

        _check_name("f_solver", self.f_solver, SOLVERS)
        _check_name("b_solver", self.b_solver, SOLVERS)
        _check_name("b_mode", self.b_mode, BACKWARD_MODES)
        _check_name("on_nonconvergence", self.on_nonconvergence, _ON_NONCONVERGENCE)
        _check_name("f_stop_mode", self.f_stop_mode, _STOP_MODES)
        _check_name("b_stop_mode", self.b_stop_mode, _STOP_MODES)
        for name in ("f_max_iter", "b_max_iter", "correction_k"):
            _check_int(name, getattr(self, name), 1)
        for name in ("jac_reg_samples", "n_states", "f_max_iter_min"):
            _check_int(name, getattr(self, name), 0)
        if self.f_max_iter_min > self.f_max_iter:
            raise ValueError(
                f"DEQConfig.f_max_iter_min={self.f_max_iter_min} exceeds f_max_iter={self.f_max_iter}"
            )
        for name in ("f_tol", "b_tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"DEQConfig.{name} must be a finite number > 0, got {value!r}")
        _check_tau(self.correction_tau, "DEQConfig.correction_tau (damping tau)")
        if self.state_indices is not None:
            self.state_indices = list(self.state_indices)
            for i in self.state_indices:
                _check_int("state_indices entry", i, 1)
            if self.n_states:
                raise ValueError("give DEQConfig.n_states or DEQConfig.state_indices, not both")
        for prefix, solver in (("f", self.f_solver), ("b", self.b_solver)):
            kwargs = getattr(self, f"{prefix}_solver_kwargs")
            accepted = solver_kwarg_names(solver)
            _check_options(f"{prefix}_solver_kwargs", kwargs, f"solver {solver!r}", accepted)
            if "tau" in kwargs:
                _check_tau(kwargs["tau"], f"DEQConfig.{prefix}_solver_kwargs['tau'] (damping tau)")
        accepted = MODE_KWARGS.get(self.b_mode)
        _check_options("b_mode_kwargs", self.b_mode_kwargs, f"b_mode {self.b_mode!r}", accepted)
        if "tau" in self.b_mode_kwargs:
            _check_tau(self.b_mode_kwargs["tau"], "DEQConfig.b_mode_kwargs['tau'] (damping tau)")
        if "k" in self.b_mode_kwargs:
            _check_int("b_mode_kwargs['k']", self.b_mode_kwargs["k"], 1)
        if self.b_mode_kwargs.get("variant", "upg") not in ("upg", "npg"):
            raise ValueError(
                f"DEQConfig.b_mode_kwargs['variant'] must be 'upg' or 'npg', "
                f"got {self.b_mode_kwargs['variant']!r}"
            )
        if self.b_mode == "reversible":  # RevDEQ's coupling (deqzoo.core.reversible)
            from .reversible import DEFAULT_BETA, check_beta

            check_beta(self.b_mode_kwargs.get("beta", DEFAULT_BETA))
        if self.b_mode == "shine" and self.f_solver != "broyden":
            raise ValueError(
                f"b_mode='shine' reuses the forward Broyden inverse estimate, so it needs "
                f"f_solver='broyden', got {self.f_solver!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DEQConfig:
        data = dict(data or {})
        _check_known(data)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> DEQConfig:
        return cls.from_dict(json.loads(text))

    def update(self, **changes: Any) -> DEQConfig:
        """A validated copy with `changes` applied."""
        _check_known(changes)
        return replace(self, **changes)

    def state_steps(self, max_iter: int | None = None) -> list[int]:
        """Iterations at which fixed-point correction takes states (empty when off)."""
        max_iter = max_iter or self.f_max_iter
        if self.state_indices:
            return sorted(set(self.state_indices))
        if self.n_states:
            return sorted({max(1, round(max_iter * (i + 1) / self.n_states)) for i in range(self.n_states)})
        return []


def _check_name(field_name: str, value: str, known) -> None:
    if value not in known:
        raise ValueError(f"DEQConfig.{field_name}={value!r} is not registered; choose one of {sorted(known)}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DEQConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_known(keys) -> None:
    known = {f.name for f in fields(DEQConfig)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"Unknown DEQConfig key(s) {unknown}; known keys: {sorted(known)}")


def _check_options(field_name: str, options: dict, owner: str, accepted: set[str] | None) -> None:
    """The options of a solver or backward mode (`accepted` None: it takes any)."""
    unknown = sorted(set(options) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(f"DEQConfig.{field_name} has option(s) {unknown} that {owner} does not accept; "
                         f"it accepts {sorted(accepted)}")
