"""Recursive reasoners (TRM, HRM) on deqzoo: a weight-tied core over an input embedding x, an answer state y
and a latent z, with the originals' gradient modes, deep supervision, an ACT Q-head and per-sample halting.

The schedule of one *segment* (the originals' inner forward), with L the latent network and H the answer
network (the same module for TRM, two for HRM)::

    for cycle in range(h_cycles):
        for _ in range(l_cycles):
            z = L(z + y + x)          # L(z, y + x): the injection is added, then the blocks run
        y = H(y + z)

Each block is post-norm (RMSNorm without weights, as both originals): h = rms(h + mix(h)); h = rms(h +
SwiGLU(h)), where mix is self-attention over positions (RoPE or learned positions) or TRM's ``mlp_t`` (a
SwiGLU across positions). The token head reads y at the grid positions; the Q-head reads y at the first
prefix position.

Halting is per sample and checked after each segment by the engine's stop rules (`deqzoo.core.halting`), fed
by :class:`SegmentHalting`: samples that halt leave the batch (the remaining segments run on the active rows
only), so a sample's answer and segment count do not depend on its batch-mates.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ...core import DEQ, SolverStats
from ...core.halting import AnswerStable, HaltHead, Residual, Step
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from .configuration_reasoner import ReasonerConfig

__all__ = ["GroupMixer", "ReasonerBlock", "ReasonerCarry", "ReasonerForGridClassification",
           "ReasonerGridOutput", "ReasonerModel", "ReasonerModelOutput", "ReasonerNetwork",
           "ReasonerPreTrainedModel", "SegmentHalting", "SegmentOutputs", "exact_solved", "rms_norm"]


def rms_norm(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (the originals' post-norm), computed in float32 or wider."""
    dtype = h.dtype
    work = h.float() if dtype in (torch.float16, torch.bfloat16) else h
    return (work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _multiple(value: float, of: int) -> int:
    return int(-(-value // of) * of)


class SwiGLU(nn.Module):
    """down(silu(gate(h)) * up(h)), inner width `inner`, or expansion * 2/3 * width rounded up to a multiple
    of 8."""

    def __init__(self, width: int, expansion: float, inner: int | None = None):
        super().__init__()
        inner = inner or _multiple(expansion * width * 2 / 3, 8)
        self.gate_up = nn.Linear(width, 2 * inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Non-causal multi-head self-attention over the positions, RoPE applied to queries and keys."""

    def __init__(self, config: ReasonerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cos_sin is not None:
            cos, sin = cos_sin
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v)
        return self.out(attn.transpose(1, 2).reshape(b, n, d))


class GroupMixer(nn.Module):
    """mixer "groups": for each partition of ``config.token_groups``, every position gets the mean of the
    OTHER members of its group (prefix positions form groups of their own, so they get zero), and every
    position gets the mean of all other positions (the prefix, read by the Q-head, sees the grid through
    it); the means are concatenated and mapped back to the width by one linear map.

    Group sums are scatter-adds (index_add), so the cost is linear in the positions: no positions x
    positions matrix.
    """

    def __init__(self, config: ReasonerConfig):
        super().__init__()
        ids, peers = self.tables(config)
        # not saved (derived from the config); _init_weights refills them when loading materialises the
        # model from the meta device, as DEQ-Transformer's inv_freq
        self.register_buffer("group_ids", ids, persistent=False)
        self.register_buffer("peers", peers, persistent=False)
        self.proj = nn.Linear((len(ids) + 1) * config.hidden_size, config.hidden_size, bias=False)

    @staticmethod
    def tables(config: ReasonerConfig,
               device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(group id per partition and position, (partitions, positions); the number of other members of the
        position's group, 1 where there are none: a whole number, exact in every dtype). Prefix position k
        is group seq_len + k, a group of its own."""
        p, g = config.num_prefix_tokens, config.seq_len
        rows = [list(range(g, g + p)) + list(part) for part in config.token_groups]
        # counted in Python: the model may be built on the meta device, where bincount has no kernel
        others = [[max(count[i] - 1, 1) for i in row] for row, count in ((r, Counter(r)) for r in rows)]
        return (torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(others, dtype=torch.get_default_dtype(), device=device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        means = []
        for part, peers in zip(self.group_ids, self.peers.to(h.dtype)):
            sums = h.new_zeros(b, n, d).index_add_(1, part, h)  # ids < positions: n group slots suffice
            means.append((sums[:, part] - h) / peers.unsqueeze(-1))
        means.append((h.sum(1, keepdim=True) - h) / max(n - 1, 1))
        return self.proj(torch.cat(means, dim=-1))


class ReasonerBlock(nn.Module):
    """One post-norm block: h = rms(h + mix(h)); h = rms(h + SwiGLU(h)); mix is attention, with
    ``mixer="mlp"`` (TRM's mlp_t) a SwiGLU across the positions, with ``mixer="groups"`` a
    :class:`GroupMixer`."""

    def __init__(self, config: ReasonerConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.norm_positions = config.token_mlp_norm == "positions"
        if config.mixer == "mlp":
            self.token_mlp = SwiGLU(config.num_positions, config.expansion, config.token_intermediate_size)
        elif config.mixer == "groups":
            self.groups = GroupMixer(config)
        else:
            self.attn = Attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.expansion, config.intermediate_size)

    def forward(self, h: torch.Tensor, cos_sin=None) -> torch.Tensor:
        if hasattr(self, "token_mlp"):
            t = h.transpose(1, 2)  # (batch, hidden, positions)
            if self.norm_positions:  # TRM's mlp_t: normalised across the positions, then transposed back
                h = rms_norm(t + self.token_mlp(t), self.eps).transpose(1, 2)
            else:
                h = rms_norm(h + self.token_mlp(t).transpose(1, 2), self.eps)
        elif hasattr(self, "groups"):
            h = rms_norm(h + self.groups(h), self.eps)
        else:
            h = rms_norm(h + self.attn(h, cos_sin), self.eps)
        return rms_norm(h + self.mlp(h), self.eps)


class ReasonerNetwork(nn.Module):
    """A reasoning module: net(h, injection) = blocks(h + injection) (the originals' ReasoningModule)."""

    def __init__(self, config: ReasonerConfig, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ReasonerBlock(config) for _ in range(num_layers))

    def forward(self, h: torch.Tensor, injection: torch.Tensor, cos_sin=None) -> torch.Tensor:
        h = h + injection
        for layer in self.layers:
            h = layer(h, cos_sin)
        return h


@dataclass
class ReasonerCarry:
    """The recurrent state between segments: answer y and latent z, (batch, positions, hidden) each."""

    y: torch.Tensor
    z: torch.Tensor

    def detach(self) -> ReasonerCarry:
        return ReasonerCarry(self.y.detach(), self.z.detach())

    def rows(self, index: torch.Tensor) -> ReasonerCarry:
        return ReasonerCarry(self.y[index], self.z[index])


@dataclass
class ReasonerModelOutput(DEQModelOutput):
    """last_hidden_state: the answer state y (batch, positions, hidden) after the segments; hidden_states:
    (x, z, y) (the answer last, as transformers' last layer) with ``output_hidden_states=True``; carry:
    (y, z) detached, to continue from; deq_stats: the last segment's solve statistics (``grad_mode="deq"``
    only)."""

    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    carry: tuple[torch.Tensor, torch.Tensor] | None = None
    deq_stats: SolverStats | None = None


@dataclass
class ReasonerGridOutput(DEQModelOutput):
    """loss: deep-supervision loss (mean over the segments run of cross-entropy on the cells + 0.5 * BCE of
    the Q-head's halt logit against "the whole grid is right"); logits: (batch, seq_len, num_labels) at each
    sample's last segment; q_halt_logits: (batch,) at that segment; steps: (batch,) segments each sample ran
    (``steps < num_segments``: a halting rule stopped the sample before the budget); carry: (y, z) detached;
    hidden_states: (x, z, y) on request; deq_stats: the last segment's solve statistics (grad_mode "deq")."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    q_halt_logits: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    carry: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    deq_stats: SolverStats | None = None


def _initial_state(width: int, which: int) -> torch.Tensor:
    """The initial y (which=0) or z (1): a truncated-normal draw (std 1, cut at 2) as the originals' H_init /
    L_init, but from a fixed generator, so it is the same vector for every model of that width (a buffer,
    not trained; checkpoints carry their own)."""
    state = torch.empty(width, device="cpu")  # the generator's device, also under a meta-device context
    return nn.init.trunc_normal_(state, std=1.0, a=-2.0, b=2.0,
                                 generator=torch.Generator().manual_seed(1_000_003 * (which + 1)))


class ReasonerPreTrainedModel(DEQPreTrainedModel):
    """Weights I/O for recursive reasoners (config class, the originals' initialisation, prefix)."""

    config_class = ReasonerConfig
    base_model_prefix = "reasoner"
    main_input_name = "input_ids"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # the originals: truncated-normal LeCun init of every linear (std 1/sqrt(fan_in)), embeddings std
        # 1/sqrt(width) (scaled back up by sqrt(width) in the forward), zero prefix (puzzle) embedding,
        # initial states std 1 (fixed draws: _initial_state), the Q-head zero with bias q_bias_init (-5: no
        # sample halts before the head has learned); transformers' guarded init functions keep loaded weights
        std_embed = 1.0 / math.sqrt(self.config.hidden_size)
        if isinstance(module, nn.Linear):
            if getattr(module, "is_q_head", False):
                init.zeros_(module.weight)
                init.constant_(module.bias, self.config.q_bias_init)
                return
            std = 1.0 / math.sqrt(module.in_features)
            init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.trunc_normal_(module.weight, std=std_embed, a=-2 * std_embed, b=2 * std_embed)
        elif isinstance(module, GroupMixer):  # not saved: rebuilt when loading materialises from meta
            ids, peers = module.tables(self.config, module.group_ids.device)
            init.copy_(module.group_ids, ids)
            init.copy_(module.peers, peers)
        elif isinstance(module, ReasonerModel):
            init.zeros_(module.prefix)
            if module.position is not None:
                init.trunc_normal_(module.position, std=std_embed, a=-2 * std_embed, b=2 * std_embed)
            init.copy_(module.y_init, _initial_state(module.y_init.numel(), 0))
            init.copy_(module.z_init, _initial_state(module.z_init.numel(), 1))


class ReasonerModel(ReasonerPreTrainedModel):
    """The recursive core: embeddings, the L (and, for HRM, H) network, the initial states and the segment
    schedule with its gradient mode.

    ``forward(input_ids, carry=None, num_segments=None)`` runs `num_segments` segments (default
    ``config.halt_max_steps``) from `carry` (default the learned initial states) with the carry detached
    between segments, and returns the answer state y.

    Example:
        >>> import torch
        >>> from deqzoo.models.reasoner import ReasonerConfig, ReasonerModel
        >>> cfg = ReasonerConfig(seq_len=16, vocab_size=5, num_labels=5, hidden_size=16, num_heads=2,
        ...                      h_cycles=2, l_cycles=2, halt_max_steps=2)
        >>> out = ReasonerModel(cfg)(torch.randint(0, 5, (3, 16)))
        >>> tuple(out.last_hidden_state.shape)
        (3, 17, 16)
    """

    def __init__(self, config: ReasonerConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.prefix = nn.Parameter(torch.zeros(config.num_prefix_tokens, d))
        self.position = (nn.Parameter(torch.zeros(config.num_positions, d))
                         if config.pos_encodings == "learned" else None)
        self.l_net = ReasonerNetwork(config, config.num_layers)
        # TRM: one network for both updates; HRM: a separate H network for the answer
        self.h_net = (ReasonerNetwork(config, config.h_layers or config.num_layers)
                      if config.architecture == "hrm" else None)
        self.register_buffer("y_init", _initial_state(d, 0), persistent=True)
        self.register_buffer("z_init", _initial_state(d, 1), persistent=True)
        self.deq = DEQ(config.deq_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ------------------------------------------------------------------------------------------- pieces
    def embed_inputs(self, input_ids: torch.Tensor | None = None,
                     inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """x: (batch, positions, hidden): the prefix then the scaled token embeddings (learned positions
        added, scaled by 1/sqrt(2), as the originals). `inputs_embeds` (batch, seq_len, hidden) replaces the
        token lookup (transformers' convention)."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[1:] != (cfg.seq_len, cfg.hidden_size):
                raise ValueError(f"inputs_embeds must have shape (batch, seq_len={cfg.seq_len}, hidden_size="
                                 f"{cfg.hidden_size}), got {tuple(inputs_embeds.shape)}")
            tokens = inputs_embeds
        else:
            if input_ids.dim() != 2 or input_ids.shape[1] != cfg.seq_len:
                raise ValueError(f"input_ids must have shape (batch, seq_len={cfg.seq_len}), got "
                                 f"{tuple(input_ids.shape)}")
            if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
                raise TypeError(f"input_ids must hold integers, got dtype {input_ids.dtype}")
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
                raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}), got values in "
                                 f"[{int(input_ids.min())}, {int(input_ids.max())}]")
            tokens = self.embed_tokens(input_ids)
        prefix = self.prefix.to(tokens.dtype).expand(tokens.shape[0], -1, -1)
        x = torch.cat([prefix, tokens], dim=1)
        if self.position is not None:
            # the originals' literal 0.707106781 (not 1/sqrt(2) to double precision): float64 parity
            x = 0.707106781 * (x + self.position.to(x.dtype))
        return math.sqrt(cfg.hidden_size) * x

    def rotary(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's (cos, sin), (positions, head_dim), or None without RoPE."""
        cfg = self.config
        if cfg.pos_encodings != "rope" or cfg.mixer != "attention":
            return None
        head = cfg.hidden_size // cfg.num_heads
        # the table is built in float32, as the originals build theirs (converted checkpoints then agree to
        # the last bit), and in float64 for a float64 model
        work = torch.float64 if dtype == torch.float64 else torch.float32
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head, 2, dtype=work, device=device) / head))
        angles = torch.outer(torch.arange(cfg.num_positions, dtype=work, device=device), inv)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def initial_carry(self, batch_size: int, dtype: torch.dtype | None = None) -> ReasonerCarry:
        """The learned initial states (the originals' H_init / L_init) broadcast to every position."""
        shape = (batch_size, self.config.num_positions, self.config.hidden_size)
        dtype = dtype or self.y_init.dtype
        return ReasonerCarry(self.y_init.to(dtype).expand(shape).clone(),
                             self.z_init.to(dtype).expand(shape).clone())

    def latent_step(self, x, y, z, cos_sin=None) -> torch.Tensor:
        """z <- L(z, y + x)."""
        return self.l_net(z, y + x, cos_sin)

    def answer_step(self, y, z, cos_sin=None) -> torch.Tensor:
        """y <- H(y, z) (H is L for TRM)."""
        return (self.h_net or self.l_net)(y, z, cos_sin)

    def cycle(self, x, y, z, cos_sin=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One cycle: l_cycles latent updates, then one answer update."""
        for _ in range(self.config.l_cycles):
            z = self.latent_step(x, y, z, cos_sin)
        return self.answer_step(y, z, cos_sin), z

    def segment(self, x: torch.Tensor, carry: ReasonerCarry,
                grad_mode: str | None = None) -> tuple[ReasonerCarry, SolverStats | None]:
        """One segment from `carry` under a gradient mode (default ``config.grad_mode``); without autograd
        every mode but "deq" computes the same values."""
        cfg = self.config
        mode = grad_mode or cfg.grad_mode
        cos_sin = self.rotary(x.dtype, x.device)
        y, z = carry.y, carry.z
        if mode == "deq":
            def f(state):
                return self.cycle(x, state[0], state[1], cos_sin)

            (y, z), stats = self.deq(f, (y, z))
            return ReasonerCarry(y, z), stats
        if mode == "full":
            for _ in range(cfg.h_cycles):
                y, z = self.cycle(x, y, z, cos_sin)
            return ReasonerCarry(y, z), None
        if mode == "last_cycle":  # TRM: h_cycles - 1 cycles without a graph, the last one with it
            with torch.no_grad():
                for _ in range(cfg.h_cycles - 1):
                    y, z = self.cycle(x, y, z, cos_sin)
            y, z = self.cycle(x, y, z, cos_sin)
            return ReasonerCarry(y, z), None
        if mode == "one_step":  # HRM: every update but the last latent and the last answer update without
            with torch.no_grad():  # a graph (the 1-step gradient approximation)
                for c in range(cfg.h_cycles):
                    last = c == cfg.h_cycles - 1
                    for _ in range(cfg.l_cycles - 1 if last else cfg.l_cycles):
                        z = self.latent_step(x, y, z, cos_sin)
                    if not last:
                        y = self.answer_step(y, z, cos_sin)
            z = self.latent_step(x, y, z, cos_sin)
            return ReasonerCarry(self.answer_step(y, z, cos_sin), z), None
        raise ValueError(f"unknown grad_mode {mode!r}; expected one of one_step, last_cycle, full, deq")

    def forward(self, input_ids: torch.Tensor | None = None, carry: ReasonerCarry | tuple | None = None,
                num_segments: int | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                inputs_embeds: torch.Tensor | None = None) -> ReasonerModelOutput | tuple:
        x = self.embed_inputs(input_ids, inputs_embeds)
        carry = self._carry(carry, x)
        stats = None
        for _ in range(self._segments(num_segments)):
            carry, stats = self.segment(x, carry.detach())
        out = ReasonerModelOutput(
            last_hidden_state=carry.y,
            hidden_states=(x, carry.z, carry.y) if self._flag(output_hidden_states, "output_hidden_states")
            else None,
            carry=(carry.y.detach(), carry.z.detach()), deq_stats=stats)
        return self._output(out, return_dict)

    def _segments(self, num_segments: int | None) -> int:
        n = self.config.halt_max_steps if num_segments is None else num_segments
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_segments must be an integer >= 1, got {num_segments!r}")
        return n

    def _carry(self, carry, x: torch.Tensor) -> ReasonerCarry:
        if carry is None:
            return self.initial_carry(x.shape[0], x.dtype)
        if isinstance(carry, (tuple, list)):
            carry = ReasonerCarry(*carry)
        if carry.y.shape != x.shape or carry.z.shape != x.shape:
            raise ValueError(f"carry must hold y and z of shape {tuple(x.shape)} (batch, positions, hidden), "
                             f"got {tuple(carry.y.shape)} and {tuple(carry.z.shape)}")
        return carry


@dataclass
class SegmentOutputs:
    """What the halting rules see of one segment for the rows still running (the structured state of the
    `deqzoo.core.halting.Step` the segment loop builds): the new answer state y, its per-cell argmax and the
    Q-head's halt logit."""

    y: torch.Tensor
    pred: torch.Tensor
    q_halt_logits: torch.Tensor


class SegmentHalting:
    """Per-sample halting after each segment, by the engine's stop rules (`deqzoo.core.halting`).

    Rules: "budget" (never halts early), "act" (`HaltHead` on the Q-head's halt logit: halts when > 0, the
    originals' rule with no_ACT_continue), "residual" (`Residual(tol, "rel")` on the answer state:
    ||y_new - y_prev|| / ||y_new|| < tol), "stability" (`AnswerStable` on the argmax answer: unchanged for
    `patience` consecutive segments). The segment loop is not a root solve (each segment runs the network a
    fixed number of times and is supervised on its own), so the engine's solvers do not drive it; what this
    class adds is the `Step` per segment that the rules read (the segments each row has run as its evaluation
    count, the answer state's change as the residual). :meth:`update` takes the rows still running and
    returns which of them halt now.

    Example:
        >>> import torch
        >>> h = SegmentHalting("stability", batch_size=2, patience=1)
        >>> rows, y = torch.arange(2), torch.zeros(2, 3, 4)
        >>> pred, q = torch.tensor([[1, 2, 0], [3, 4, 0]]), torch.zeros(2)
        >>> seen = dict(y_prev=y, y_new=y, pred=pred, q_halt_logits=q)
        >>> h.update(rows, torch.tensor([1, 1]), **seen).tolist()  # first segment: nothing to compare yet
        [False, False]
        >>> h.update(rows, torch.tensor([2, 2]), **seen).tolist()  # the same answer a second time
        [True, True]
    """

    def __init__(self, rule: str, batch_size: int, *, tol: float = 1e-3, patience: int = 1,
                 device: torch.device | str = "cpu"):
        rules = {"budget": lambda: (),
                 "act": lambda: (HaltHead(lambda s: s.q_halt_logits.detach()),),
                 "residual": lambda: (Residual(tol, "rel"),),
                 "stability": lambda: (AnswerStable(lambda s: s.pred, k=patience),)}
        if rule not in rules:
            raise ValueError(f"unknown halting rule {rule!r}; expected budget, act, residual or stability")
        self.rule, self.rules = rule, rules[rule]()
        for r in self.rules:
            r.start(batch_size, torch.device(device))

    def update(self, rows: torch.Tensor, segments: torch.Tensor, *, y_prev: torch.Tensor, y_new: torch.Tensor,
               pred: torch.Tensor, q_halt_logits: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of the n running `rows` halt after the segment that took y_prev to y_new;
        `segments`: (n,) the segments each has run, this one included."""
        if not self.rules:
            return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        x, fx = y_prev.detach().flatten(1), y_new.detach().flatten(1)
        abs_r = torch.linalg.vector_norm(fx - x, dim=1, dtype=torch.float64)
        rel_r = abs_r / (torch.linalg.vector_norm(fx, dim=1, dtype=torch.float64) + 1e-12)
        state = SegmentOutputs(y_new, pred, q_halt_logits)
        step = Step(x, fx, rows, segments, abs_r, rel_r, unflatten=lambda _: state)
        stop = self.rules[0](step)
        for r in self.rules[1:]:
            stop = stop | r(step)
        return stop


class ReasonerForGridClassification(ReasonerPreTrainedModel):
    """A recursive reasoner with a per-cell classification head and an ACT Q-head.

    ``forward(input_ids, labels=None, carry=None, num_segments=None, halting=None)`` runs up to
    `num_segments` segments (default ``config.halt_max_steps``) with the carry detached between them (deep
    supervision: each segment's loss backpropagates through that segment only, by ``config.grad_mode``).
    After each segment the rule `halting` (default ``config.halting``; see :class:`SegmentHalting`) stops
    samples one by one; stopped samples keep their answer and leave the batch. In training the "act" rule
    also draws the originals' exploration (a random minimum segment count with probability
    ``halt_exploration_prob``). Labels equal to -100 are ignored.

    Example:
        >>> import torch
        >>> from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification
        >>> cfg = ReasonerConfig(seq_len=16, vocab_size=5, num_labels=5, hidden_size=16, num_heads=2,
        ...                      h_cycles=2, l_cycles=2, halt_max_steps=3)
        >>> model = ReasonerForGridClassification(cfg).eval()
        >>> out = model(torch.randint(0, 5, (4, 16)), halting="stability")
        >>> tuple(out.logits.shape), out.steps.tolist() <= [3, 3, 3, 3]
        ((4, 16, 5), True)
    """

    def __init__(self, config: ReasonerConfig):
        super().__init__(config)
        self.reasoner = ReasonerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.q_head = nn.Linear(config.hidden_size, 2, bias=True)  # (halt, continue) as the originals
        self.q_head.is_q_head = True  # read by _init_weights
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.reasoner.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.reasoner.embed_tokens = value

    def heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cell logits (batch, seq_len, num_labels), halt logit (batch,)) from the answer state y."""
        p = self.config.num_prefix_tokens
        return self.lm_head(y[:, p:]), self.q_head(y[:, 0])[..., 0]

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                carry: ReasonerCarry | tuple | None = None, num_segments: int | None = None,
                halting: str | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                inputs_embeds: torch.Tensor | None = None) -> ReasonerGridOutput | tuple:
        cfg, core = self.config, self.reasoner
        x = core.embed_inputs(input_ids, inputs_embeds)
        if labels is not None and labels.shape != x.shape[:1] + (cfg.seq_len,):
            raise ValueError(f"labels must have shape (batch, seq_len) = {(x.shape[0], cfg.seq_len)}, got "
                             f"{tuple(labels.shape)}")
        carry = core._carry(carry, x)
        budget = core._segments(num_segments)
        b = x.shape[0]
        rule = SegmentHalting(halting or cfg.halting, b, tol=cfg.halt_tol, patience=cfg.halt_patience,
                              device=x.device)
        min_steps = None
        if self.training and rule.rule == "act" and cfg.halt_exploration_prob > 0:
            explore = torch.rand(b, device=x.device) < cfg.halt_exploration_prob
            min_steps = explore * torch.randint(2, max(budget, 2) + 1, (b,), device=x.device)
        y, z = carry.y.detach(), carry.z.detach()
        steps = torch.zeros(b, dtype=torch.long, device=x.device)
        halted = torch.zeros(b, dtype=torch.bool, device=x.device)
        logits = q_halt = None
        losses, stats = [], None
        for s in range(budget):
            rows = (~halted).nonzero().flatten()
            if rows.numel() == 0:
                break
            every = rows.numel() == b  # no indexing while the whole batch runs (the common case)

            def pick(t: torch.Tensor, rows=rows, every=every) -> torch.Tensor:
                return t if every else t[rows]

            new, stats = core.segment(pick(x), ReasonerCarry(pick(y), pick(z)))
            seg_logits, seg_q = self.heads(new.y)
            if labels is not None:
                losses.append(self._segment_loss(seg_logits, seg_q, pick(labels)))
            if logits is None:
                logits, q_halt = seg_logits, seg_q
            else:
                logits = seg_logits if every else logits.index_copy(0, rows, seg_logits)
                q_halt = seg_q if every else q_halt.index_copy(0, rows, seg_q)
            steps[rows] += 1
            stop = rule.update(rows, steps[rows], y_prev=pick(y), y_new=new.y, pred=seg_logits.argmax(-1),
                               q_halt_logits=seg_q)
            if min_steps is not None:
                stop = stop & (steps[rows] >= min_steps[rows])
            y = new.y.detach() if every else y.index_copy(0, rows, new.y.detach())
            z = new.z.detach() if every else z.index_copy(0, rows, new.z.detach())
            if s < budget - 1:
                halted[rows[stop]] = True
        loss = torch.stack(losses).mean() if losses else None
        hidden = (x, z, y) if self._flag(output_hidden_states, "output_hidden_states") else None
        out = ReasonerGridOutput(loss=loss, logits=logits, q_halt_logits=q_halt, steps=steps,
                                 carry=(y, z), hidden_states=hidden, deq_stats=stats)
        return self._output(out, return_dict)

    @staticmethod
    def _segment_loss(logits: torch.Tensor, q_halt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per labelled cell averaged per sample, then over samples, plus 0.5 * BCE of the halt
        logit against "every labelled cell right" (TRM's ACT loss with no_ACT_continue)."""
        mask = labels != -100
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp_min(0),
                             reduction="none").view_as(labels)
        per_sample = (ce * mask).sum(1) / mask.sum(1).clamp_min(1)
        with torch.no_grad():
            correct = ((logits.argmax(-1) == labels) | ~mask).all(1)
        q_loss = F.binary_cross_entropy_with_logits(q_halt.float(), correct.to(torch.float32))
        return per_sample.mean() + 0.5 * q_loss


def exact_solved(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(batch,) bool: every labelled cell (labels != -100) predicted right."""
    return ((logits.argmax(-1) == labels) | (labels == -100)).all(1)

