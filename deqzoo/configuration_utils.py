"""Strict configs as transformers v5 writes them (huggingface_hub's ``@strict``: typed fields checked on every
assignment, ``validate_*`` methods), raising :class:`ConfigError`; the base config of every zoo model."""


import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from .core import DEQConfig
from .core.config import merge_settings
from .errors import DeqzooError

MAX_LIST_LENGTH = 1024  # no config list (channels per branch, cutoffs) is longer; a longer one is an error
MAX_LABELS = 1_000_000  # transformers builds id2label eagerly: a huge num_labels would hang before any model


class ConfigError(DeqzooError, ValueError):
    """A config value has the wrong type or is out of range; the message names the class and the key."""


def ranged(low: float | None = None, high: float | None = None, *, as_float: bool = False,
           open_low: bool = False, open_high: bool = False, **field_options: Any) -> Any:
    """A strict dataclass field (huggingface_hub's ``validated_field``) whose number, or each number of whose
    list, is finite and lies in [low, high] (None: unbounded; ``open_low``/``open_high``: the bound itself is
    out); a list holds at most MAX_LIST_LENGTH entries.
    Messages hold ``{key}``, filled in with the field's name when the error is raised (`_config_error`).
    ``as_float``: the built config holds the number (each entry) as a float, an int given (5) too (5.0)."""

    bounds = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"

    def check(value: Any) -> None:
        items = value if isinstance(value, (list, tuple)) else [value]
        if len(items) > MAX_LIST_LENGTH:
            raise ValueError(f"key {{key}} has {len(items):,} entries, above the limit of {MAX_LIST_LENGTH}")
        where = "an entry of {key}" if items is value else "key {key}"
        for item in items:
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                continue
            if not math.isfinite(item):
                raise ValueError(f"{where} must be float (finite), got {item!r}")
            if ((low is not None and (item < low or open_low and item == low))
                    or (high is not None and (item > high or open_high and item == high))):
                raise ValueError(f"{where} is {item!r}, outside the allowed range {bounds}")

    return validated_field(check, metadata={"as_float": as_float}, **field_options)


def preset(task: str, description: str, **config: Any) -> dict[str, Any]:
    """One entry of a family's ``ARCHITECTURES`` (the named presets of `deqzoo.create_model`): its task, one
    line describing it, and its config's keys.

    Example:
        >>> preset("graph-ml", "a toy", hidden_size=8)
        {'task': 'graph-ml', 'description': 'a toy', 'config': {'hidden_size': 8}}
    """
    return {"task": task, "description": description, "config": config}


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        names = [n for n in dict.fromkeys(_type_name(a) for a in args) if n != "int" or float not in args]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if hint is dict or origin is dict:
        return "a mapping"
    if origin in (list, tuple):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _config_error(config: Any, err: Exception, key: str | None = None, value: Any = None) -> ConfigError:
    """The config's error (``error_class``, a ConfigError) for a strict dataclass's validation error, naming
    the class, the key and the value."""
    cause, name = err.__cause__ if isinstance(err, StrictDataclassError) else err, type(config).__name__
    if isinstance(cause, ConfigError) and str(cause).startswith(f"{name}: "):
        return cause  # translated already (a field assignment inside __init__)
    error, field = getattr(config, "error_class", ConfigError), config.__dataclass_fields__.get(key)
    if isinstance(cause, TypeError) and field is not None:
        shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
        return error(f"{name}: key {key!r} must be {_type_name(field.type)}, got {shown} "
                     f"({type(value).__name__})")
    return error(f"{name}: " + str(cause).replace("{key}", repr(key)))


