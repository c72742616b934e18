"""deqzoo's engine: solvers, backward modes, norms, regularizers, statistics. Knows nothing about models."""

from .backward import BACKWARD_MODES, register_backward
from .config import DEQConfig
from .deq import DEQ, DEQConvergenceError
from .solvers import SOLVERS, get_solver, register_solver, solve
from .state import StatePacker
from .stats import SolverStats

__all__ = [
    "BACKWARD_MODES", "DEQ", "DEQConfig", "DEQConvergenceError", "SOLVERS", "SolverStats", "StatePacker",
    "get_solver", "register_backward", "register_solver", "solve",
]
