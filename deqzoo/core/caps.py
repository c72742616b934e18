"""Caps on the engine's iteration budgets and history sizes (checked by DEQConfig) and on GMRES's basis bytes
(checked before a solve allocates). The table with the reasons is in docs/engine.md, "Caps"."""

import importlib

import torch

# Checked when a DEQConfig is made or loaded (a model's config.json included), so that a budget typed
# wrong (1e12, 10**9) is refused at once with the key named instead of running for months or growing until
# memory runs out. Generous: ten times anything a zoo model or a paper uses.
MAX_ITER = 10_000  # f_max_iter, b_max_iter, f_max_iter_min, state_indices entries, unrolled checkpoint
MAX_REVERSIBLE_STEPS = 1_000  # f_max_iter with b_mode="reversible": every step runs (2N + 1 f calls)
MAX_HISTORY = 64  # anderson / hyperanderson m (a (B, m, m) mixing system is solved every step)
MAX_BROYDEN_MEMORY = 1_024  # broyden m (stored update pairs; its full memory keeps at most as many)
MAX_GRAPH_STEPS = 1_000  # steps kept with a graph: phantom k, correction_k, shine refine
MAX_STATES = 1_024  # n_states, len(state_indices), len(keep_steps)
MAX_JAC_SAMPLES = 10_000  # jac_reg_samples (one vector-Jacobian product each; a Frobenius check uses 4,000)
# GMRES keeps its whole Krylov basis (up to min(max_iter, MAX_BASIS + 1) states) and a stacked copy of it:
# the bytes it would hold are checked before a solve allocates anything (`check_gmres_memory`)
MAX_GMRES_BYTES = 4 * 2**30


def check_gmres_memory(key: str, max_iter: int, x: torch.Tensor) -> None:
    """Refuse a GMRES solve whose Krylov basis could exceed MAX_GMRES_BYTES, before it allocates: the basis
    keeps up to min(max_iter, MAX_BASIS + 1) states of x's size and dtype, and a stacked copy of them.

    Example:
        >>> import torch
        >>> from deqzoo.core.caps import check_gmres_memory
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
            f"{MAX_GMRES_BYTES:,} bytes (deqzoo.core.caps.MAX_GMRES_BYTES); lower {key} or the batch size")