def strict_config(cls: type) -> type:
    """huggingface_hub's ``@strict``, as transformers v5 configs use it (typed fields checked on every
    assignment, ``validate_*`` methods after ``__init__`` and before ``save_pretrained``), raising
    :class:`ConfigError` (a ValueError naming the class, the key and the value; a class may name a subclass
    as ``error_class``) for its errors."""
    cls = strict(cls)

    def translating(method: Any, keyed: bool) -> Any:
        @functools.wraps(method)
        def translated(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except (StrictDataclassError, ValueError) as err:
                raise _config_error(self, err, *(args if keyed else ())) from err
        return translated

    cls.__init__ = translating(cls.__init__, False)
    cls.__setattr__ = translating(cls.__setattr__, True)
    cls.validate = translating(cls.validate, False)
    cls.validate.__is_defined_by_strict_decorator__ = True  # lets a subclass apply @strict again
    return cls


@strict_config
class DEQPretrainedConfig(PretrainedConfig):
    """A strict `PretrainedConfig` whose ``deq`` entry is a serialised :class:`DEQConfig` (validated by
    constructing one; a family's ``default_deq`` fills the keys not given) and whose ``on_nonconvergence``
    is the model's one policy ("warn" once per model, the default; "ignore"; "raise"): the engine's setting
    in ``deq`` follows it.

    Example:
        >>> from deqzoo.configuration_utils import DEQPretrainedConfig
        >>> cfg = DEQPretrainedConfig(deq={"f_max_iter": 12})
        >>> cfg.deq_config.f_max_iter, cfg.on_nonconvergence
        (12, 'warn')
    """

    # Trainer's evaluation loop skips these output keys (solver statistics are not predictions).
    keys_to_ignore_at_inference = ["deq_stats"]
    default_deq: ClassVar[dict[str, Any]] = {}

    deq: dict[str, Any] | DEQConfig | None = None
    # What a model does when a forward solve ends above its tolerance (at its iteration cap): "warn" once
    # per model instance (the default), "ignore", or "raise" (the engine raises DEQConvergenceError).
    on_nonconvergence: typing.Literal["warn", "ignore", "raise"] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        labels = kwargs.get("num_labels")
        if labels is not None and (not isinstance(labels, numbers.Integral) or isinstance(labels, bool)
                                   or not 1 <= labels <= MAX_LABELS):
            raise ConfigError(f"key 'num_labels' must be an integer in [1, {MAX_LABELS:,}], got {labels!r}")
        for key in ("id2label", "label2id"):
            if getattr(self, key) is not None and (not isinstance(getattr(self, key), dict)
                                                   or len(getattr(self, key)) > MAX_LABELS):
                raise ConfigError(f"key {key!r} must be a mapping of at most {MAX_LABELS:,} labels")
        for field in dataclasses.fields(self):  # `ranged(as_float=True)`; values were checked as int or float
            value = getattr(self, field.name)
            if field.metadata.get("as_float") and value is not None:
                setattr(self, field.name, [float(v) for v in value] if isinstance(value, (list, tuple))
                        else float(value))
        deq = self.deq.to_dict() if isinstance(self.deq, DEQConfig) else self.deq  # types checked by @strict
        deq = merge_settings(self.default_deq, deq or {})  # a changed b_mode drops the default's options
        if self.on_nonconvergence is None:  # older configs kept the policy in `deq` only
            self.on_nonconvergence = "raise" if deq.get("on_nonconvergence") == "raise" else "warn"
        self.deq = _solver_settings({**deq, "on_nonconvergence": _engine_policy(self.on_nonconvergence)})
        super().__post_init__(**kwargs)

    def validate_deq(self) -> None:
        """``deq`` is a DEQConfig's dict (names, ranges, combinations checked by DEQConfig itself)."""
        _solver_settings(self.deq)

    @property
    def deq_config(self) -> DEQConfig:
        """The engine's settings; its ``on_nonconvergence`` follows the model's policy (the model warns)."""
        return DEQConfig.from_dict({**self.deq, "on_nonconvergence": _engine_policy(self.on_nonconvergence)})


def _solver_settings(deq: Any) -> dict[str, Any]:
    """``deq`` as the full dict of a valid DEQConfig (which checks names, ranges and combinations)."""
    if not isinstance(deq, dict):
        raise ConfigError(f"key 'deq' must be a mapping of solver settings, got {type(deq).__name__}")
    try:
        return DEQConfig.from_dict(deq).to_dict()
    except (ValueError, TypeError) as err:
        raise ConfigError(f"key 'deq': {err}") from err


def _engine_policy(policy: str | None) -> str:
    """The engine raises (its error carries the stats) under "raise"; warning once is the model's job."""
    return "raise" if policy == "raise" else "ignore"
