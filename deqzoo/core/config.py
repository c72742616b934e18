"""DEQConfig: every knob of a DEQ layer, validated on construction and JSON round-trippable.

DEQConfig is a strict dataclass (huggingface_hub's ``@strict``, as transformers v5 and the zoo's model
configs are): every field's type is checked on construction and on every later assignment, and the ranges and
combinations in ``__post_init__`` when it is made (the module keeps real annotations, no postponed ones,
so the type checks run)."""

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassFieldValidationError

from .caps import (
    MAX_BROYDEN_MEMORY,
    MAX_GRAPH_STEPS,
    MAX_HISTORY,
    MAX_ITER,
    MAX_JAC_SAMPLES,
    MAX_REVERSIBLE_STEPS,
    MAX_STATES,
)

_ON_NONCONVERGENCE = ("ignore", "warn", "raise")
_STOP_MODES = ("abs", "rel")
F_DTYPES = ("bfloat16", "float16")  # f_dtype: f under torch.autocast in this dtype, the solver state as it is



_UNSET = object()


def _strict(cls: type) -> type:
    """huggingface_hub's ``@strict`` with its field errors raised as ValueError naming ``DEQConfig.<key>``
    and the value (the engine's one error type for a bad setting; the model configs translate theirs)."""
    cls = strict(cls)
    checked_setattr = cls.__setattr__

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, _UNSET)
        try:
            checked_setattr(self, name, value)
        except StrictDataclassFieldValidationError as err:
            spec = cls.__dataclass_fields__[name]
            kind = spec.metadata.get("expects") or getattr(spec.type, "__name__", None) or str(spec.type)
            raise ValueError(f"DEQConfig.{name} must be {kind}, got {_short(value)} ({type(value).__name__})"
                             ) from err
        # an assignment after construction is checked as construction is (ranges, caps, combinations); a
        # refused value is not kept
        if self.__dict__.get("_built") and not self.__dict__.get("_checking"):
            object.__setattr__(self, "_checking", True)
            try:
                self.__post_init__()
            except Exception:
                object.__setattr__(self, name, old)
                raise
            finally:
                object.__setattr__(self, "_checking", False)

    cls.__setattr__ = __setattr__
    return cls


