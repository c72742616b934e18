"""Looped (recurrent-depth) language models from stock transformers, solved to their fixed point.

A looped LM applies one block of layers many times per token. `LoopedLM` wraps such a model and hands its
recurrent core to deqzoo's solvers as f(z; x), with every token a row of the solve (``(batch, seq)`` are
flattened into rows, so the engine's per-sample stopping is per-token halting), and reports per token the f
calls it needed, its residual, an observed contraction rate, whether it converged and, on request, estimates
of the spectral norm and spectral radius of the core's Jacobian.

What a looped model must expose is the `LoopedCore` protocol: ``prepare`` (embedding / prelude and the
per-call context), ``initial_state`` and ``warm_state`` (where a solve starts), ``step`` (one application of
the core: the solver's f), ``step_slots`` (the KV-cache layers a step writes) and ``head`` (coda / final
norm, before the LM head), plus ``num_steps`` (the model's own loop length). `HrmTextCore` implements it for
transformers' ``HrmTextForCausalLM``; any model with a ``looped_core()`` method returning a `LoopedCore` is
supported the same way (the test suite's Huginn-style fixture does this).

HRM-Text's state is ``z = (z_H, z_L)`` after one full H cycle: f runs ``L_cycles`` L-module steps and one
H-module step. Its own loop (``H_cycles`` cycles from ``z_H = scaled embedding``, ``z_L = z_L_init``) is
therefore the ``fixed_point`` solver with tau = 1 and ``max_iter = H_cycles`` (`LoopedLM.own_loop`): the
solver evaluates f at z_0 .. z_{H-1} and returns its best iterate (z_{H-1} whenever the residuals decrease,
as in every random-init configuration we test), and the output is f at that iterate, which the solver has
already computed (z_H, no extra call). HRM-Text injects its input only through the initial z_H (the
``no_x`` variant): a fixed point of f may forget the token, which is what running it past its own loop
shows.

The KV cache: step k of a solve attends to the earlier tokens' keys of the model's step ``min(k,
num_steps - 1)`` (the model's own schedule, then its last step's map: from there on f does not change) and
writes nothing while the solver iterates; when the solve ends, the keys of each of the model's steps are
committed once (a step the solve did not reach gets the keys of the last step it did, Huginn's "latest"
lookup). Supported: no cache, or transformers' ``DynamicCache`` whose layers are full-attention
``DynamicLayer`` (what ``generate()`` builds for these models). Others are refused with an error naming
their class.

Example:
    >>> import torch
    >>> from transformers import HrmTextConfig, HrmTextForCausalLM
    >>> from deqzoo.integrations.looped_lm import LoopedLM
    >>> _ = torch.manual_seed(0)
    >>> cfg = HrmTextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                     num_attention_heads=2, head_dim=8, H_cycles=2, L_cycles=2)
    >>> model = HrmTextForCausalLM(cfg).eval()
    >>> ids = torch.randint(0, 32, (1, 5))
    >>> own = LoopedLM.own_loop(model)                       # the model's own loop, through the engine
    >>> bool(torch.allclose(own(ids).logits, model(ids).logits, atol=1e-5))
    True
    >>> deq = LoopedLM.from_model(model, solver="anderson", max_iter=40, tol=1e-4)
    >>> out = deq(ids)
    >>> out.nfe.shape, out.converged.dtype                   # per token
    (torch.Size([1, 5]), torch.bool)
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..core import DEQConvergenceError, FixedPointCache, SolverStats, solve
from ..core.solvers import solver_kwarg_names
from ..errors import DeqzooError

__all__ = ["HrmTextCore", "LoopedCausalLMOutput", "LoopedCore", "LoopedLM", "UnsupportedLoopedModelError"]

State = tuple[torch.Tensor, ...]


class UnsupportedLoopedModelError(DeqzooError, TypeError):
    """A model (or a cache) that `LoopedLM` cannot run: the message names its class and what is missing."""


@runtime_checkable
class LoopedCore(Protocol):
    """What a looped model exposes to `LoopedLM` (one implementation per model family).

    Shapes: a state is a tuple of ``(batch, seq, d_i)`` tensors; ``ctx`` is whatever ``prepare`` returns.
    ``cache`` in ``step`` is a read-only view (see `LoopedLM`): the core calls ``cache.update(k, v, idx)``
    exactly as on a transformers cache, with ``idx`` in ``step_slots(k)``.
    """

    num_steps: int  # the model's own number of core steps

    def prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values,
                **kwargs) -> Any:  # fmt: skip
        """Embedding (and prelude, which may write its own cache layers) and per-call context."""

    def initial_state(self, ctx: Any) -> State:
        """The model's own starting state."""

    def warm_state(self, ctx: Any, previous: State) -> State:
        """A starting state from the previous token's fixed point (``previous``: ``(batch, 1, d_i)``)."""

    def step(self, state: State, ctx: Any, cache: Any, k: int) -> State:
        """One application of the recurrent core: the k-th step of the model's loop (k >= num_steps: the
        last one's map)."""

    def step_slots(self, k: int) -> range:
        """The cache layer indices that step k writes."""

    def head(self, state: State, ctx: Any, past_key_values: Cache | None) -> torch.Tensor:
        """Hidden states fed to the LM head (coda, final norm), ``(batch, seq, hidden)``."""


