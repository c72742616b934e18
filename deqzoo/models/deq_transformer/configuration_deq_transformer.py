"""Configuration of the DEQ-Transformer language model (Bai et al. 2019 and TorchDEQ's redesign)."""

from typing import Any, Literal

from ...configuration_utils import ConfigError, DEQPretrainedConfig, preset, ranged, strict_config


@strict_config
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

    vocab_size: int = ranged(1, 10_000_000, default=1024)
    d_model: int = ranged(1, 65536, default=128)
    n_head: int = ranged(1, 1024, default=4)
    d_head: int = ranged(1, 65536, default=32)
    d_inner: int = ranged(1, 1 << 20, default=512)
    d_embed: int | None = ranged(1, 65536, default=None)
    variant: Literal["bai2019", "torchdeq"] = "bai2019"
    pre_lnorm: bool = False
    n_block: int = ranged(1, 64, default=1)
    explicit_layers: int = ranged(0, 1024, default=0)
    cutoffs: list[int] | tuple[int, ...] | None = ranged(1, 10_000_000, default=None)
    div_val: int = ranged(1, 64, default=1)
    tie_weights: bool = True
    tie_projs: list[bool] | tuple[bool, ...] | None = ranged(default=None)
    tgt_len: int = ranged(1, 1 << 20, default=64)
    mem_len: int = ranged(0, 1 << 20, default=64)
    local_size: int = ranged(0, 1 << 20, default=0)
    dropout: float | int = ranged(0.0, 1.0, default=0.0)
    dropatt: float | int = ranged(0.0, 1.0, default=0.0)
    weight_norm: bool = False
    jac_reg_weight: float | int = ranged(0.0, None, default=0.0)
    fixed_point_reuse: bool = True
    final_f_step: bool = False
    tie_word_embeddings: bool = False  # tying is done inside the head (no duplicated keys)

    def __post_init__(self, **kwargs: Any) -> None:
        self.d_embed = self.d_embed or self.d_model
        self.cutoffs = list(self.cutoffs or [])
        if self.tie_projs is None:
            self.tie_projs = [False] * (len(self.cutoffs) + 1)
        self.tie_projs = list(self.tie_projs)
        super().__post_init__(**kwargs)

    def validate_widths(self) -> None:
        """Cutoffs split the vocabulary; bai2019 has one block; the heads tile d_model."""
        cutoffs = self.cutoffs
        if cutoffs and (sorted(cutoffs) != cutoffs or cutoffs[-1] >= self.vocab_size):
            raise ConfigError(f"key 'cutoffs'={cutoffs} must increase within (0, vocab_size="
                              f"{self.vocab_size})")
        if self.variant == "bai2019" and self.n_block != 1:
            raise ConfigError(f"key 'n_block'={self.n_block}: the bai2019 variant has one block")
        if self.n_head * self.d_head != self.d_model:
            # the residual adds attention output (n_head*d_head -> d_model) to z; the injection adds to q/k/v
            raise ConfigError(f"key 'n_head': n_head*d_head ({self.n_head}*{self.d_head}) must equal d_model "
                              f"({self.d_model})")


_TINY = dict(vocab_size=1024, d_model=128, n_head=4, d_head=32, tgt_len=64, mem_len=64)
_SMALL = dict(vocab_size=4096, d_model=192, n_head=6, d_head=32, tgt_len=64, mem_len=64)
_DEQ = {"f_solver": "anderson", "f_max_iter": 30, "f_tol": 1e-3, "b_mode": "ift", "b_max_iter": 12,
        "b_tol": 1e-4}

_LM = "text-generation"

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deq-transformer-tiny-pydoc": preset(
        _LM, "Bai et al. (2019) DEQ-Transformer, one pre-LN weight-tied block, d_model 128 (pydoc)",
        **_TINY, d_inner=512, variant="bai2019", pre_lnorm=True, deq=_DEQ),
    "deq-transformer-small-pystd": preset(
        _LM, "Bai et al. (2019) DEQ-Transformer, one pre-LN weight-tied block, d_model 192 (pystd)",
        **_SMALL, d_inner=768, variant="bai2019", pre_lnorm=True, deq=_DEQ),
    "deq-transformer-small-pystd-explicit": preset(
        _LM, "The small DEQ-Transformer's explicit twin: 2 untied pre-LN blocks, equal parameters",
        **_SMALL, d_inner=144, pre_lnorm=True, explicit_layers=2, deq=_DEQ),
    "deq-transformer-torchdeq-tiny": preset(
        _LM, "TorchDEQ's redesigned DEQ-Transformer (pre-LN, post-attention LN), two blocks in f",
        **_TINY, d_inner=256, variant="torchdeq", n_block=2, deq=_DEQ),
    "deq-transformer-wt103": preset(
        _LM, "locuslab/deq DEQ-Sequence WikiText-103 (adaptive embedding/softmax); convert weights",
        vocab_size=267735, d_model=700, n_head=10, d_head=70, d_inner=48000, variant="bai2019",
        cutoffs=[20000, 40000, 200000], div_val=4, tgt_len=150, mem_len=150, weight_norm=True,
        tie_projs=[False, True, True, True], deq={"f_solver": "anderson", "f_max_iter": 30, "f_tol": 1e-3}),
}
