"""Recursive reasoner configuration: one weight-tied core (TRM) or two (HRM) iterated over an input
embedding x, an answer state y and a latent z.

- TRM, "Less is More: Recursive Reasoning with Tiny Networks" (Jolicoeur-Martineau, 2025;
  SamsungSAILMontreal/TinyRecursiveModels, models/recursive_reasoning/trm.py): ONE network; a cycle is
  ``l_cycles`` latent updates z <- net(z + y + x) then one answer update y <- net(y + z); ``h_cycles`` cycles
  per supervision segment.
- HRM, "Hierarchical Reasoning Model" (Wang et al., 2025; sapientinc/HRM, models/hrm/hrm_act_v1.py): TWO
  networks, L (fast, the latent z) and H (slow, the answer y), the same schedule.

Differences from the originals, on purpose or not yet done: the prefix positions are learned and shared by all
puzzles (the originals' per-puzzle embedding is a dataset-identity lookup); the halt logit alone decides ACT
halting (TRM's ``no_ACT_continue``; HRM's Q-learning continue target is not implemented); the loss is softmax
cross-entropy (TRM also offers stablemax).

A *segment* is one call of the inner model (h_cycles x (l_cycles + 1) network applications); deep
supervision trains one segment at a time with the carry (y, z) detached between segments, and inference runs
``halt_max_steps`` segments, or fewer per sample when a halting rule stops it.
"""

from __future__ import annotations

from typing import Any, Literal

from ...configuration_utils import ConfigError, DEQPretrainedConfig, ranged, strict_config

# The "deq" gradient mode treats one cycle (y, z) -> (y', z') as the fixed-point map: a segment is a solve by
# config.deq's solver (at most f_max_iter cycles, to f_tol; h_cycles is not used) and the backward is
# config.deq's b_mode (IFT, phantom, reversible, ...).
DEFAULT_DEQ: dict[str, Any] = {"f_solver": "fixed_point", "f_max_iter": 16, "f_tol": 1e-6,
                               "f_stop_mode": "rel", "b_mode": "ift", "b_solver": "fixed_point",
                               "b_max_iter": 30, "b_tol": 1e-6}

GRAD_MODES = ("one_step", "last_cycle", "full", "deq")
HALTING_RULES = ("budget", "act", "residual", "stability")