@_strict
@dataclass
class DEQConfig:
    """Configuration of a DEQ layer (forward solver, backward mode, regularization).

    Forward: ``f_solver`` (a registered solver), ``f_max_iter``, ``f_tol``, ``f_stop_mode`` ("rel" or "abs"),
    ``f_solver_kwargs`` (e.g. ``{"m": 6, "tau": 1.0}`` for anderson, ``{"m": 20}`` for limited-memory
    broyden).
    ``f_max_iter_min`` > 0 randomizes the iteration budget in training: each forward with autograd enabled
    draws f_max_iter uniformly from [f_max_iter_min, f_max_iter] (torch's RNG, so seeding applies).
    ``f_final_step`` returns f(z) from the solver's best z where that point's residual, measured with one more
    evaluation of f, is lower (`deqzoo.core.solvers.final_step`; the statistics describe the returned point);
    An int ``f_final_step`` = n >= 1 returns fⁿ(z) for every sample, better or not: 1 as TorchDEQ and
    DEQ-Flow v2.0 return, 2 as ImpSq (their converters write it). ``f_final_step="stored"`` returns f of the
    solver's best z as the solver already computed it (no further call; fixed_point and anderson): TorchDEQ's
    return rule, one f step past the stopping iterate for free; the statistics keep the iterate's residual.
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
    f_tol: float | int = field(default=1e-4, metadata={"expects": "a finite number > 0"})
    f_stop_mode: str = "rel"
    f_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    f_max_iter_min: int = 0
    f_final_step: bool | int | str = False  # or n >= 1: fⁿ of the answer (issue 58); or "stored" (#55)
    f_compact: bool = True
    # backward
    b_mode: str = "ift"
    b_solver: str = "anderson"
    b_max_iter: int = 30
    b_tol: float | int = field(default=1e-6, metadata={"expects": "a finite number > 0"})
    b_stop_mode: str = "rel"
    b_solver_kwargs: dict[str, Any] = field(default_factory=dict)
    b_mode_kwargs: dict[str, Any] = field(default_factory=dict)
    # fixed-point correction
    n_states: int = 0
    state_indices: list[int] | tuple[int, ...] | None = None
    correction_k: int = 1
    correction_tau: float | int = 1.0
    # what the caller sees when the forward solve does not reach f_tol
    on_nonconvergence: str = "ignore"
    # regularization: Hutchinson samples for stats.jac_loss (0 = off; only computed when grad is enabled)
    jac_reg_samples: int = 0
    # mixed precision: f evaluated under autocast in this dtype, the solver state kept in its own (None: off)
    f_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.f_final_step != "stored" and not isinstance(self.f_final_step, bool):  # "stored": below
            _check_int("f_final_step", self.f_final_step, 1, MAX_GRAPH_STEPS,
                       "(a bool, a number of steps or 'stored')")
        if not isinstance(self.f_compact, bool):
            raise TypeError(f"DEQConfig.f_compact must be a bool, got {self.f_compact!r}")
        from .backward import BACKWARD_MODES, MODE_KWARGS
        from .solvers import SOLVERS, solver_kwarg_names
        from .solvers._contract import _check_tau

        _check_name("f_solver", self.f_solver, SOLVERS)
        _check_name("b_solver", self.b_solver, SOLVERS)
        if self.f_final_step == "stored":
            from .solvers import check_final

            check_final("stored", self.f_solver, "DEQConfig.f_final_step")
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

        object.__setattr__(self, "_built", True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "DEQConfig":
        data = dict(data or {})
        _check_known(data)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "DEQConfig":
        return cls.from_dict(json.loads(text))

    def update(self, **changes: Any) -> "DEQConfig":
        """A validated copy with `changes` applied (`merge_settings`: switching b_mode, f_solver or b_solver
        without giving its options drops the previous owner's options).

        Example:
            >>> cfg = DEQConfig(b_mode="phantom", b_mode_kwargs={"k": 2, "variant": "npg"})
            >>> cfg.update(b_mode="reversible").b_mode_kwargs
            {}
        """
        _check_known(changes)
        return replace(self, **merge_settings(asdict(self), changes, only_changes=True))

    def state_steps(self, max_iter: int | None = None) -> list[int]:
        """Iterations at which fixed-point correction takes states (empty when off)."""
        max_iter = max_iter or self.f_max_iter
        if self.state_indices:
            return sorted(set(self.state_indices))
        if self.n_states:
            return sorted({max(1, round(max_iter * (i + 1) / self.n_states)) for i in range(self.n_states)})
        return []


# (owner field, its options field): options are meaningful for the owner they were written for only
_OPTION_OWNERS = (
    ("b_mode", "b_mode_kwargs"), ("f_solver", "f_solver_kwargs"), ("b_solver", "b_solver_kwargs"))


def merge_settings(base: dict[str, Any], changes: dict[str, Any], *,
                   only_changes: bool = False) -> dict[str, Any]:
    """`base` settings (a DEQConfig dict, possibly partial) overridden by `changes`, where a change of
    ``b_mode``, ``f_solver`` or ``b_solver`` that does not give that owner's options drops the options of
    the previous owner: a model's own phantom ``k``/``tau`` do not follow a user's
    ``b_mode="reversible"``, nor Anderson's ``tau`` a switch to Broyden (issue 58: switching DEQ-Flow or
    Implicit² to reversible mode failed on options the user never set). ``only_changes``: return the
    changes plus the dropped options only (for `dataclasses.replace`).

    Example:
        >>> merge_settings({"b_mode": "phantom", "b_mode_kwargs": {"k": 2}}, {"b_mode": "reversible"})
        {'b_mode': 'reversible', 'b_mode_kwargs': {}}
        >>> merge_settings({"b_mode": "phantom", "b_mode_kwargs": {"k": 2}}, {"b_mode": "phantom"})
        {'b_mode': 'phantom', 'b_mode_kwargs': {'k': 2}}
    """
    out = dict(changes)
    for owner, options in _OPTION_OWNERS:
        previous = base.get(owner, DEQConfig.__dataclass_fields__[owner].default)  # a partial base: defaults
        switched = owner in changes and changes[owner] != previous
        if switched and options not in changes and base.get(options):
            out[options] = {}
    return out if only_changes else {**base, **out}


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
        bound = f">= {minimum}" if maximum is None else f">= {minimum} and <= {maximum:_}"
        cap = ' (deqzoo.core.caps: docs/engine.md, "Caps")' if maximum else ""
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
