"""Base classes every zoo model builds on: a config with a nested `deq`, a PreTrainedModel, DEQ outputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from .core import DEQ, DEQConfig


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
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, deq: dict[str, Any] | None = None,
                        **kwargs):
        """Load a checkpoint (directory, embedded id, or Hub id) from safetensors, verified; never unpickles.

        `deq` overrides solver settings after loading. Errors name the file and list missing, unexpected and
        mis-shaped keys.

        Example:
            >>> model = MDEQForImageClassification.from_pretrained(  # doctest: +SKIP
            ...     "deqzoo/mdeq-tiny-mnist", deq={"f_solver": "broyden", "f_max_iter": 12})
        """
        from .hub.loading import load_pretrained

        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no positional model arguments")
        return load_pretrained(cls, pretrained_model_name_or_path, deq=deq, **kwargs)

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """Save config.json + model.safetensors atomically: written to a temporary sibling, then renamed.

        A failed save leaves any previous checkpoint in `save_directory` untouched and no partial directory.
        """
        from .hub.saving import atomic_save

        kwargs.pop("safe_serialization", None)  # always safetensors
        if not (args[0] if args else kwargs.get("is_main_process", True)):
            Path(save_directory).mkdir(parents=True, exist_ok=True)  # other ranks write nothing
            return
        repo_id = kwargs.pop("repo_id", None) or Path(save_directory).name
        private = kwargs.pop("private", None)
        parent_save = super().save_pretrained
        atomic_save(save_directory, lambda tmp: parent_save(str(tmp), *args, **kwargs))
        if push_to_hub:
            from .hub.push import push_folder

            push_folder(save_directory, repo_id=repo_id, private=private, token=kwargs.get("token"))

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload deqzoo model", endpoint: str | None = None,
                    **_: Any) -> str:
        """Save to a temporary directory and upload it with huggingface_hub; returns the commit URL.

        Example:
            >>> model.push_to_hub("me/mdeq-tiny-mnist")  # doctest: +SKIP
        """
        import tempfile

        from .hub.push import push_folder

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(Path(tmp) / "checkpoint")
            return push_folder(Path(tmp) / "checkpoint", repo_id=repo_id, private=private, token=token,
                               commit_message=commit_message, endpoint=endpoint)


@dataclass
class DEQModelOutput(ModelOutput):
    """Base of every zoo output. Subclasses declare ``deq_stats: SolverStats | None = None`` as their LAST
    field: transformers reads ``outputs[0]`` as the loss (or logits) and takes the batch size from the first
    field, so the solver statistics must not come first. ``deq_stats`` indexes per sample (``stats[i]``),
    which is how pipelines un-batch it."""
