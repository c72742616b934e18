"""Base classes every zoo model builds on: a PreTrainedModel whose solver settings can change, DEQ outputs
(the config, DEQPretrainedConfig, lives in `deqzoo.configuration_utils`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_utils import ConfigError, DEQPretrainedConfig, _engine_policy
from .core import DEQ, DEQConfig, SolverStats
from .hub.loading import prepare_pretrained
from .hub.push import push_folder
from .hub.saving import atomic_save

__all__ = ["ConfigError", "DEQModelOutput", "DEQNonConvergenceWarning", "DEQPreTrainedModel",
           "DEQPretrainedConfig"]


class DEQNonConvergenceWarning(RuntimeWarning):
    """A model's forward solve stopped at its iteration cap above its tolerance (emitted once per model)."""


class DEQPreTrainedModel(PreTrainedModel):
    """Weights I/O from `PreTrainedModel`, plus solver settings that can change after loading.

    Every :class:`~deqzoo.core.DEQ` submodule follows ``config.deq``; change it with :meth:`set_deq`
    or ``from_pretrained(..., deq={...})``.
    """

    config_class = DEQPretrainedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    # Every zoo loss is a batch mean and no forward reads `num_items_in_batch`: declared, so transformers'
    # Trainer divides the loss by the gradient accumulation and does not multiply it by the number of
    # processes (which it does for models that take **kwargs and sum over tokens themselves)
    accepts_loss_kwargs = False

    def post_init(self):
        super().post_init()
        # one convergence check per top-level model: nested zoo models (a head's backbone) stay silent
        for module in self.modules():
            if module is not self and isinstance(module, DEQPreTrainedModel):
                module._deqzoo_nested = True
        if not getattr(self, "_deqzoo_hooked", False):
            self.register_forward_hook(_check_convergence)
            self.register_forward_pre_hook(_check_traceable)
            self._deqzoo_hooked = True

    def compile_deq(self, enabled: bool = True, **options: Any) -> DEQPreTrainedModel:
        """Compile f_θ of every DEQ layer with ``torch.compile(**options)`` (`deqzoo.core.DEQ.compile_f`; the
        solver loop stays eager; docs/export.md). ``enabled=False`` goes back to eager f.

        Example:
            >>> import deqzoo
            >>> model = deqzoo.create_model("mdeq-tiny-mnist").compile_deq()
            >>> model.mdeq.deq.compile_options
            {}
        """
        for module in self.modules():
            if isinstance(module, DEQ):
                module.compile_f(enabled, **options)
        return self

    def set_deq(self, **changes: Any) -> DEQConfig:
        """Change solver settings of every DEQ layer in this model; returns the new DEQConfig.

        ``on_nonconvergence`` is the model-level policy: "warn" (default: one `DEQNonConvergenceWarning` per
        model when a forward solve stops at f_max_iter above f_tol), "ignore", or "raise"
        (`deqzoo.core.DEQConvergenceError`). Changing any setting re-arms the one warning.

        Example:
            >>> import deqzoo
            >>> model = deqzoo.create_model("mdeq-tiny-mnist")
            >>> model.set_deq(f_max_iter=40, f_solver="broyden").f_max_iter
            40
            >>> model.set_deq(on_nonconvergence="ignore").on_nonconvergence, model.config.on_nonconvergence
            ('ignore', 'ignore')
        """
        policy = changes.pop("on_nonconvergence", None)
        if policy is not None:
            self.config.on_nonconvergence = policy  # the strict config refuses a policy it does not name
            changes["on_nonconvergence"] = _engine_policy(policy)
        new = self.config.deq_config.update(**changes)
        self.config.deq = new.to_dict()
        for module in self.modules():
            if isinstance(module, DEQ):
                module.config = new
            if isinstance(module, DEQPreTrainedModel):
                module._deqzoo_warned = False
        return new

    def _add_jac_loss(self, loss: torch.Tensor | None, stats: SolverStats | None,
                      weight: float | None = None) -> torch.Tensor | None:
        """loss + weight · stats.jac_loss, the Jacobian regularizer the engine estimated in the solve
        (``deq={"jac_reg_samples": k}``; Bai et al., 2021); ``weight`` defaults to ``config.jac_loss_weight``.
        The loss as given when there is none, no estimate, or the weight is 0."""
        weight = self.config.jac_loss_weight if weight is None else weight
        if loss is None or weight == 0 or getattr(stats, "jac_loss", None) is None:
            return loss
        return loss + weight * stats.jac_loss

    def set_hypersolver(self, hypersolver, *, check: bool = True,
                        use: str | None = None) -> DEQPreTrainedModel:
        """Solve every DEQ layer with a HyperDEQ hypersolver (an embedded id, a directory or a `HyperSolver`)
        trained for this model's weights (``check=False`` skips the fingerprint check); ``use`` overrides its
        config's ("initializer" or "hyperanderson"). Budget and tolerance stay ``config.deq``'s.

        Example:
            >>> import deqzoo
            >>> model = deqzoo.from_pretrained("deqzoo/mdeq-tiny-mnist")
            >>> model.set_hypersolver("deqzoo/hyperdeq-mdeq-tiny-mnist").hypersolver is not None
            True
            >>> model.remove_hypersolver().hypersolver is None
            True
        """
        from .hypersolver import HyperSolver, load_hypersolver, set_hypersolver

        hs = hypersolver if isinstance(hypersolver, HyperSolver) else load_hypersolver(hypersolver)
        return set_hypersolver(self, hs, check=check, use=use)

    def remove_hypersolver(self) -> DEQPreTrainedModel:
        """Back to the solver in ``config.deq`` (a no-op without a hypersolver). Returns the model."""
        from .hypersolver import remove_hypersolver

        return remove_hypersolver(self)

    @property
    def hypersolver(self):
        """The attached `deqzoo.hypersolver.HyperSolver`, or None."""
        from .hypersolver import attached_hypersolver

        return attached_hypersolver(self)

    def _output(self, output: ModelOutput, return_dict: bool | None) -> ModelOutput | tuple:
        """`output`, or its tuple of non-None fields with ``return_dict=False`` (as in transformers)."""
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return output if return_dict else output.to_tuple()

    def _flag(self, value: bool | None, name: str) -> bool:
        """A per-call output flag, defaulting to the config's (``output_hidden_states``, ...)."""
        return bool(getattr(self.config, name, False)) if value is None else bool(value)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, deq: dict[str, Any] | None = None,
                        max_parameters: int | None = None, strict: bool = True, **kwargs):
        """transformers' ``PreTrainedModel.from_pretrained`` (every keyword passed on), after what it lacks
        (:func:`deqzoo.hub.loading.prepare_pretrained`: embedded ids, safetensors only, limits, a parameter
        budget, headers checked before allocation, strict keys; ``strict=False``: transformers' lenient
        report). ``deq={...}`` then overrides solver settings.

        Example:
            >>> model = MDEQForImageClassification.from_pretrained(  # doctest: +SKIP
            ...     "deqzoo/mdeq-tiny-mnist", deq={"f_solver": "broyden", "f_max_iter": 12})
        """
        path, config, kwargs = prepare_pretrained(cls, pretrained_model_name_or_path, strict=strict,
                                                  max_parameters=max_parameters, **kwargs)
        result = super().from_pretrained(path, *model_args, config=config, **kwargs)
        model = result[0] if isinstance(result, tuple) else result
        if pretrained_model_name_or_path is not None:
            model.name_or_path = model.config.name_or_path = str(pretrained_model_name_or_path)
        if deq:
            model.set_deq(**deq)
        return result

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """transformers' ``save_pretrained`` (safetensors only), atomic (`deqzoo.hub.saving.atomic_save`): the
        path holds the old or the new complete checkpoint, other files there are kept."""
        if kwargs.pop("safe_serialization", True) is False:
            raise ValueError("save_pretrained(safe_serialization=False) is not supported: deqzoo writes "
                             "safetensors only (a pickle is never written nor read)")
        if not (args[0] if args else kwargs.get("is_main_process", True)):
            Path(save_directory).mkdir(parents=True, exist_ok=True)  # other ranks write nothing
            return
        # never write a config our own loader would refuse (an attribute set after __init__ is not checked)
        type(self.config).from_dict(self.config.to_dict())
        push_options = {k: kwargs.pop(k) for k in _PUSH_OPTIONS if k in kwargs}
        repo_id = kwargs.pop("repo_id", None) or Path(save_directory).name
        parent_save = super().save_pretrained
        atomic_save(save_directory, lambda tmp: parent_save(str(tmp), *args, **kwargs))
        if push_to_hub:
            push_folder(save_directory, repo_id=repo_id, token=kwargs.get("token"), **push_options)

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None,
                    commit_description: str | None = None, private: bool | None = None,
                    token: bool | str | None = None, revision: str | None = None, create_pr: bool = False,
                    max_shard_size: int | str | None = "50GB", tags: list[str] | None = None,
                    endpoint: str | None = None) -> str:
        """Save to a temporary directory and upload it (:func:`deqzoo.hub.push.push_folder`, transformers'
        options); returns the commit URL (``.pr_url`` with ``create_pr=True``).

        Example:
            >>> model.push_to_hub("me/mdeq-tiny-mnist", create_pr=True, tags=["mnist"])  # doctest: +SKIP
        """
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(Path(tmp) / "checkpoint", max_shard_size=max_shard_size)
            return push_folder(Path(tmp) / "checkpoint", repo_id=repo_id, private=private, token=token,
                               commit_message=commit_message or "Upload deqzoo model",
                               commit_description=commit_description, revision=revision, create_pr=create_pr,
                               tags=tags, endpoint=endpoint)


