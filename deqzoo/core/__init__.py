"""deqzoo's engine: solvers, backward modes, norms, regularizers, statistics. Knows nothing about models."""

from .backward import BACKWARD_MODES, backward_in_stages, neumann_backward, register_backward
from .config import DEQConfig
from .deq import DEQ, DeferredState, DEQConvergenceError
from .norm import NORMS, apply_norm, register_norm, remove_norm, reset_norm
from .projection import SpectralProjector, spectral_norm_estimate
from .regularize import (
    VariationalDropout,
    fp_correction,
    jacobian_reg,
    mixed_init,
    reset_dropout,
    residual_penalty,
)
from .reuse import FixedPointCache
from .solvers import SOLVERS, get_solver, register_solver, solve
from .state import StatePacker
from .stats import SolverStats

__all__ = [
    "BACKWARD_MODES",
    "DEQ",
    "DEQConfig",
    "DEQConvergenceError",
    "DeferredState",
    "FixedPointCache",
    "NORMS",
    "SOLVERS",
    "SpectralProjector",
    "SolverStats",
    "StatePacker",
    "VariationalDropout",
    "apply_norm",
    "backward_in_stages",
    "fp_correction",
    "get_solver",
    "jacobian_reg",
    "mixed_init",
    "neumann_backward",
    "register_backward",
    "register_norm",
    "register_solver",
    "remove_norm",
    "reset_dropout",
    "reset_norm",
    "residual_penalty",
    "solve",
    "spectral_norm_estimate",
]
