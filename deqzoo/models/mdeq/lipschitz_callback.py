"""The transformers Trainer callback of Lipschitz MDEQ, in a module of its own: its base class imports
transformers' Trainer machinery (trainer_callback, training_args), which loading or running a model never
needs, so ``deqzoo.models.mdeq`` imports this module only when the name is first asked for."""

from __future__ import annotations

from transformers import TrainerCallback

from .lipschitz import project_lipschitz


class LipschitzProjectionCallback(TrainerCallback):
    """transformers Trainer callback running :func:`project_lipschitz` after every optimizer step.

    Example:
        >>> from transformers import Trainer  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=ds,
        ...         callbacks=[LipschitzProjectionCallback()])  # doctest: +SKIP
    """

    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: D102 - Trainer hook
        if model is not None:
            target = model.module if hasattr(model, "module") else model
            project_lipschitz(target)
        return control
