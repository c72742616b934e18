"""A tiny Huginn-style looped LM (Geiping et al. 2025, "Scaling up test-time compute with latent reasoning"),
re-implemented for the tests from the structure of seal-rg/recurrent-pretraining's
``recpre/raven_modeling_minimal.py`` (read, not copied): a prelude of sandwich blocks, a recurrent core that
injects the prelude's output by concatenation through a linear adapter, ``ln_f`` after the recurrence, a
coda, ``ln_f`` again and the LM head. Differences from the original, on purpose: the latent state starts
at zero (the original's ``init_values["std"] = 0`` branch; its default is random), no test-time noise, a
fixed step count (``mean_recurrence``; the original samples it in training), a real-valued rotary embedding,
and transformers' ``DynamicCache`` with one layer per (block, step) instead of its own cache classes: layer
``i`` for prelude block i, ``P + k·C + j`` for core block j at step k, ``P + C·n + i`` for coda block i.

It exposes its recurrent core to `deqzoo.integrations.looped_lm.LoopedLM` through ``looped_core()``
(`TinyHuginnCore`, the `LoopedCore` protocol), as HRM-Text does through `HrmTextCore`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast


class TinyHuginnConfig(PretrainedConfig):
    model_type = "tiny_huginn_fixture"

    def __init__(self, vocab_size=64, n_embd=32, num_attention_heads=4, n_layers_in_prelude=1,
                 n_layers_in_recurrent_block=2, n_layers_in_coda=1, mean_recurrence=4, norm_eps=1e-6,
                 embed_scale=1.0, rope_base=10000.0, initializer_range=0.02, use_cache=True,
                 **kwargs):  # fmt: skip
        self.vocab_size, self.n_embd, self.num_attention_heads = vocab_size, n_embd, num_attention_heads
        self.n_layers_in_prelude, self.n_layers_in_recurrent_block = (
            n_layers_in_prelude,
            n_layers_in_recurrent_block,
        )
        self.n_layers_in_coda, self.mean_recurrence, self.norm_eps = (
            n_layers_in_coda,
            mean_recurrence,
            norm_eps,
        )
        self.embed_scale, self.rope_base, self.initializer_range = embed_scale, rope_base, initializer_range
        self.use_cache = use_cache
        # one cache layer per attention invocation of the model's own forward (DynamicCache(config=...))
        self.num_hidden_layers = (
            n_layers_in_prelude + n_layers_in_recurrent_block * mean_recurrence + n_layers_in_coda
        )
        self.hidden_size = n_embd
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of x (B, heads, S, hd) at positions (S,), rotate-half form."""
    hd = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd))
    ang = positions.to(torch.float64)[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype),
        torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype),
    )
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, config: TinyHuginnConfig):
        super().__init__()
        self.n_head, self.hd, self.base = (
            config.num_attention_heads,
            config.n_embd // config.num_attention_heads,
            config.rope_base,
        )
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, positions, idx, cache):
        B, S, E = x.shape
        q, k, v = (t.view(B, S, self.n_head, self.hd).transpose(1, 2) for t in self.Wqkv(x).split(E, -1))
        q, k = _rope(q, positions, self.base), _rope(k, positions, self.base)
        if cache is not None:
            k, v = cache.update(k, v, idx)
        T = k.shape[-2]  # queries are the last S of the T keys: causal, aligned bottom-right
        mask = torch.ones(S, T, dtype=torch.bool, device=x.device).tril(T - S)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, S, E))


class SandwichBlock(nn.Module):
    def __init__(self, config: TinyHuginnConfig):
        super().__init__()
        d, eps = config.n_embd, config.norm_eps
        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = (RMSNorm(d, eps) for _ in range(4))
        self.attn = Attention(config)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, positions, idx, cache):
        x = self.norm_2(self.attn(self.norm_1(x), positions, idx, cache) + x)
        a, b = self.fc(self.norm_3(x)).chunk(2, -1)
        return self.norm_4(self.mlp_proj(nn.functional.silu(a) * b) + x)


class TinyHuginnForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TinyHuginnConfig
    base_model_prefix = "transformer"
    _supports_sdpa = True

    def __init__(self, config: TinyHuginnConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)
        self.core_block = nn.ModuleList(
            SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)
        )
        self.coda = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda))
        self.ln_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    # the stock forward: the model's own loop, written out as the original does
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, labels=None, **kwargs):  # fmt: skip
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=cfg)
        e, positions = self._prelude(input_ids, past_key_values)
        P, C, n = cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block, cfg.mean_recurrence
        x = torch.zeros_like(e)
        for k in range(n):
            x = self.adapter(torch.cat([x, e], -1))
            for j, block in enumerate(self.core_block):
                x = block(x, positions, P + k * C + j, past_key_values)
        x = self._coda(self.ln_f(x), positions, past_key_values)
        x = x[:, -logits_to_keep:] if logits_to_keep else x
        return CausalLMOutputWithPast(logits=self.lm_head(x), past_key_values=past_key_values)

    def _prelude(self, input_ids, cache):
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
        e = self.wte(input_ids) * self.config.embed_scale
        for i, block in enumerate(self.prelude):
            e = block(e, positions, i, cache)
        return e, positions

    def _coda(self, x, positions, cache):
        cfg = self.config
        first = cfg.n_layers_in_prelude + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence
        for i, block in enumerate(self.coda):
            x = block(x, positions, first + i, cache)
        return self.ln_f(x)

    def looped_core(self) -> TinyHuginnCore:
        return TinyHuginnCore(self)


@dataclass
class _Ctx:
    embeds: torch.Tensor
    positions: torch.Tensor


class TinyHuginnCore:
    """The fixture's `LoopedCore`: state = the latent x; f(x) = core blocks(adapter([x, e]))."""

    def __init__(self, model: TinyHuginnForCausalLM):
        self.model = model
        cfg = model.config
        self.P, self.C, self.num_steps = (
            cfg.n_layers_in_prelude,
            cfg.n_layers_in_recurrent_block,
            cfg.mean_recurrence,
        )

    def prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, **kwargs):
        if inputs_embeds is not None:
            raise ValueError("the Huginn fixture takes input_ids only")
        e, positions = self.model._prelude(
            input_ids, past_key_values
        )  # the prelude writes its own cache layers
        return _Ctx(e, positions)

    def initial_state(self, ctx):
        return (torch.zeros_like(ctx.embeds),)

    def warm_state(self, ctx, previous):
        return (previous[0].expand_as(ctx.embeds).contiguous(),)

    def step(self, state, ctx, cache, k):
        x = self.model.adapter(torch.cat([state[0], ctx.embeds], -1))
        first = self.step_slots(k)[0]
        for j, block in enumerate(self.model.core_block):
            x = block(x, ctx.positions, first + j, cache)
        return (x,)

    def step_slots(self, k):
        s = min(k, self.num_steps - 1)
        return range(self.P + s * self.C, self.P + (s + 1) * self.C)

    def head(self, state, ctx, past_key_values):
        return self.model._coda(self.model.ln_f(state[0]), ctx.positions, past_key_values)