# save_pretrained(..., push_to_hub=True, <option>=...) forwards these to push_folder, as transformers does
_PUSH_OPTIONS = ("commit_message", "commit_description", "private", "revision", "create_pr", "tags",
                 "endpoint")


def _solver_stats(output: Any) -> list[SolverStats]:
    """Every SolverStats in a model output (ModelOutput or tuple), one level of nesting deep."""
    if isinstance(output, ModelOutput):
        values = list(dict.values(output))  # not output.values(): a field may be called `values` (INRs)
    else:
        values = list(output) if isinstance(output, tuple) else []
    found: list[SolverStats] = []
    for v in values:
        if isinstance(v, SolverStats):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += [s for s in v if isinstance(s, SolverStats)]
    return found


def _caller_level() -> int:
    """warnings stacklevel of the first frame outside torch.nn's call machinery, seen from the hook."""
    import sys

    from torch.nn.modules import module as torch_module

    torch_dir = str(Path(torch_module.__file__).parent)
    frame, level = sys._getframe(2), 2  # level 1 is the hook, level 2 the frame that called it
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame, level = frame.f_back, level + 1
    return level


def _check_traceable(model: DEQPreTrainedModel, _inputs: Any) -> None:
    """Forward pre-hook: tracing an adaptive solve fails here with the reason, not deep inside the solver."""
    if not (torch.jit.is_tracing() or torch.compiler.is_exporting()):
        return
    adaptive = [m for m in model.modules() if isinstance(m, DEQ) and not getattr(m, "traceable", False)]
    if adaptive:
        raise RuntimeError(
            f"{type(model).__name__}: its DEQ forward solve ({adaptive[0].config.f_solver}, stopping at "
            "f_tol) cannot be traced or exported: the stopping test and statistics read tensor values every "
            "step. Export under fixed-iteration inference: deqzoo.export.exportable(model) "
            "(see deqzoo.export).")


