"""DEQConfig: every knob of a DEQ layer, validated on construction and JSON round-trippable."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

_ON_NONCONVERGENCE = ("ignore", "warn", "raise")
_STOP_MODES = ("abs", "rel")
F_DTYPES = ("bfloat16", "float16")  # f_dtype: f under torch.autocast in this dtype, the solver state as it is

# Caps, checked when a DEQConfig is made or loaded (a model's config.json included), so that a budget typed
# wrong (1e12, 10**9) is refused at once with the key named instead of running for months or growing until
# memory runs out. Generous: ten times anything a zoo model or a paper uses.
MAX_ITER = 10_000  # f_max_iter, b_max_iter, f_max_iter_min, state_indices entries, unrolled checkpoint
MAX_REVERSIBLE_STEPS = 1_000  # f_max_iter with b_mode="reversible": every step runs (2N + 1 f calls)
MAX_HISTORY = 64  # anderson / hyperanderson m (a (B, m, m) mixing system is solved every step)
MAX_BROYDEN_MEMORY = 1_024  # broyden m (stored update pairs; its full memory keeps at most as many)
MAX_GRAPH_STEPS = 1_000  # steps kept with a graph: phantom k, correction_k, shine refine
MAX_STATES = 1_024  # n_states, len(state_indices), len(keep_steps)
MAX_JAC_SAMPLES = 64  # jac_reg_samples (one vector-Jacobian product each)
# GMRES keeps its whole Krylov basis (up to min(max_iter, MAX_BASIS + 1) states) and a stacked copy of it:
# the bytes it would hold are checked before a solve allocates anything (`check_gmres_memory`)
MAX_GMRES_BYTES = 4 * 2**30


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

    Mixed precision: ``f_dtype`` ("bfloat16" or "float16"; None, the default: off) evaluates f under
    ``torch.autocast`` in that dtype, in the forward solve and in every backward mode, and casts its output
    back to the state's dtype: the solver state, its history and its statistics stay in the state's dtype
    (float32), the backward's vector-Jacobian products run through the same autocast graph.

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
    # mixed precision: f evaluated under autocast in this dtype, the solver state kept in its own (None: off)
    f_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.f_final_step, bool):
            raise TypeError(f"DEQConfig.f_final_step must be a bool, got {self.f_final_step!r}")
        from .backward import BACKWARD_MODES, MODE_KWARGS
        from .solvers import SOLVERS, solver_kwarg_names
        from .solvers._contract import _check_tau

        _check_name("f_solver", self.f_solver, SOLVERS)
        _check_name("b_solver", self.b_solver, SOLVERS)
        _check_name("b_mode", self.b_mode, BACKWARD_MODES)
        _check_name("on_nonconvergence", self.on_nonconvergence, _ON_NONCONVERGENCE)
        _check_name("f_stop_mode", self.f_stop_mode, _STOP_MODES)
        _check_name("b_stop_mode", self.b_stop_mode, _STOP_MODES)
        if self.f_dtype is not None:
            _check_name("f_dtype", self.f_dtype, F_DTYPES)
        if self.b_mode == "reversible":  # no early stop: the budget is what runs
            _check_int("f_max_iter", self.f_max_iter, 1, MAX_REVERSIBLE_STEPS, "with b_mode='reversible'")
        for name in ("f_max_iter", "b_max_iter"):
            _check_int(name, getattr(self, name), 1, MAX_ITER)
        _check_int("correction_k", self.correction_k, 1, MAX_GRAPH_STEPS)
        _check_int("f_max_iter_min", self.f_max_iter_min, 0, MAX_ITER)
        _check_int("n_states", self.n_states, 0, MAX_STATES)
        _check_int("jac_reg_samples", self.jac_reg_samples, 0, MAX_JAC_SAMPLES)
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
            if not isinstance(self.state_indices, (list, tuple)) or len(self.state_indices) > MAX_STATES:
                raise ValueError(f"DEQConfig.state_indices must be a list of at most {MAX_STATES} "
                                 f"iterations, got {_short(self.state_indices)}")
            self.state_indices = list(self.state_indices)
            for i in self.state_indices:
                _check_int("state_indices entry", i, 1, MAX_ITER)
            if self.n_states:
                raise ValueError("give DEQConfig.n_states or DEQConfig.state_indices, not both")
        for prefix, solver in (("f", self.f_solver), ("b", self.b_solver)):
            kwargs = getattr(self, f"{prefix}_solver_kwargs")
            accepted = solver_kwarg_names(solver)
            _check_options(f"{prefix}_solver_kwargs", kwargs, f"solver {solver!r}", accepted)
            if "tau" in kwargs:
                _check_tau(kwargs["tau"], f"DEQConfig.{prefix}_solver_kwargs['tau'] (damping tau)")
            _check_history(f"{prefix}_solver_kwargs", solver, kwargs)
        accepted = MODE_KWARGS.get(self.b_mode)
        _check_options("b_mode_kwargs", self.b_mode_kwargs, f"b_mode {self.b_mode!r}", accepted)
        if "tau" in self.b_mode_kwargs:
            _check_tau(self.b_mode_kwargs["tau"], "DEQConfig.b_mode_kwargs['tau'] (damping tau)")
        if "k" in self.b_mode_kwargs:
            _check_int("b_mode_kwargs['k']", self.b_mode_kwargs["k"], 1, MAX_GRAPH_STEPS)
        if "refine" in self.b_mode_kwargs:
            _check_int("b_mode_kwargs['refine']", self.b_mode_kwargs["refine"], 0, MAX_GRAPH_STEPS)
        if "checkpoint" in self.b_mode_kwargs:
            _check_int("b_mode_kwargs['checkpoint']", self.b_mode_kwargs["checkpoint"], 0, MAX_ITER)
        if self.b_mode_kwargs.get("variant", "upg") not in ("upg", "npg"):
            raise ValueError(
                f"DEQConfig.b_mode_kwargs['variant'] must be 'upg' or 'npg', "
                f"got {self.b_mode_kwargs['variant']!r}"
            )
        if self.b_mode == "reversible":  # RevDEQ's coupling (deqzoo.core.reversible)
            from .reversible import DEFAULT_BETA, check_beta, check_rebuild_tol, check_segment

            check_beta(self.b_mode_kwargs.get("beta", DEFAULT_BETA))
            if self.b_mode_kwargs.get("segment") is not None:
                check_segment(self.b_mode_kwargs["segment"])
            if self.b_mode_kwargs.get("rebuild_tol") is not None:
                check_rebuild_tol(self.b_mode_kwargs["rebuild_tol"])
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(name: str, value, minimum: int, maximum: int | None = None, when: str = "") -> None:
    """An int in [minimum, maximum]; the error names the key, the range (why it is capped) and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:_}]"
        cap = ' (deqzoo.core.config caps budgets and histories; docs/engine.md, "Caps")' if maximum else ""
        raise ValueError(f"DEQConfig.{name} must be an integer {bound}{' ' + when if when else ''}{cap}, "
                         f"got {_short(value)}")