@strict_config
class ReasonerConfig(DEQPretrainedConfig):
    """Configuration of a recursive reasoner over a grid of tokens (Sudoku cells, maze cells).

    Args:
        architecture: "trm" (one network for z and y) or "hrm" (an L network for z, an H network for y).
        vocab_size: input tokens (Sudoku: 0 = blank, 1..n digits).
        num_labels: output classes per cell (the token-classification head).
        seq_len: grid cells per puzzle (n * n).
        num_prefix_tokens: learned positions prepended to the grid; the Q-head reads the first (the
            originals' puzzle-embedding positions, here shared by all puzzles).
        hidden_size, num_heads, expansion: width, attention heads, SwiGLU expansion (hidden = expansion * 2/3
            * width, rounded up to a multiple of 256 in the originals; here to a multiple of 8).
        intermediate_size, token_intermediate_size: the SwiGLU inner widths over the hidden size and (mixer
            "mlp") over the positions; None: the expansion rule above (converted checkpoints set them to the
            originals' widths, which round to a multiple of 256).
        num_layers: blocks in the network (TRM: 2); h_layers: blocks of HRM's H network (None: num_layers).
        mixer: "attention" (self-attention over cells), "mlp" (TRM's ``mlp_t``: a SwiGLU across positions) or
            "groups" (our addition, not in the originals: each position receives, per partition of
            ``token_groups``, the mean of the other members of its group, and the mean of all other
            positions, through one linear map: the puzzle's constraint structure, e.g. a Sudoku's rows,
            columns and boxes, is given to the network instead of learned by a dense mixer).
        token_groups: with mixer "groups", the partitions of the grid cells, each a list of seq_len group ids
            (:func:`grid_groups` builds rows, columns and boxes); None otherwise.
        token_mlp_norm: what the post-norm after the "mlp" mixer normalises over: "hidden" (each position's
            features, as every other norm here) or "positions" (each feature across the positions: TRM's
            mlp_t, which adds and normalises before transposing back; converted TRM checkpoints use it).
        pos_encodings: "rope", "learned" or "none" (the originals use RoPE; TRM's mlp_t runs use learned).
        rms_norm_eps, rope_theta: post-norm epsilon and RoPE base.
        h_cycles: cycles per segment (T; HRM's H_cycles); l_cycles: latent updates per cycle (n; L_cycles).
        halt_max_steps: supervision segments in training and the inference budget (N_sup).
        halt_exploration_prob: ACT exploration in training (a sample draws a minimum segment count).
        q_bias_init: initial Q-head bias (the originals' -5: no sample halts before the head has learned).
        grad_mode: "one_step" (HRM: everything but the last L and H updates under no_grad), "last_cycle" (TRM:
            the last cycle with gradient), "full" (backprop through every cycle of the segment), "deq" (the
            cycle as a fixed-point map solved by deqzoo.core.DEQ to config.deq's f_tol within its f_max_iter
            cycles, h_cycles unused, differentiated by its backward mode: ift, phantom, reversible, ...).
        halting: the inference halting rule, per sample, checked after each segment: "budget" (run
            halt_max_steps), "act" (Q-head halt logit > 0), "residual" (relative change of the answer state
            y below halt_tol), "stability" (argmax answer unchanged for halt_patience segments).
        halt_tol, halt_patience: thresholds of the residual and stability rules.

    Example:
        >>> from deqzoo.models.reasoner import ReasonerConfig
        >>> cfg = ReasonerConfig(seq_len=36, vocab_size=7, num_labels=7, hidden_size=32, num_heads=2)
        >>> cfg.model_type, cfg.architecture, cfg.grad_mode
        ('reasoner', 'trm', 'last_cycle')
    """

    model_type = "reasoner"
    default_deq = DEFAULT_DEQ

    architecture: Literal["trm", "hrm"] = "trm"
    vocab_size: int = ranged(2, 1 << 20, default=10)
    seq_len: int = ranged(1, 1 << 16, default=81)
    num_prefix_tokens: int = ranged(1, 256, default=1)
    hidden_size: int = ranged(1, 16384, default=512)
    num_heads: int = ranged(1, 256, default=8)
    expansion: float | int = ranged(0.0, 64.0, default=4.0, as_float=True)
    intermediate_size: int | None = ranged(1, 1 << 20, default=None)
    token_intermediate_size: int | None = ranged(1, 1 << 20, default=None)
    num_layers: int = ranged(1, 64, default=2)
    h_layers: int | None = ranged(1, 64, default=None)
    mixer: Literal["attention", "mlp", "groups"] = "attention"
    token_groups: list[list[int]] | None = None
    token_mlp_norm: Literal["hidden", "positions"] = "hidden"
    pos_encodings: Literal["rope", "learned", "none"] = "rope"
    rms_norm_eps: float | int = ranged(0.0, 1.0, default=1e-5, as_float=True)
    rope_theta: float | int = ranged(0.0, None, default=10000.0, as_float=True)
    h_cycles: int = ranged(1, 1024, default=3)
    l_cycles: int = ranged(1, 1024, default=6)
    halt_max_steps: int = ranged(1, 4096, default=16)
    halt_exploration_prob: float | int = ranged(0.0, 1.0, default=0.1, as_float=True)
    q_bias_init: float | int = ranged(None, None, default=-5.0, as_float=True)
    grad_mode: Literal["one_step", "last_cycle", "full", "deq"] = "last_cycle"
    halting: Literal["budget", "act", "residual", "stability"] = "budget"
    halt_tol: float | int = ranged(0.0, None, default=1e-3, as_float=True, open_low=True)  # the engine's: > 0
    halt_patience: int = ranged(1, 4096, default=2)

    def validate_shapes(self) -> None:
        """Attention heads divide the width (RoPE needs an even head size); expansion is positive."""
        if self.mixer == "attention" and self.hidden_size % self.num_heads:
            raise ConfigError(f"key 'hidden_size' ({self.hidden_size}) must be divisible by 'num_heads' "
                              f"({self.num_heads})")
        if self.mixer == "attention" and self.pos_encodings == "rope" and (self.hidden_size
                                                                           // self.num_heads) % 2:
            raise ConfigError(f"RoPE needs an even head size; hidden_size / num_heads = "
                              f"{self.hidden_size // self.num_heads}")
        if self.expansion <= 0:
            raise ConfigError(f"key 'expansion' must be > 0, got {self.expansion!r}")
        if (self.mixer == "groups") != (self.token_groups is not None):
            raise ConfigError(f"key 'token_groups' is given exactly when mixer is 'groups' (mixer "
                              f"{self.mixer!r}, token_groups {'given' if self.token_groups else 'None'})")
        for i, ids in enumerate(self.token_groups or ()):
            if len(ids) != self.seq_len or min(ids) < 0 or max(ids) >= self.seq_len:
                raise ConfigError(f"key 'token_groups': partition {i} must hold seq_len ({self.seq_len}) "
                                  f"group ids in [0, {self.seq_len}), got {len(ids)} ids in "
                                  f"[{min(ids, default=0)}, {max(ids, default=0)}]")

    @property
    def num_positions(self) -> int:
        """Prefix positions plus grid cells: the length of every state."""
        return self.num_prefix_tokens + self.seq_len

    @property
    def applications_per_segment(self) -> int:
        """Network applications in one segment: h_cycles * (l_cycles + 1)."""
        return self.h_cycles * (self.l_cycles + 1)


def grid_groups(n: int, box: tuple[int, int] | None = None) -> list[list[int]]:
    """The partitions of an n x n grid's cells (row-major) for mixer "groups": its rows and columns, and with
    `box` = (rows, columns) its boxes (Sudoku 9x9: (3, 3); 6x6: (2, 3)).

    Example:
        >>> rows, cols, boxes = grid_groups(4, box=(2, 2))
        >>> rows[:5], cols[:5], boxes[:8]
        ([0, 0, 0, 0, 1], [0, 1, 2, 3, 0], [0, 0, 1, 1, 0, 0, 1, 1])
    """
    cells = [divmod(i, n) for i in range(n * n)]
    groups = [[r for r, _ in cells], [c for _, c in cells]]
    if box is not None:
        br, bc = box
        if br < 1 or bc < 1 or n % br or n % bc:
            raise ValueError(f"box {box} must divide the grid size {n} in both directions")
        groups.append([(r // br) * (n // bc) + c // bc for r, c in cells])
    return groups


def one_pass_twin(config: ReasonerConfig) -> ReasonerConfig:
    """The explicit one-pass twin of a reasoner: the same network(s), hence the same parameters and
    parameter count, applied once: one segment of one cycle of one latent update (z <- net(x + y0 + z0),
    y <- net(y0 + z)), trained with full backpropagation and no halting. It is what the reasoner is without
    recursion and deep supervision; comparing the two at equal CPU time measures what the recursion buys.

    Example:
        >>> twin = one_pass_twin(ReasonerConfig(seq_len=36, vocab_size=7, num_labels=7, hidden_size=32,
        ...                                     num_heads=2))
        >>> twin.h_cycles, twin.l_cycles, twin.halt_max_steps, twin.grad_mode
        (1, 1, 1, 'full')
    """
    return type(config).from_dict({**config.to_dict(), "h_cycles": 1, "l_cycles": 1, "halt_max_steps": 1,
                                   "grad_mode": "full", "halting": "budget"})


# the published 6x6 Sudoku pair (model_cards/trm-sudoku6 and its twin) share this network
_SUDOKU6 = {"architecture": "trm", "vocab_size": 7, "num_labels": 7, "seq_len": 36, "hidden_size": 64,
            "num_heads": 2, "num_layers": 2, "mixer": "mlp", "pos_encodings": "learned", "h_cycles": 1,
            "l_cycles": 1, "halt_max_steps": 4, "architectures": ["ReasonerForGridClassification"]}

# Named presets for deqzoo.create_model (see deqzoo.models.registry).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "trm-sudoku6-mlp": {
        "task": "grid-reasoning",
        "config": {"architecture": "trm", "vocab_size": 7, "num_labels": 7, "seq_len": 36,
                   "hidden_size": 64, "num_heads": 2, "num_layers": 2, "mixer": "mlp",
                   "pos_encodings": "learned", "h_cycles": 3, "l_cycles": 4, "halt_max_steps": 8,
                   "architectures": ["ReasonerForGridClassification"]},
        "description": "TRM (one 2-block MLP-mixer network, T=3, n=4, 8 segments) for 6x6 Sudoku: "
                       "the CPU pilot's model.",
    },
    "trm-sudoku6": {
        "task": "grid-reasoning",
        "config": _SUDOKU6,
        "description": "The published 6x6 Sudoku reasoner: the pilot's network, one cycle of one latent "
                       "update per segment (2 applications), 4 segments.",
    },
    "trm-sudoku6-twin": {
        "task": "grid-reasoning",
        "config": {**_SUDOKU6, "halt_max_steps": 1, "grad_mode": "full"},  # what one_pass_twin makes of it
        "description": "trm-sudoku6's explicit one-pass twin (one_pass_twin): the same network applied once.",
    },
    "trm-sudoku9-attention": {
        "task": "grid-reasoning",
        "config": {"architecture": "trm", "vocab_size": 10, "num_labels": 10, "seq_len": 81,
                   "hidden_size": 512, "num_heads": 8, "num_layers": 2, "mixer": "attention",
                   "pos_encodings": "rope", "h_cycles": 3, "l_cycles": 6, "halt_max_steps": 16,
                   "architectures": ["ReasonerForGridClassification"]},
        "description": "TRM-Att as the paper's Sudoku-Extreme run shape (512 wide, 2 blocks, T=3, n=6, "
                       "16 segments).",
    },
    "hrm-sudoku9": {
        "task": "grid-reasoning",
        "config": {"architecture": "hrm", "vocab_size": 10, "num_labels": 10, "seq_len": 81,
                   "hidden_size": 512, "num_heads": 8, "num_layers": 4, "h_layers": 4,
                   "mixer": "attention", "pos_encodings": "rope", "h_cycles": 2, "l_cycles": 2,
                   "halt_max_steps": 16, "grad_mode": "one_step",
                   "architectures": ["ReasonerForGridClassification"]},
        "description": "HRM as released for Sudoku (H and L networks of 4 blocks, 512 wide, H_cycles=2, "
                       "L_cycles=2, 1-step gradient, up to 16 ACT segments).",
    },
}