# --------------------------------------------------------------------------------------------- HRM-Text


@dataclass
class _HrmContext:
    embeds: torch.Tensor
    mask: Any
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    position_ids: torch.Tensor


class HrmTextCore:
    """`LoopedCore` of transformers' ``HrmTextForCausalLM``: state ``(z_H, z_L)`` after one H cycle.

    # Adapted from transformers.models.hrm_text.modeling_hrm_text.HrmTextModel.forward (embedding, masks,
    # rotary embeddings, one iteration of the H-cycle loop with its cache-slot layout); pinned by the logit
    # parity tests in tests/integrations/test_looped_lm.py.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.base = model.model
        cfg = model.config
        self.H, self.L, self.P = cfg.H_cycles, cfg.L_cycles, cfg.num_layers_per_stack
        self.num_steps = self.H

    def prepare(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values,
                token_type_ids=None, **kwargs) -> _HrmContext:  # fmt: skip
        from transformers.masking_utils import create_causal_mask

        base = self.base
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = base.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds * base.embedding_scale
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past)[None]
        mask_kwargs = {
            "config": base.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "position_ids": position_ids,
        }
        first = past_key_values is None or not past_key_values.is_initialized
        if token_type_ids is not None and first and base.config.prefix_lm:
            mask_kwargs["block_sequence_ids"] = torch.where(token_type_ids == 1, 0, -1)
        mask = create_causal_mask(**mask_kwargs)
        return _HrmContext(inputs_embeds, mask, base.rotary_emb(inputs_embeds, position_ids), position_ids)

    def initial_state(self, ctx: _HrmContext) -> State:
        e = ctx.embeds
        return e, self.base.z_L_init.to(dtype=e.dtype, device=e.device).expand_as(e).contiguous()

    def warm_state(self, ctx: _HrmContext, previous: State) -> State:
        # z_H carries the token (HRM-Text has no other input injection): only z_L starts warm
        e = ctx.embeds
        return e, previous[1].expand_as(e).contiguous()

    def _offset(self, h: int, l: int) -> int:
        # the stock cache layout: slot(h, l, layer) = (h * (L_cycles + 1) + l) * layers_per_stack + layer
        return (h * (self.L + 1) + l) * self.P

    def step(self, state: State, ctx: _HrmContext, cache: Any, k: int) -> State:
        z_H, z_L = state
        h = min(k, self.H - 1)
        common = {
            "attention_mask": ctx.mask,
            "past_key_values": cache,
            "position_embeddings": ctx.position_embeddings,
            "position_ids": ctx.position_ids,
        }
        for l in range(self.L):
            z_L = self.base.L_module(z_L + z_H, cycle_offset=self._offset(h, l), **common)
        z_H = self.base.H_module(z_H + z_L, cycle_offset=self._offset(h, self.L), **common)
        return z_H, z_L

    def step_slots(self, k: int) -> range:
        h = min(k, self.H - 1)
        return range(self._offset(h, 0), self._offset(h + 1, 0))

    def head(self, state: State, ctx: _HrmContext, past_key_values: Cache | None) -> torch.Tensor:
        return state[0]


def _core_of(model: Any) -> LoopedCore:
    """The `LoopedCore` of a stock model, or an error naming its class and what is missing."""
    cls = type(model).__name__
    if cls == "HrmTextForCausalLM":
        return HrmTextCore(model)
    maker = getattr(model, "looped_core", None)
    if maker is None:
        raise UnsupportedLoopedModelError(
            f"{cls} has no recurrent core that LoopedLM knows: supported are transformers' "
            f"HrmTextForCausalLM and models with a `looped_core()` method returning a "
            f"deqzoo.integrations.looped_lm.LoopedCore "
            f"(num_steps, prepare, initial_state, warm_state, step, step_slots, head)"
        )
    core = maker()
    names = ("num_steps", "prepare", "initial_state", "warm_state", "step", "step_slots", "head")
    missing = [n for n in names if not hasattr(core, n)]
    if missing:
        raise UnsupportedLoopedModelError(
            f"{cls}.looped_core() returned {type(core).__name__}, which lacks {missing} of the LoopedCore "
            f"protocol"
        )
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise UnsupportedLoopedModelError(f"{cls} has no LM head (get_output_embeddings() returned None)")
    return core


# --------------------------------------------------------------------------------------------- the cache


def _check_cache(cache: Any) -> None:
    """Supported: transformers' DynamicCache with full-attention DynamicLayer layers (read by concatenation,
    so a solve can attend to them without writing). Anything else is refused by name."""
    if cache is None:
        return
    if type(cache) is not DynamicCache:
        raise UnsupportedLoopedModelError(
            f"LoopedLM cannot use a {type(cache).__name__} as KV cache: it needs transformers' DynamicCache "
            f"with full-attention DynamicLayer layers, whose keys it can read without writing while the "
            f"solver iterates (a {type(cache).__name__} has no such read-only access); use "
            f"cache_implementation='dynamic' or no cache"
        )
    if getattr(cache, "offloading", False):
        raise UnsupportedLoopedModelError(
            "LoopedLM cannot use an offloading DynamicCache: its layers move to the CPU between uses, and a "
            "solve reads every step's keys on each iteration; use DynamicCache() without offloading"
        )
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
    if bad:
        raise UnsupportedLoopedModelError(
            f"LoopedLM cannot use this DynamicCache: its layers include {sorted(set(bad))}, not "
            f"full-attention DynamicLayer (sliding-window, quantized and offloaded layers drop or transform "
            f"keys, so a solve cannot read the earlier tokens' keys of every step)"
        )


class _SolveView:
    """The cache as a solve sees it: ``update`` returns the earlier tokens' keys with this call's appended and
    writes nothing; the keys of each of the model's steps are remembered (the last call of a step wins) and
    written once by `commit` when the solve is over."""

    def __init__(self, cache: DynamicCache | None, core: LoopedCore):
        self.cache, self.core = cache, core
        self.step = 0
        self.pending: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        s = min(self.step, self.core.num_steps - 1)
        slots = self.core.step_slots(self.step)
        if layer_idx not in slots:
            raise UnsupportedLoopedModelError(
                f"{type(self.core).__name__}.step({self.step}) wrote cache layer {layer_idx}, outside its "
                f"step_slots({self.step}) = {slots}"
            )
        self.pending.setdefault(s, {})[layer_idx - slots[0]] = (key_states, value_states)
        layers = self.cache.layers if self.cache is not None else []
        if layer_idx < len(layers) and layers[layer_idx].is_initialized and layers[layer_idx].keys.numel():
            layer = layers[layer_idx]
            return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)
        return key_states, value_states

    def commit(self) -> None:
        """Write every step's keys (a step the solve did not reach: the last reached step's)."""
        if self.cache is None or not self.pending:
            return
        last = max(self.pending)
        for s in range(self.core.num_steps):
            src = self.pending.get(s, self.pending[last])
            slots = self.core.step_slots(s)
            if len(src) != len(slots):
                raise UnsupportedLoopedModelError(
                    f"{type(self.core).__name__}.step wrote {len(src)} cache layers, but step_slots({s}) "
                    f"names {len(slots)}: {slots}"
                )
            for j, idx in enumerate(slots):
                self.cache.update(*src[j], idx)


# --------------------------------------------------------------------------------------------- outputs


@dataclass
class LoopedCausalLMOutput(CausalLMOutputWithPast):
    """The stock ``CausalLMOutputWithPast`` plus, per token ``(batch, seq)``: ``nfe`` (f calls until the
    token's residual fell below tol, else all the solve made), ``residual`` (at the returned state, in the
    stop mode), ``residual_ratio`` (the token's last residual over the one before: the observed contraction
    rate of the solver, for ``fixed_point`` the core's contraction, < 1 when the iteration contracts; NaN
    with one call), ``jacobian_norm`` (with ``jacobian_steps`` > 0: a power-iteration estimate of the
    spectral norm of f's Jacobian at the answer) and ``spectral_radius`` (likewise, of its spectral radius:
    < 1 is local contraction; both exact per token when each row is one token, as in decoding; NaN without
    ``jacobian_steps``), ``converged``; ``state`` (the core's state the logits come from, a tuple of
    ``(batch, seq, d_i)``, detached) and ``solver_stats`` (the engine's `SolverStats`, rows = tokens)."""

    nfe: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    residual_ratio: torch.Tensor | None = None
    jacobian_norm: torch.Tensor | None = None
    spectral_radius: torch.Tensor | None = None
    converged: torch.Tensor | None = None
    state: tuple[torch.Tensor, ...] | None = None
    solver_stats: SolverStats | None = None


class _Recorder:
    """f as the engine sees it (rows = tokens), counting steps for the cache schedule and keeping per token
    the first call whose residual is below tol (the engine freezes it there) and the last two residuals."""

    def __init__(self, core, ctx, view, shape, tol, rel):
        self.core, self.ctx, self.view, self.shape = core, ctx, view, shape
        self.tol, self.rel = tol, rel
        rows = shape[0] * shape[1]
        self.calls = 0
        self.first_below = torch.zeros(rows, dtype=torch.long)
        self.r_prev = torch.full((rows,), math.nan, dtype=torch.float64)
        self.r_last = torch.full((rows,), math.nan, dtype=torch.float64)
        self.last: tuple[State, State] | None = None

    def to_seq(self, rows: State) -> State:
        return tuple(t.reshape(*self.shape, t.shape[-1]) for t in rows)

    def to_rows(self, seq: State) -> State:
        return tuple(t.reshape(-1, t.shape[-1]) for t in seq)

    def evaluate(self, rows: State) -> State:
        self.view.step = self.calls
        out = self.to_rows(self.core.step(self.to_seq(rows), self.ctx, self.view, self.calls))
        self.calls += 1
        return out

    def __call__(self, rows: State) -> State:
        out = self.evaluate(rows)
        self.last = (rows, out)
        with torch.no_grad():
            d = torch.sqrt(sum(torch.linalg.vector_norm(o - r, dim=1, dtype=torch.float64) ** 2
                               for o, r in zip(out, rows)))  # fmt: skip
            n = torch.sqrt(sum(torch.linalg.vector_norm(o, dim=1, dtype=torch.float64) ** 2 for o in out))
            self.last_abs, self.last_rel = d, d / (n + 1e-12)  # the engine's residuals (`_kernels.track`)
            r = (self.last_rel if self.rel else d).cpu()
        active = self.first_below == 0
        self.r_prev = torch.where(active, self.r_last, self.r_prev)
        self.r_last = torch.where(active, r, self.r_last)
        self.first_below = torch.where(active & (r < self.tol), self.calls, self.first_below)
        return out


# --------------------------------------------------------------------------------------------- the adapter


class LoopedLM(PreTrainedModel, GenerationMixin):
    """A stock looped LM whose recurrent core runs through deqzoo's solvers (see the module docstring).

    Build it with `LoopedLM.from_model` (solver settings) or `LoopedLM.own_loop` (the model's own loop as the
    ``fixed_point`` solver). It is a transformers ``PreTrainedModel`` with ``generate()``, usable in
    ``pipeline("text-generation", model=looped, tokenizer=...)``; its forward returns a
    `LoopedCausalLMOutput`. The wrapped model's weights are shared, not copied.

    ``answer``: "best" (default) computes the logits from f at the solver's lowest-residual iterate per token
    (the engine's answer); "last" from f at the last point the solver evaluated (a token the solver froze:
    its converged point), which is what a fixed-step loop returns (`own_loop` uses it). Either way the
    residual, converged flag and state in the output describe the point the logits come from, and the
    output step costs no extra call when f was last evaluated there.

    ``warm_start=True``: in generation, each new token's solve starts from the previous token's fixed point
    (kept per KV-cache object in a `deqzoo.core.FixedPointCache`; the core decides which parts of the state
    start warm). ``on_nonconvergence``: "ignore" (flags in the output only), "warn" or "raise"
    (`deqzoo.core.DEQConvergenceError` carrying the stats). ``log_stats=True`` appends each forward's
    per-token (nfe, residual, converged) to ``self.stats_log``.

    ``jacobian_steps=n`` > 0: per token, estimates of the spectral norm and spectral radius of f's Jacobian
    at the answer from n power-iteration steps (each about three f calls' work, on the math attention
    kernel; exact per token in decoding); they are in the output as ``jacobian_norm`` / ``spectral_radius``.

    Training: the solve builds no graph; with autograd enabled the output step f(z*) is re-evaluated with
    gradient (a one-step, Jacobian-free gradient, as HRM's own 1-step training), costing one more f call.
    """

    # whatever attention the wrapped model runs, this wrapper accepts (it runs the wrapped model's layers);
    # transformers re-checks the shared config's attention choice on construction, which must not change it
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, model: PreTrainedModel, core: LoopedCore | None = None, *, solver: str = "anderson",
                 max_iter: int = 30, tol: float = 1e-4, stop_mode: str = "rel",
                 solver_kwargs: dict | None = None, warm_start: bool = False,
                 on_nonconvergence: str = "ignore", log_stats: bool = False,
                 answer: str = "best", jacobian_steps: int = 0):  # fmt: skip
        core = core if core is not None else _core_of(model)
        from ..core.solvers import get_solver
        from ..core.solvers._contract import _check_solve_args

        get_solver(solver)  # unknown names fail here, listing the registered solvers
        _check_solve_args(max_iter, tol, stop_mode)
        solver_kwargs = dict(solver_kwargs or {})
        known = solver_kwarg_names(solver)
        if known is not None and set(solver_kwargs) - known:
            extra = sorted(set(solver_kwargs) - known)
            raise ValueError(f"solver {solver!r} does not take {extra}; it takes {sorted(known)}")
        if answer not in ("best", "last"):
            raise ValueError(f"answer must be 'best' or 'last', got {answer!r}")
        if on_nonconvergence not in ("ignore", "warn", "raise"):
            raise ValueError(
                f"on_nonconvergence must be 'ignore', 'warn' or 'raise', got {on_nonconvergence!r}"
            )
        attn = model.config._attn_implementation
        super().__init__(model.config)
        if model.config._attn_implementation != attn:  # never change the wrapped model's behaviour
            raise RuntimeError(f"LoopedLM changed {type(model).__name__}'s attention implementation to "
                               f"{model.config._attn_implementation!r} (was {attn!r})")  # fmt: skip
        self.model = model
        self.core = core
        self.generation_config = model.generation_config
        if hasattr(model, "create_masks_for_generate"):
            self.create_masks_for_generate = model.create_masks_for_generate
        self.solver, self.max_iter, self.tol, self.stop_mode = solver, max_iter, tol, stop_mode
        self.solver_kwargs = solver_kwargs
        self.warm_start, self.on_nonconvergence, self.log_stats = warm_start, on_nonconvergence, log_stats
        self.answer = answer
        if isinstance(jacobian_steps, bool) or not isinstance(jacobian_steps, int) or jacobian_steps < 0:
            raise ValueError(f"jacobian_steps must be an integer >= 0, got {jacobian_steps!r}")
        self.jacobian_steps = jacobian_steps
        self.stats_log: list[dict[str, torch.Tensor]] = []
        self._warm = FixedPointCache()
        self._warm_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.eval() if not model.training else self.train()

    @classmethod
    def from_model(cls, model: PreTrainedModel, **settings) -> LoopedLM:
        """Wrap `model` with solver settings (``solver``, ``max_iter``, ``tol``, ``stop_mode``,
        ``solver_kwargs``, ``answer``, ``warm_start``, ``on_nonconvergence``, ``log_stats``,
        ``jacobian_steps``, ``core``)."""
        return cls(model, **settings)

    @classmethod
    def own_loop(cls, model: PreTrainedModel, **settings) -> LoopedLM:
        """The model's own loop through the engine: ``fixed_point``, tau = 1, ``max_iter = num_steps``, a
        tolerance no token reaches (every token takes exactly the model's steps) and ``answer="last"`` (a
        fixed-step loop returns its last point, not its lowest-residual one)."""
        core = settings.pop("core", None) or _core_of(model)
        settings = {"solver": "fixed_point", "max_iter": core.num_steps, "tol": 1e-30, "stop_mode": "abs",
                    "answer": "last", **settings}  # fmt: skip
        return cls(model, core, **settings)

    # transformers plumbing: the wrapped model's embeddings and head are this model's
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def _init_weights(self, module):  # the wrapped model is initialised (or loaded) already
        pass

    def save_pretrained(self, *args, **kwargs):
        """Saves the wrapped model (a stock checkpoint its own class loads); the solver settings are not
        part of it: wrap the loaded model again."""
        return self.model.save_pretrained(*args, **kwargs)

    def _warm_key(self, cache: Cache) -> str:
        key = self._warm_keys.get(cache)
        if key is None:
            key = f"cache-{id(cache)}-{len(self._warm_keys)}"
            self._warm_keys[cache] = key
            weakref.finalize(cache, self._warm.clear, key)
        return key

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        token_type_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> LoopedCausalLMOutput:
        kwargs.pop("return_dict", None)
        asked = [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)]
        if asked:  # the solve's intermediate layers are not one forward's: refuse rather than return nothing
            raise ValueError(
                f"LoopedLM does not return {asked}: per-token solve statistics are in its output"
            )
        _check_cache(past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        ctx = self.core.prepare(input_ids, inputs_embeds, attention_mask, position_ids, past_key_values,
                                token_type_ids=token_type_ids)  # fmt: skip
        z0 = self.core.initial_state(ctx)
        batch, seq = z0[0].shape[:2]
        warm_key, warm_hit = None, False
        if self.warm_start and past_key_values is not None:
            warm_key = self._warm_key(past_key_values)
            default = torch.zeros(batch, sum(t.shape[-1] for t in z0), dtype=z0[0].dtype, device=z0[0].device)
            prev = self._warm.initial(warm_key, default)
            if prev is not default:
                warm_hit = True
                z0 = self.core.warm_state(
                    ctx, tuple(p[:, None] for p in prev.split([t.shape[-1] for t in z0], 1))
                )
        view = _SolveView(past_key_values, self.core)
        rec = _Recorder(self.core, ctx, view, (batch, seq), self.tol, self.stop_mode == "rel")
        with torch.no_grad():
            z_rows, stats = solve(rec, rec.to_rows(tuple(t.detach() for t in z0)), solver=self.solver,
                                  max_iter=self.max_iter, tol=self.tol, stop_mode=self.stop_mode,
                                  **self.solver_kwargs)  # fmt: skip
        z_rows = tuple(z_rows) if isinstance(z_rows, (tuple, list)) else (z_rows,)
        if self.answer == "last":  # the last point f saw (a token frozen by the solver: its converged point)
            z_rows = rec.last[0]
            stats = replace(stats, abs_residual=rec.last_abs.to(stats.abs_residual),
                            rel_residual=rec.last_rel.to(stats.rel_residual))  # fmt: skip
            stats.converged = (stats.residual.double().cpu() < self.tol).to(torch.bool)
        # the output is f at the answer: already computed when that is the last point f saw
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        at_last = all(bool(torch.equal(a, b)) for a, b in zip(z_rows, rec.last[0]))
        if at_last and not needs_grad:
            out_rows = rec.last[1]
        else:
            out_rows = rec.evaluate(z_rows)
        jac = self._jacobian(rec, ctx, past_key_values, z_rows) if self.jacobian_steps else None
        view.commit()
        z_out = rec.to_seq(out_rows)
        if warm_key is not None:
            self._warm.store(warm_key, torch.cat([t[:, -1] for t in z_out], -1).detach())
        hidden = self.core.head(z_out, ctx, past_key_values)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        logits = self.model.get_output_embeddings()(hidden)
        loss = None
        if labels is not None:
            loss = self.model.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        nfe_rows = torch.where(
            rec.first_below > 0, rec.first_below, torch.full_like(rec.first_below, rec.calls)
        )
        per_token = {
            "nfe": nfe_rows.reshape(batch, seq),
            "residual": stats.residual.detach().reshape(batch, seq),
            "residual_ratio": (rec.r_last / rec.r_prev).reshape(batch, seq),
            "converged": stats.converged.reshape(batch, seq),
        }
        nan = torch.full((batch, seq), math.nan, dtype=torch.float64)
        per_token["jacobian_norm"] = jac[0].reshape(batch, seq) if jac else nan
        per_token["spectral_radius"] = jac[1].reshape(batch, seq) if jac else nan.clone()
        stats.extra["warm_start"] = warm_hit
        self._report(stats)
        if self.log_stats:
            self.stats_log.append({k: v.cpu() for k, v in per_token.items()})
        return LoopedCausalLMOutput(loss=loss, logits=logits, past_key_values=past_key_values,
                                    state=tuple(t.detach() for t in z_out), solver_stats=stats,
                                    **per_token)  # fmt: skip

    def _jacobian(
        self, rec: _Recorder, ctx: Any, cache: Cache | None, z_rows: State
    ) -> tuple[torch.Tensor, ...]:
        """Per token, estimates of the spectral norm and the spectral radius of J, f's Jacobian at z_rows (f:
        the model's last step map), from ``jacobian_steps`` steps of two power iterations started from a fixed
        random direction: on JᵀJ (sqrt of its Rayleigh growth: sigma_max) and on J (the geometric mean of
        the growth over the last half of the steps: rho, as Gelfand's formula; robust to complex pairs).
        J v comes from differentiating a VJP (double backward), Jᵀ w from a VJP, on one graph of f. Each
        token's block is normalised on its own: exact when a row is one token (decoding)."""
        view = _SolveView(cache, self.core)  # read-only: never committed
        view.step = self.core.num_steps - 1

        def row_norm(ts):
            return torch.sqrt(sum(torch.linalg.vector_norm(t, dim=1, dtype=torch.float64) ** 2 for t in ts))

        def unit(ts):
            n = row_norm(ts).clamp_min(1e-300)
            return tuple((t / n[:, None].to(t.dtype)).detach() for t in ts)

        from torch.nn.attention import SDPBackend, sdpa_kernel

        gen = torch.Generator(device="cpu").manual_seed(0)
        v = unit(tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in z_rows))
        u = v
        sigma = torch.full((z_rows[0].shape[0],), math.nan, dtype=torch.float64)
        logs = []
        # the math attention kernel: J v differentiates a backward pass, which the fused kernels cannot
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            z = tuple(t.detach().requires_grad_(True) for t in z_rows)
            fz = rec.to_rows(self.core.step(rec.to_seq(z), ctx, view, self.core.num_steps - 1))
            probe = tuple(torch.zeros_like(t, requires_grad=True) for t in fz)
            jt_probe = torch.autograd.grad(fz, z, probe, create_graph=True)  # Jᵀ probe, linear in probe

            def jvp(x):
                return torch.autograd.grad(jt_probe, probe, x, retain_graph=True)

            def vjp(w):
                return torch.autograd.grad(fz, z, w, retain_graph=True)

            for _ in range(self.jacobian_steps):
                w = vjp(jvp(v))
                sigma = torch.sqrt(row_norm(w)).cpu()  # |v| = 1: |JᵀJ v| -> sigma_max²
                v = unit(w)
                ju = jvp(u)
                logs.append(torch.log(row_norm(ju).clamp_min(1e-300)).cpu())
                u = unit(ju)
        tail = logs[len(logs) // 2 :]
        rho = torch.exp(torch.stack(tail).mean(0)) if tail else sigma.clone()
        return sigma, rho

    def _report(self, stats: SolverStats) -> None:
        if self.on_nonconvergence == "ignore" or stats.all_converged:
            return
        n, total = int((~stats.converged).sum()), stats.converged.numel()
        msg = (f"LoopedLM: {n} of {total} tokens did not converge ({stats.solver}, max_iter={self.max_iter}, "
               f"tol={self.tol:g}, largest residual {float(stats.residual.max()):.3g})")  # fmt: skip
        if self.on_nonconvergence == "raise":
            raise DEQConvergenceError(msg, stats)
        warnings.warn(msg, stacklevel=3)
