"""HyperDEQ: learned equilibrium solvers (Bai, Koltun & Kolter, ICLR 2022) trained on frozen zoo models.

A hypersolver is a small artifact published next to the checkpoint it accelerates: an initializer h_φ over the
model's input injection and a HyperAnderson network s_ξ (`deqzoo.core.hyper` holds the update itself). Its
config's ``use`` says which part attaching it runs: "initializer" (h_φ, then the model's own solver) or
"hyperanderson" (h_φ and the learned mixing).

Example:
    >>> import deqzoo  # doctest: +SKIP
    >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist",  # doctest: +SKIP
    ...                                hypersolver="deqzoo/hyperdeq-mdeq-tiny-mnist")
    >>> model.remove_hypersolver()  # doctest: +SKIP
"""

from .attach import HyperDEQ, attached_hypersolver, remove_hypersolver, set_hypersolver
from .configuration import HyperSolverConfig, HyperSolverConfigError
from .io import HyperSolverError, check_compatible, model_fingerprint, save_hypersolver
from .modeling import HyperSolver, load_hypersolver

__all__ = ["HyperDEQ", "HyperSolver", "HyperSolverConfig", "HyperSolverConfigError", "HyperSolverError",
           "attached_hypersolver", "check_compatible", "load_hypersolver", "model_fingerprint",
           "remove_hypersolver", "save_hypersolver", "set_hypersolver"]
