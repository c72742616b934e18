"""Configuration of the DEQ-Transformer language model (Bai et al. 2019 and TorchDEQ's redesign)."""

from __future__ import annotations

from typing import Any

from ...modeling_utils import DEQPretrainedConfig

VARIANTS = ("bai2019", "torchdeq")


class DEQTransformerConfig(DEQPretrainedConfig):
    """Hyperparameters of a DEQ-Transformer LM.

    Two variants of one model:

    * ``variant="bai2019"``: locuslab/deq DEQ-Sequence. One weight-tied decoder block with relative positional
      attention (Transformer-XL), input injection added to the q/k/v projections, parameter-free LayerNorm
      after
      each residual (or before each sublayer with ``pre_lnorm=True``).
    * ``variant="torchdeq"``: TorchDEQ deq-lm (paper, appendix E). Pre-LN with affine LayerNorms, a LayerNorm
      after attention (before the output projection), and ``n_block`` blocks composed into one f_θ.

    ``explicit_layers > 0`` turns the model into its explicit (not weight-tied) counterpart: that many
    distinct
    blocks applied once each, no solve. It is the baseline of the published checkpoint.

    Args:
        vocab_size: number of tokens.
        d_model, n_head, d_head, d_inner: widths (``n_head * d_head`` heads; ``d_inner`` the feed-forward
        width).
        d_embed: embedding width (defaults to d_model; projected to d_model when different).
        cutoffs, div_val: adaptive embedding and softmax (``cutoffs=[]`` means a plain softmax).
        tie_weights, tie_projs: share output weights/projections with the embedding (as upstream).
        tgt_len, mem_len: training segment length and number of past equilibria kept as memory.
        local_size: attention horizon (0 means upstream's default 1000).
        dropout, dropatt: variational dropout rates (masks fixed during one solve).
        weight_norm: weight-normalize f_θ's linear layers (``deqzoo.core.norm``).
        jac_reg_weight: weight of the Jacobian regularizer in the training loss; also set
            ``deq={"jac_reg_samples": 1}`` so the engine computes it.
        fixed_point_reuse: during incremental decoding, start each solve at the previous position's fixed
        point.
        final_f_step: apply f once more to the solver's answer (TorchDEQ's solvers return f(best iterate), so
            converted TorchDEQ models set this; a no-op at an exact fixed point, +1 NFE).
        deq: solver settings (a DEQConfig dict).

    Example:
        >>> from deqzoo.models.deq_transformer import DEQTransformerConfig
        >>> cfg = DEQTransformerConfig(variant="torchdeq", n_block=2, vocab_size=100, d_model=32,
        ...                            n_head=2, d_head=16)
        >>> cfg.n_block, cfg.deq_config.f_solver
        (2, 'anderson')
    """

    model_type = "deq_transformer"
    # transformers' generic names (read by its common tests, pipelines and generation utilities)
    attribute_map = {"num_attention_heads": "n_head", "hidden_size": "d_model"}
    # checked before __init__ runs (deqzoo.modeling_utils.check_config_values); the size budget does the rest
    value_ranges = {
        "vocab_size": (1, 10_000_000), "d_model": (1, 65536), "n_head": (1, 1024), "d_head": (1, 65536),
        "d_inner": (1, 1 << 20), "d_embed": (1, 65536), "n_block": (1, 64), "explicit_layers": (0, 1024),
        "cutoffs": (1, 10_000_000), "div_val": (1, 64), "tgt_len": (1, 1 << 20), "mem_len": (0, 1 << 20),
        "local_size": (0, 1 << 20), "dropout": (0.0, 1.0), "dropatt": (0.0, 1.0),
        "jac_reg_weight": (0.0, None),
    }

    def __init__(
        self,
        vocab_size: int = 1024,
        d_model: int = 128,
        n_head: int = 4,
        d_head: int = 32,
        d_inner: int = 512,
        d_embed: int | None = None,
        variant: str = "bai2019",
        pre_lnorm: bool = False,
        n_block: int = 1,
        explicit_layers: int = 0,
        cutoffs: list[int] | None = None,
        div_val: int = 1,
        tie_weights: bool = True,
        tie_projs: list[bool] | None = None,
        tgt_len: int = 64,
        mem_len: int = 64,
        local_size: int = 0,
        dropout: float = 0.0,
        dropatt: float = 0.0,
        weight_norm: bool = False,
        jac_reg_weight: float = 0.0,
        fixed_point_reuse: bool = True,
        final_f_step: bool = False,
        deq: dict[str, Any] | None = None,
        **kwargs,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"DEQTransformerConfig.variant={variant!r}; choose one of {VARIANTS}")
        cutoffs = list(cutoffs or [])
        if cutoffs and (sorted(cutoffs) != cutoffs or cutoffs[-1] >= vocab_size or cutoffs[0] <= 0):
            raise ValueError(f"DEQTransformerConfig.cutoffs={cutoffs} must increase within "
                             f"(0, vocab_size={vocab_size})")
        if variant == "bai2019" and n_block != 1:
            raise ValueError(f"DEQTransformerConfig.n_block={n_block}: the bai2019 variant has one block")
        sizes = (("d_model", d_model), ("n_head", n_head), ("d_head", d_head), ("d_inner", d_inner))
        for name, value in sizes:
            if value < 1:
                raise ValueError(f"DEQTransformerConfig.{name} must be >= 1, got {value}")
        if n_head * d_head != d_model:
            # the residual adds attention output (n_head*d_head -> d_model) to z; the injection adds to q/k/v
            # of z
            raise ValueError(f"DEQTransformerConfig: n_head*d_head ({n_head}*{d_head}) must equal "
                             f"d_model ({d_model})")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.d_inner = d_inner
        self.d_embed = d_embed or d_model
        self.variant = variant
        self.pre_lnorm = pre_lnorm
        self.n_block = n_block
        self.explicit_layers = explicit_layers
        self.cutoffs = cutoffs
        self.div_val = div_val
        self.tie_weights = tie_weights
        self.tie_projs = list(tie_projs) if tie_projs is not None else [False] * (len(cutoffs) + 1)
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.local_size = local_size
        self.dropout = dropout
        self.dropatt = dropatt
        self.weight_norm = weight_norm
        self.jac_reg_weight = jac_reg_weight
        self.fixed_point_reuse = fixed_point_reuse
        self.final_f_step = final_f_step
        kwargs.setdefault("tie_word_embeddings", False)  # tying is done inside the head (no duplicated keys)
        super().__init__(deq=deq, **kwargs)


