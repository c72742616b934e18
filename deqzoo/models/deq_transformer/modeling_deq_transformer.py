"""DEQ-Transformer language model: a weight-tied decoder block solved to its fixed point.

f_θ(z; u, memory) is one decoder block (Bai et al. 2019) or a few blocks (TorchDEQ) with relative positional
attention over ``[memory, z]``; the injected input ``u`` is added to the q/k/v projections. The equilibrium of
each segment becomes memory for the next one (Transformer-XL), and in incremental decoding (``generate()``,
one new token
per forward) the previous token's fixed point initializes the next solve (``config.fixed_point_reuse``).

All tensors are batch first: states (B, L, d_model), injection (B, L, 3 * n_head * d_head).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...core import DEQ, SolverStats
from ...core.halting import rowwise
from ...core.norm import apply_norm, reset_norm
from ...core.regularize import VariationalDropout, reset_dropout
from ...modeling_utils import DEQModelOutput, DEQPreTrainedModel
from .configuration_deq_transformer import DEQTransformerConfig

# Documented input limit, checked before any work: positions one forward attends over (new tokens + memory).
MAX_SEQUENCE_LENGTH = 8192


def check_sequence(input_ids: torch.Tensor, cache=None) -> None:
    """Refuse empty input (no sequence or no token), non-integer ids, or more than MAX_SEQUENCE_LENGTH
    positions (new tokens plus cached memory) before any embedding is computed."""
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    b, q = input_ids.shape
    if b == 0 or q == 0:
        raise ValueError(f"input_ids is empty (shape {(b, q)}); pass at least one sequence of at least "
                         "one token")
    memory = 0 if cache is None or getattr(cache, "z_hist", None) is None else int(cache.z_hist.shape[1])
    if q + memory > MAX_SEQUENCE_LENGTH:
        raise ValueError(f"input_ids has {q:,} tokens (+{memory:,} in memory), above the limit of "
                         f"{MAX_SEQUENCE_LENGTH:,} positions per forward (MAX_SEQUENCE_LENGTH); "
                         "split the text")



# --------------------------------------------------------------------------------------------------
# Memory of past equilibria (the generation cache)
# --------------------------------------------------------------------------------------------------
class DEQTransformerCache:
    """Past equilibria and their injections (the original's ``mems``), plus the last fixed point for reuse.

    Attributes:
        z_hist: (B, M, d_model) equilibria of the last M positions (M <= mem_len).
        u_hist: (B, M, 3*n_head*d_head) their input injections.
        z_last: (B, 1, d_model) the last position's fixed point (initial guess of the next solve).
        seen: number of tokens processed so far.
        nfe: f evaluations of every forward solve that used this cache, in order.
    """

    def __init__(self, z_hist: torch.Tensor | None = None, u_hist: torch.Tensor | None = None,
                 z_last: torch.Tensor | None = None, seen: int = 0, nfe: list[int] | None = None):
        self.z_hist, self.u_hist, self.z_last = z_hist, u_hist, z_last
        self.seen = seen
        self.nfe = list(nfe or [])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def total_nfe(self) -> int:
        return sum(self.nfe)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # beam search (transformers' generate)
        for name in ("z_hist", "u_hist", "z_last"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, beam_idx.to(t.device)))


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------
@dataclass
class DEQTransformerModelOutput(BaseModelOutputWithPast, DEQModelOutput):
    """Equilibrium states of one segment.

    Attributes:
        last_hidden_state: (B, L, d_model) the fixed point (after output dropout).
        past_key_values: :class:`DEQTransformerCache` with the updated memory.
        hidden_states: with ``output_hidden_states=True``: (token embeddings, equilibrium), each
            (B, L, d_model) (explicit models: the embeddings and every layer's output).
        attentions: with ``output_attentions=True``: per block of f_θ, (B, n_head, L, memory + L) attention
            probabilities at the equilibrium (one more f evaluation, not counted in nfe).
        jac_loss: Hutchinson estimate of ||J_f||_F^2 / dim (training with ``jac_reg_samples > 0``), else None.
        deq_stats: the forward solve's :class:`~deqzoo.core.SolverStats` (explicit models: nfe = layers).
    """

    jac_loss: torch.Tensor | None = None
    deq_stats: SolverStats | None = None


@dataclass
class DEQTransformerCausalLMOutput(CausalLMOutputWithPast, DEQModelOutput):
    """Language-model output.

    Attributes:
        loss: mean next-token cross-entropy (+ jac_reg_weight * jac_loss when training with the regularizer).
        logits: (B, L, vocab) next-token scores (log-probabilities when the adaptive softmax is used).
        past_key_values: :class:`DEQTransformerCache`.
        hidden_states, attentions, jac_loss: see :class:`DEQTransformerModelOutput`.
        deq_stats: solver statistics.
    """

    jac_loss: torch.Tensor | None = None
    deq_stats: SolverStats | None = None


# --------------------------------------------------------------------------------------------------
# Embedding and output head (optionally adaptive, Baevski & Auli 2019)
# --------------------------------------------------------------------------------------------------
def _cluster_bounds(config: DEQTransformerConfig) -> list[tuple[int, int]]:
    ends = [0] + list(config.cutoffs) + [config.vocab_size]
    return [(ends[i], ends[i + 1]) for i in range(len(ends) - 1)]


class DEQTransformerEmbedding(nn.Module):
    """Token embedding scaled by sqrt(d_model); ``div_val > 1``: one smaller table per frequency cluster."""

    def __init__(self, config: DEQTransformerConfig):
        super().__init__()
        self.config = config
        self.scale = config.d_model ** 0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ModuleList()
        if config.div_val == 1:
            self.emb_layers.append(nn.Embedding(config.vocab_size, config.d_embed))
            if config.d_embed != config.d_model:
                self.emb_projs.append(nn.Linear(config.d_embed, config.d_model, bias=False))
        else:
            for i, (lo, hi) in enumerate(_cluster_bounds(config)):
                d = config.d_embed // (config.div_val ** i)
                self.emb_layers.append(nn.Embedding(hi - lo, d))
                self.emb_projs.append(nn.Linear(d, config.d_model, bias=False))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.config.div_val == 1:
            emb = self.emb_layers[0](ids)
            if len(self.emb_projs):
                emb = self.emb_projs[0](emb)
            return emb * self.scale
        flat = ids.reshape(-1)
        out = flat.new_zeros((flat.numel(), self.config.d_model), dtype=self.emb_projs[0].weight.dtype)
        for i, (lo, hi) in enumerate(_cluster_bounds(self.config)):
            idx = ((flat >= lo) & (flat < hi)).nonzero(as_tuple=True)[0]
            if idx.numel():
                out = out.index_copy(0, idx, self.emb_projs[i](self.emb_layers[i](flat[idx] - lo)))
        return out.view(*ids.shape, -1) * self.scale


class DEQTransformerLMHead(nn.Module):
    """Softmax over the vocabulary; adaptive (head + tail clusters) when ``cutoffs`` is non-empty.

    With tied weights the head reads the embedding's tables (only biases and untied projections are its own).
    Returns logits for a plain softmax and full log-probabilities for the adaptive one.
    """

    def __init__(self, config: DEQTransformerConfig, embedding: DEQTransformerEmbedding):
        super().__init__()
        self.config = config
        self.embedding = [embedding]  # a list: not a submodule, its parameters stay registered once
        bounds = _cluster_bounds(config)
        self.n_clusters = len(bounds) - 1
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.empty(self.n_clusters, config.d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(self.n_clusters))
        sizes = [config.vocab_size] if config.div_val == 1 else [hi - lo for lo, hi in bounds]
        dims = [config.d_embed] if config.div_val == 1 else [config.d_embed // config.div_val ** i
                                                             for i in range(len(bounds))]
        # values are drawn by DEQTransformerPreTrainedModel._init_weights
        self.out_biases = nn.ParameterList([nn.Parameter(torch.empty(n)) for n in sizes])
        if not config.tie_weights:
            self.out_weights = nn.ParameterList([nn.Parameter(torch.empty(n, d))
                                                 for n, d in zip(sizes, dims)])
        # projections d_model -> d_i, one per cluster when div_val > 1 (or d_embed != d_model)
        self.out_projs = nn.ParameterDict()
        for i, d in enumerate(dims if config.div_val > 1 else ([config.d_embed] * len(bounds))):
            if d == config.d_model and config.div_val == 1:
                continue
            if not self._proj_tied(i):
                self.out_projs[str(i)] = nn.Parameter(torch.empty(config.d_model, d))

    def _proj_tied(self, i: int) -> bool:
        tie = self.config.tie_projs[i] if i < len(self.config.tie_projs) else False
        return bool(tie) and (self.config.div_val > 1 or self.config.d_embed != self.config.d_model)

    def _weight(self, i: int) -> torch.Tensor:
        if self.config.tie_weights:
            return self.embedding[0].emb_layers[i].weight
        return self.out_weights[i]

    def _proj(self, i: int) -> torch.Tensor | None:
        j = i if self.config.div_val > 1 else 0
        if self._proj_tied(i):
            return self.embedding[0].emb_projs[j].weight
        return self.out_projs[str(i)] if str(i) in self.out_projs else None

    def _logit(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, proj) -> torch.Tensor:
        if proj is not None:
            h = h @ proj  # (.., d_model) @ (d_model, d_i)
        return F.linear(h, weight, bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.n_clusters:
            return self._logit(h, self._weight(0), self.out_biases[0], self._proj(0))
        bounds = _cluster_bounds(self.config)
        if self.config.div_val == 1:
            w_all, b_all = self._weight(0), self.out_biases[0]
            weights = [w_all[lo:hi] for lo, hi in bounds]
            biases = [b_all[lo:hi] for lo, hi in bounds]
        else:
            weights = [self._weight(i) for i in range(len(bounds))]
            biases = list(self.out_biases)
        head_w = torch.cat([weights[0], self.cluster_weight], 0)
        head_b = torch.cat([biases[0], self.cluster_bias], 0)
        head = F.log_softmax(self._logit(h, head_w, head_b, self._proj(0)), dim=-1)
        parts = [head[..., : bounds[0][1]]]
        for i in range(1, len(bounds)):
            # upstream indexes cluster i's log-probability at head[:, -i]
            tail = F.log_softmax(self._logit(h, weights[i], biases[i], self._proj(i)), dim=-1)
            parts.append(head[..., -i, None] + tail)
        return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------------
# f_θ: attention + feed-forward blocks
# --------------------------------------------------------------------------------------------------
def _rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Transformer-XL's relative shift of (B, H, Lq, Lk) scores."""
    b, h, q, k = x.shape
    x = F.pad(x, (1, 0)).view(b, h, k + 1, q)
    return x[:, :, 1:].reshape(b, h, q, k)


# (attention modules of the model collecting, their probabilities) while a forward records attentions
_RECORDING: contextvars.ContextVar[tuple[frozenset, list] | None] = contextvars.ContextVar(
    "deqzoo_deq_transformer_attention_recording", default=None)


class DEQTransformerAttention(nn.Module):
    """Relative-position multi-head attention over [memory, z] with the input injection added to q/k/v."""

    def __init__(self, config: DEQTransformerConfig):
        super().__init__()
        self.config = config
        h, dh, d = config.n_head, config.d_head, config.d_model
        self.torchdeq = config.variant == "torchdeq"
        self.pre_ln = self.torchdeq or config.pre_lnorm
        self.qkv_net = nn.Linear(d, 3 * h * dh, bias=False)
        self.r_net = nn.Linear(d, h * dh, bias=False)
        self.r_w_bias = nn.Parameter(torch.empty(h, dh))  # drawn by _init_weights
        self.r_r_bias = nn.Parameter(torch.empty(h, dh))
        self.o_net = nn.Linear(h * dh, d)
        if self.torchdeq:
            self.ln1 = nn.LayerNorm(d)
            self.ln2 = nn.LayerNorm(h * dh)
        self.dropatt = VariationalDropout(config.dropatt)
        self.drop = VariationalDropout(config.dropout, shared_dims=(1,))

    def _ln(self, x: torch.Tensor, which: str) -> torch.Tensor:
        if self.torchdeq:
            return getattr(self, which)(x)
        return F.layer_norm(x, (x.shape[-1],))  # bai2019: parameter-free

    def forward(self, z, z_hist, u, pos_emb, mask):
        b, q, _ = z.shape
        h, dh = self.config.n_head, self.config.d_head
        cat = torch.cat([z_hist, z], dim=1)
        k = cat.shape[1]
        if self.pre_ln:
            cat = self._ln(cat, "ln1")
        heads = self.qkv_net(cat) + u
        wq, wk, wv = heads.chunk(3, dim=-1)
        wq = wq[:, -q:].reshape(b, q, h, dh)
        wk, wv = wk.reshape(b, k, h, dh), wv.reshape(b, k, h, dh)
        r = self.r_net(pos_emb).reshape(k, h, dh)
        ac = torch.einsum("bind,bjnd->bnij", wq + self.r_w_bias, wk)
        bd = _rel_shift(torch.einsum("bind,jnd->bnij", wq + self.r_r_bias, r))
        score = (ac + bd) * (dh ** -0.5)
        score = score.masked_fill(mask, float("-inf"))
        prob = F.softmax(score, dim=-1)
        recording = _RECORDING.get()
        if recording is not None and self in recording[0]:
            recording[1].append(prob)
        prob = self.dropatt(prob)
        vec = torch.einsum("bnij,bjnd->bind", prob, wv).reshape(b, q, h * dh)
        if self.torchdeq:
            vec = self.ln2(vec)
        out = self.drop(self.o_net(vec))
        return out + z if self.pre_ln else self._ln(out + z, "ln1")


class DEQTransformerFeedForward(nn.Module):
    """Position-wise feed-forward with the variant's LayerNorm placement."""

    def __init__(self, config: DEQTransformerConfig):
        super().__init__()
        self.torchdeq = config.variant == "torchdeq"
        self.pre_ln = self.torchdeq or config.pre_lnorm
        self.ff1_net = nn.Linear(config.d_model, config.d_inner)
        self.ff2_net = nn.Linear(config.d_inner, config.d_model)
        if self.torchdeq:
            self.ln = nn.LayerNorm(config.d_model)
        self.drop1 = VariationalDropout(config.dropout, shared_dims=(1,))
        self.drop2 = VariationalDropout(config.dropout, shared_dims=(1,))

    def _ff(self, x):
        return self.drop2(self.ff2_net(self.drop1(F.relu(self.ff1_net(x)))))

    def forward(self, x):
        if self.torchdeq:
            return x + self._ff(self.ln(x))
        if self.pre_ln:
            x = F.layer_norm(x, (x.shape[-1],))  # bai2019 pre-LN: the residual adds the normalized input
            return x + self._ff(x)
        return F.layer_norm(x + self._ff(x), (x.shape[-1],))


class DEQTransformerBlock(nn.Module):
    def __init__(self, config: DEQTransformerConfig):
        super().__init__()
        self.dec_attn = DEQTransformerAttention(config)
        self.pos_ff = DEQTransformerFeedForward(config)

    def forward(self, z, z_hist, u, pos_emb, mask):
        return self.pos_ff(self.dec_attn(z, z_hist, u, pos_emb, mask))


class DEQTransformerFunction(nn.Module):
    """f_θ(z) = blocks applied in sequence (one block for bai2019, ``n_block`` for torchdeq)."""

    def __init__(self, config: DEQTransformerConfig, n_block: int):
        super().__init__()
        self.blocks = nn.ModuleList([DEQTransformerBlock(config) for _ in range(n_block)])

    def forward(self, z, z_hist, u, pos_emb, mask):
        for block in self.blocks:
            z = block(z, z_hist, u, pos_emb, mask)
        return z


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of relative distances [k-1, ..., 0] (sin features, then cos features)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        return 1 / (10000 ** (torch.arange(0.0, self.d_model, 2.0, device=device) / self.d_model))

    def forward(self, k_len: int) -> torch.Tensor:
        pos = torch.arange(k_len - 1, -1, -1.0, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        x = torch.outer(pos, self.inv_freq)
        return torch.cat([x.sin(), x.cos()], dim=-1)  # (K, d_model)


def causal_memory_mask(q_len: int, m_len: int, local_size: int, device=None) -> torch.Tensor:
    """(1, 1, Lq, Lk) True where attention is forbidden: the future, and beyond the local horizon."""
    k_len = q_len + m_len
    ones = torch.ones(q_len, k_len, device=device)
    mask = torch.triu(ones, diagonal=1 + m_len) > 0
    mask = mask | (torch.tril(ones, diagonal=m_len - (local_size or 1000)) > 0)  # not in place: ONNX
    return mask[None, None]


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------
class DEQTransformerPreTrainedModel(DEQPreTrainedModel):
    config_class = DEQTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DEQTransformerBlock"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Transformer-XL style small normal init (upstream: init_std 0.02, LayerNorm weight 1, attention
        # biases U(±0.05)); every parameter and buffer is drawn here, so a model materialised from the meta
        # device (missing weights) is initialised like one built directly
        if isinstance(module, PositionalEmbedding):  # not saved: rebuilt when loading materialises from meta
            init.copy_(module.inv_freq, module.frequencies(module.inv_freq.device))
        elif isinstance(module, nn.Linear):
            init.normal_(module._parameters.get("weight", module._parameters.get("weight_v")), 0.0, 0.02)
            if module.bias is not None:
                init.zeros_(module.bias)
            if "weight_g" in module._parameters:
                # weight norm is attached to a freshly built Linear: g starts at the row norms of PyTorch's
                # default init, the direction v is the normal(0.02) draw above
                default = nn.init.kaiming_uniform_(torch.empty_like(module.weight_v), a=5**0.5)
                init.copy_(module.weight_g, default.norm(dim=1, keepdim=True))
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            super()._init_weights(module)  # transformers': weight 1, bias 0
        elif isinstance(module, DEQTransformerAttention):
            init.uniform_(module.r_w_bias, -0.05, 0.05)
            init.uniform_(module.r_r_bias, -0.05, 0.05)
        elif isinstance(module, (nn.ParameterList, nn.ParameterDict)):
            # the LM head's lists (met alone: the head itself holds no parameter without clusters): output
            # biases (1-D) start at zero, output weights and projections (2-D) at normal(0.02)
            for p in module.parameters(recurse=False):
                init.zeros_(p) if p.dim() == 1 else init.normal_(p, 0.0, 0.02)
        elif isinstance(module, DEQTransformerLMHead) and module.n_clusters:
            init.zeros_(module.cluster_weight)
            init.zeros_(module.cluster_bias)


class DEQTransformerModel(DEQTransformerPreTrainedModel):
    """The DEQ-Transformer backbone: token ids (+ memory) -> equilibrium states.

    Example:
        >>> import torch
        >>> from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerModel
        >>> cfg = DEQTransformerConfig(vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32)
        >>> model = DEQTransformerModel(cfg).eval()
        >>> out = model(torch.randint(0, 50, (2, 5)))
        >>> out.last_hidden_state.shape, out.past_key_values.z_hist.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 16]))
    """

    def __init__(self, config: DEQTransformerConfig):
        super().__init__(config)
        self.word_emb = DEQTransformerEmbedding(config)
        self.injection = nn.Linear(config.d_model, 3 * config.n_head * config.d_head)
        self.pos_emb = PositionalEmbedding(config.d_model)
        if config.explicit_layers > 0:
            self.layers = nn.ModuleList([DEQTransformerFunction(config, config.n_block)
                                         for _ in range(config.explicit_layers)])
        else:
            self.func = DEQTransformerFunction(config, config.n_block)
            if config.weight_norm:
                apply_norm(self.func, "weight_norm")
            self.deq = DEQ(config.deq_config)
        self.iodrop = VariationalDropout(config.dropout, shared_dims=(1,))
        self.pos_drop = VariationalDropout(config.dropout)
        self.out_drop = VariationalDropout(config.dropout, shared_dims=(1,))
        self.post_init()

    def injection_module(self) -> nn.Module:
        """The module whose output is the DEQ's input injection (what a hypersolver's initializer reads)."""
        return self.injection

    def get_input_embeddings(self) -> nn.Module:
        return self.word_emb.emb_layers[0]

    def set_input_embeddings(self, value: nn.Module) -> None:
        if self.config.div_val != 1:
            raise ValueError("set_input_embeddings needs a single embedding table (div_val=1); this model's "
                             f"adaptive embedding has {len(self.word_emb.emb_layers)} tables (div_val="
                             f"{self.config.div_val})")
        self.word_emb.emb_layers[0] = value

    def _attention_modules(self) -> list[DEQTransformerAttention]:
        return [m for m in self.modules() if isinstance(m, DEQTransformerAttention)]

    def _memory(self, cache: DEQTransformerCache | None, b: int, ref: torch.Tensor):
        c = self.config
        if cache is None or cache.z_hist is None or cache.z_hist.shape[1] == 0:
            return ref.new_zeros(b, 0, c.d_model), ref.new_zeros(b, 0, 3 * c.n_head * c.d_head)
        if cache.z_hist.shape[0] != b or cache.u_hist.shape[:2] != cache.z_hist.shape[:2]:
            raise ValueError(f"past_key_values memory shapes z_hist={tuple(cache.z_hist.shape)}, "
                             f"u_hist={tuple(cache.u_hist.shape)} do not fit a batch of {b}")
        return cache.z_hist, cache.u_hist

    def _initial_state(self, cache, b: int, q: int, ref: torch.Tensor) -> torch.Tensor:
        z0 = ref.new_zeros(b, q, self.config.d_model)
        # incremental decoding (one new token): start at the previous position's equilibrium
        if q == 1 and self.config.fixed_point_reuse and cache is not None and cache.z_last is not None:
            z0 = z0 + cache.z_last
        return z0

    def forward(self, input_ids: torch.LongTensor, past_key_values: DEQTransformerCache | None = None,
                use_cache: bool = True, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None, **kwargs
    ) -> DEQTransformerModelOutput | tuple:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        check_sequence(input_ids, past_key_values)
        capturing = torch.jit.is_tracing() or torch.compiler.is_exporting()  # no branch on values there
        if not capturing and (int(input_ids.max()) >= self.config.vocab_size or int(input_ids.min()) < 0):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}); got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        c = self.config
        b, q = input_ids.shape
        reset_dropout(self)
        if c.weight_norm and c.explicit_layers == 0:
            reset_norm(self.func)
        want_hidden = self._flag(output_hidden_states, "output_hidden_states")
        want_attn = self._flag(output_attentions, "output_attentions")
        emb = self.word_emb(input_ids)
        u_now = self.injection(self.iodrop(emb))
        z_hist, u_hist = self._memory(past_key_values, b, u_now)
        m = z_hist.shape[1]
        u = torch.cat([u_hist, u_now], dim=1)
        pos = self.pos_drop(self.pos_emb(q + m).to(u.dtype))
        mask = causal_memory_mask(q, m, c.local_size, device=u.device)
        z0 = self._initial_state(past_key_values, b, q, u_now)

        jac_loss, hidden, attentions = None, [emb], None
        if c.explicit_layers > 0:
            z = z0
            with self._recording(want_attn) as attentions:
                for layer in self.layers:
                    z = layer(z, z_hist, u, pos, mask)
                    hidden.append(z)
            stats = _explicit_stats(z, len(self.layers))
        else:
            gathered: list = [None, None, None]  # (rows, memory rows, injection rows), per row set

            def f(s, rows=None):  # rows: the sequences still iterating (deqzoo.core.halting.rowwise)
                if rows is None:
                    return self.func(s, z_hist, u, pos, mask)
                if gathered[0] is not rows:
                    gathered[:] = rows, z_hist[rows], u[rows]
                return self.func(s, gathered[1], gathered[2], pos, mask)

            # row-independent in eval mode (no dropout masks shared over the batch): stopped sequences
            # leave f's batch
            z, stats = self.deq(f if self.training else rowwise(f), z0)
            jac_loss = getattr(stats, "jac_loss", None)
            if c.final_f_step:
                with self._recording(want_attn) as attentions:
                    z = f(z)
                stats.nfe += 1
            elif want_attn:
                with self._recording(True) as attentions:
                    f(z)  # the attention of f_θ at the equilibrium (its output is z itself, up to tolerance)
            hidden.append(z)

        cache = None
        if use_cache:
            cache = self._update_memory(past_key_values, z, z_hist, u, q, stats)
        out = DEQTransformerModelOutput(
            last_hidden_state=self.out_drop(z), past_key_values=cache,
            hidden_states=tuple(hidden) if want_hidden else None,
            attentions=tuple(attentions) if want_attn else None, jac_loss=jac_loss, deq_stats=stats)
        return self._output(out, return_dict)

    @contextlib.contextmanager
    def _recording(self, on: bool):
        """Collect the attention probabilities of every f_θ block called inside the block (when `on`)."""
        got: list[torch.Tensor] = []
        if not on:
            yield got
            return
        # the recording lives in this call's context, not on the modules: other threads calling the same
        # model at the same time neither record into this list nor see it
        token = _RECORDING.set((frozenset(self._attention_modules()), got))
        try:
            yield got
        finally:
            _RECORDING.reset(token)

    @torch.no_grad()
    def _update_memory(self, old, z, z_hist, u, q, stats) -> DEQTransformerCache:
        keep = self.config.mem_len
        zs = torch.cat([z_hist, z.detach()], dim=1)
        start = max(0, zs.shape[1] - keep)
        return DEQTransformerCache(z_hist=zs[:, start:], u_hist=u.detach()[:, start:],
                                   z_last=z.detach()[:, -1:], seen=(old.seen if old is not None else 0) + q,
                                   nfe=(old.nfe if old is not None else []) + [int(stats.nfe)])


def _explicit_stats(z: torch.Tensor, layers: int) -> SolverStats:
    zeros = z.new_zeros(z.shape[0]).detach()
    return SolverStats(nfe=layers, abs_residual=zeros, rel_residual=zeros, trace=z.new_zeros(0),
                       converged=torch.ones(z.shape[0], dtype=torch.bool, device=z.device), solver="explicit")


class DEQTransformerForCausalLM(DEQTransformerPreTrainedModel, GenerationMixin):
    """DEQ-Transformer with a (possibly adaptive) softmax head; ``generate()`` reuses memory and fixed points.

    Example:
        >>> import torch
        >>> from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM
        >>> cfg = DEQTransformerConfig(vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32)
        >>> model = DEQTransformerForCausalLM(cfg).eval()
        >>> ids = torch.randint(0, 50, (1, 6))
        >>> out = model(ids, labels=ids)
        >>> out.logits.shape, out.loss.ndim
        (torch.Size([1, 6, 50]), 0)
        >>> model.generate(ids, max_new_tokens=3, do_sample=False).shape
        torch.Size([1, 9])
    """

    def __init__(self, config: DEQTransformerConfig):
        super().__init__(config)
        self.model = DEQTransformerModel(config)
        self.crit = DEQTransformerLMHead(config, self.model.word_emb)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the memory of equilibria is our own cache type

    @torch.no_grad()
    def resize_token_embeddings(self, new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Grow or shrink the vocabulary; returns the (first) input embedding table, like transformers.

        Tokens are added to (or removed from) the end of the vocabulary, i.e. the last cluster of an adaptive
        embedding/softmax; with ``mean_resizing`` new embedding rows start at the mean of the existing rows
        (else N(0, 0.02²)), new output biases at zero. The embedding and the tied softmax stay tied.

        Example:
            >>> import torch
            >>> from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM
            >>> cfg = DEQTransformerConfig(vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32)
            >>> model = DEQTransformerForCausalLM(cfg).eval()
            >>> model.resize_token_embeddings(53).weight.shape, model.config.vocab_size
            (torch.Size([53, 16]), 53)
            >>> model(torch.tensor([[0, 52]])).logits.shape
            torch.Size([1, 2, 53])
        """
        c = self.config
        if pad_to_multiple_of is not None and not isinstance(pad_to_multiple_of, int):
            raise ValueError(  # transformers' message, which its users match
                f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which is not "
                "and integer. Please make sure to pass an integer")
        if new_num_tokens is None:
            return self.get_input_embeddings()
        if pad_to_multiple_of:
            new_num_tokens = -(-new_num_tokens // pad_to_multiple_of) * pad_to_multiple_of
        floor = c.cutoffs[-1] if c.cutoffs else 0
        if new_num_tokens <= floor:
            raise ValueError(f"resize_token_embeddings({new_num_tokens}): an adaptive vocabulary with "
                             f"cutoffs {c.cutoffs} needs more than {floor} tokens (tokens are added to or "
                             "removed from its last cluster)")
        delta = new_num_tokens - c.vocab_size
        emb = self.model.word_emb.emb_layers[-1]
        keep = emb.num_embeddings + min(delta, 0)
        new = nn.Embedding(emb.num_embeddings + delta, emb.embedding_dim, device=emb.weight.device,
                           dtype=emb.weight.dtype)
        new.weight[:keep] = emb.weight[:keep]
        if delta > 0 and mean_resizing:
            new.weight[keep:] = emb.weight.mean(0)
        elif delta > 0:
            nn.init.normal_(new.weight[keep:], 0.0, 0.02)
        self.model.word_emb.emb_layers[-1] = new

        def resized(p: nn.Parameter) -> nn.Parameter:
            out = p.new_zeros((p.shape[0] + delta, *p.shape[1:]))
            out[: min(p.shape[0], out.shape[0])] = p[: out.shape[0]]
            if delta > 0 and p.dim() == 2:
                out[p.shape[0]:] = torch.randn_like(out[p.shape[0]:]) * 0.02
            return nn.Parameter(out, requires_grad=p.requires_grad)

        head = self.crit
        head.out_biases[-1] = resized(head.out_biases[-1])
        if not c.tie_weights:
            head.out_weights[-1] = resized(head.out_weights[-1])
        c.vocab_size = self.vocab_size = new_num_tokens  # both, as transformers' own resize does
        return self.get_input_embeddings()

    def forward(self, input_ids: torch.LongTensor, past_key_values: DEQTransformerCache | None = None,
                labels: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                use_cache: bool = True, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int = 0, **kwargs) -> DEQTransformerCausalLMOutput | tuple:
        """Labels follow the transformers convention: aligned with input_ids, shifted here (-100 ignored)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("DEQTransformerForCausalLM does not support padding (attention_mask has zeros); "
                             "generate one sequence per call or use equal-length prompts")
        out = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                         return_dict=True)
        h = out.last_hidden_state
        if logits_to_keep and labels is None and kwargs.get("shift_labels") is None:
            h = h[:, -logits_to_keep:]
        logits = self.crit(h)
        loss = None
        # transformers' convention: `shift_labels` are aligned with the logits, `labels` with input_ids
        shifted = kwargs.get("shift_labels") is not None
        name, targets = ("shift_labels", kwargs["shift_labels"]) if shifted else ("labels", labels)
        if targets is not None:
            if targets.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(targets.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            scores, targets = (logits, targets) if shifted else (logits[:, :-1], targets[:, 1:])
            loss = F.cross_entropy(scores.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # -100 skipped
        loss = self._add_jac_loss(loss, out.deq_stats, self.config.jac_reg_weight)
        result = DEQTransformerCausalLMOutput(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                              hidden_states=out.hidden_states, attentions=out.attentions,
                                              jac_loss=out.jac_loss, deq_stats=out.deq_stats)
        return self._output(result, return_dict)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      use_cache=True, **kwargs):
        # with memory, only the tokens not yet seen are fed; the memory holds the rest
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.seen:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "use_cache": use_cache,
                "attention_mask": attention_mask, "logits_to_keep": 1}