def _check_history(field_name: str, solver: str, kwargs: dict) -> None:
    """Solver history sizes and kept steps within their caps (`m` of anderson / hyperanderson / broyden)."""
    if "m" in kwargs and not (solver == "broyden" and kwargs["m"] is None):  # broyden m=None: full memory
        cap, low = (MAX_BROYDEN_MEMORY, 1) if solver == "broyden" else (MAX_HISTORY, 0 if solver ==
                                                                      "hyperanderson" else 1)
        _check_int(f"{field_name}['m']", kwargs["m"], low, cap, f"for solver {solver!r}")
    if "keep_steps" in kwargs:
        steps = kwargs["keep_steps"]
        if not isinstance(steps, (list, tuple)) or len(steps) > MAX_STATES:
            raise ValueError(f"DEQConfig.{field_name}['keep_steps'] must be a list of at most {MAX_STATES} "
                             f"iterations, got {_short(steps)}")
        for k in steps:
            _check_int(f"{field_name}['keep_steps'] entry", k, 1, MAX_ITER)


def check_gmres_memory(key: str, max_iter: int, x: torch.Tensor) -> None:
    """Refuse a GMRES solve whose Krylov basis could exceed MAX_GMRES_BYTES, before it allocates: the basis
    keeps up to min(max_iter, MAX_BASIS + 1) states of x's size and dtype, and a stacked copy of them.

    Example:
        >>> import torch
        >>> from deqzoo.core.config import check_gmres_memory
        >>> check_gmres_memory("b_max_iter", 30, torch.zeros(8, 1000))   # 2 * 30 * 8 * 1000 * 4 bytes: fine
        >>> try:
        ...     check_gmres_memory("b_max_iter", 1000, torch.zeros(64, 100_000))
        ... except ValueError as err:
        ...     print(str(err)[:64])
        DEQConfig.b_max_iter=1000 with GMRES would keep up to 51,200,000
    """
    gmres_module = importlib.import_module(".solvers.gmres", __package__)
    vectors = min(max_iter, getattr(gmres_module, "MAX_BASIS", max_iter) + 1)
    need = 2 * vectors * x.numel() * x.element_size()
    if need > MAX_GMRES_BYTES:
        raise ValueError(
            f"DEQConfig.{key}={max_iter} with GMRES would keep up to {need:,} bytes ({vectors} Krylov "
            f"vectors of the state, {tuple(x.shape)} {x.dtype}, and a stacked copy), above the limit of "
            f"{MAX_GMRES_BYTES:,} bytes (deqzoo.core.config.MAX_GMRES_BYTES); lower {key} or the batch size")


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
