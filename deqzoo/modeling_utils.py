"""Base classes every zoo model builds on: a config with a nested `deq`, a PreTrainedModel, DEQ outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from .core import DEQ, DEQConfig, SolverStats


class DEQPretrainedConfig(PretrainedConfig):
    """A `PretrainedConfig` whose `deq` entry is a serialised, validated :class:`DEQConfig`.

    Example:
        >>> from deqzoo.modeling_utils import DEQPretrainedConfig
        >>> cfg = DEQPretrainedConfig(deq={"f_max_iter": 12})
        >>> cfg.deq_config.f_max_iter
        12
    """

    # Trainer's evaluation loop skips these output keys (solver statistics are not predictions).
    keys_to_ignore_at_inference = ["deq_stats"]

    def __init__(self, deq: dict[str, Any] | DEQConfig | None = None, **kwargs):
        if isinstance(deq, DEQConfig):
            deq = deq.to_dict()
        self.deq = DEQConfig.from_dict(deq).to_dict()
        super().__init__(**kwargs)

    @property
    def deq_config(self) -> DEQConfig:
        return DEQConfig.from_dict(self.deq)


class DEQPreTrainedModel(PreTrainedModel):
    """Weights I/O from `PreTrainedModel`, plus solver settings that can change after loading.

    Every :class:`~deqzoo.core.DEQ` submodule follows ``config.deq``; change it with :meth:`set_deq`
    or ``from_pretrained(..., deq={...})``.
    """

    config_class = DEQPretrainedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    def set_deq(self, **changes: Any) -> DEQConfig:
        """Change solver settings of every DEQ layer in this model; returns the new DEQConfig.

        Example:
            >>> model.set_deq(f_max_iter=12, f_solver="broyden")  # doctest: +SKIP
        """
        new = self.config.deq_config.update(**changes)
        self.config.deq = new.to_dict()
        for module in self.modules():
            if isinstance(module, DEQ):
                module.config = new
        return new

    @classmethod
    def from_pretrained(cls, *args, deq: dict[str, Any] | None = None, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        if deq:
            model.set_deq(**deq)
        return model


@dataclass
class DEQModelOutput(ModelOutput):
    """Base output: every zoo output carries the forward solve's statistics as `deq_stats`."""

    deq_stats: SolverStats | None = None