def _check_convergence(model: DEQPreTrainedModel, _inputs: Any, output: Any) -> None:
    """Forward hook: warn once per model when a solve in this forward ended above its tolerance."""
    if getattr(model, "_deqzoo_nested", False) or getattr(model, "_deqzoo_warned", False):
        return
    if getattr(model.config, "on_nonconvergence", "warn") != "warn":
        return
    if torch.compiler.is_compiling():  # a warning on values is a host read: compiled, deq_stats tells
        return
    for stats in _solver_stats(output):
        # "no_solve" (DEQ.solve_with(max_iter=0), Implicit²'s reuse): no solve was asked for, so no tolerance
        # was missed; "reversible" runs its fixed number of coupled steps by design (f_tol never stops it and
        # the model was trained for that budget, so "raise f_max_iter" would be wrong advice). Either way the
        # residual and per-sample flags are only reported, in deq_stats
        if stats.all_converged or stats.solver in ("no_solve", "reversible"):
            continue
        model._deqzoo_warned = True
        deq = model.config.deq
        bad = int((~stats.converged).sum())
        warnings.warn(
            f"{type(model).__name__}: the forward solve stopped above its tolerance for {bad}/"
            f"{stats.converged.numel()} samples ({stats.solver}, nfe={stats.nfe}, "
            f"f_max_iter={deq['f_max_iter']}, max {stats.stop_mode} residual "
            f"{float(stats.residual.max()):.2e} > f_tol={stats.tol:g}); "
            "outputs are not at the equilibrium. Raise f_max_iter or try another f_solver "
            "(model.set_deq(...)); model.set_deq(on_nonconvergence='ignore') silences this, 'raise' makes it "
            "an error. Warned once per model; per-sample flags are in output.deq_stats.converged.",
            DEQNonConvergenceWarning,
            stacklevel=_caller_level(),
        )
        return


@dataclass
class DEQModelOutput(ModelOutput):
    """Base of every zoo output. Subclasses declare ``deq_stats: SolverStats | None = None`` LAST:
    transformers reads ``outputs[0]`` as the loss (or logits) and the batch size from the first field."""