_TINY = dict(vocab_size=1024, d_model=128, n_head=4, d_head=32, tgt_len=64, mem_len=64)
_DEQ = {"f_solver": "anderson", "f_max_iter": 30, "f_tol": 1e-3, "b_mode": "ift", "b_max_iter": 12,
        "b_tol": 1e-4}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deq-transformer-tiny": {
        "task": "text-generation",
        "auto": "AutoModelForCausalLM",
        "config": {**_TINY, "d_inner": 512, "variant": "bai2019", "pre_lnorm": True, "deq": _DEQ},
        "description": "Bai et al. (2019) DEQ-Transformer, one pre-LN weight-tied block, d_model 128 (pydoc)",
    },
    "deq-transformer-torchdeq-tiny": {
        "task": "text-generation",
        "auto": "AutoModelForCausalLM",
        "config": {**_TINY, "d_inner": 256, "variant": "torchdeq", "n_block": 2, "deq": _DEQ},
        "description": "TorchDEQ's redesigned DEQ-Transformer (pre-LN, post-attention LN), two blocks in f",
    },
    "deq-transformer-wt103": {
        "task": "text-generation",
        "auto": "AutoModelForCausalLM",
        "config": {"vocab_size": 267735, "d_model": 700, "n_head": 10, "d_head": 70, "d_inner": 48000,
                   "variant": "bai2019", "cutoffs": [20000, 40000, 200000], "div_val": 4, "tgt_len": 150,
                   "mem_len": 150, "weight_norm": True, "tie_projs": [False, True, True, True],
                   "deq": {"f_solver": "anderson", "f_max_iter": 30, "f_tol": 1e-3}},
        "description": "locuslab/deq DEQ-Sequence WikiText-103 (adaptive embedding/softmax); convert weights",
    },
}
