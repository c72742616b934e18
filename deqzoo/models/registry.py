"""The families of the zoo. A family is its two files and ONE declaration, the ``FAMILY`` of its package's
``__init__.py`` (found by listing ``deqzoo/models/``), or one `register_family` call for a family shipped
elsewhere; every other table (names, timm, app, hypersolver kinds, export, Auto classes) is read from the
declarations. A declaration imports nothing heavy: loading one checkpoint imports only its family.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from functools import cache

from ..errors import DeqzooError


@dataclass(frozen=True)
class Family:
    """One family's declaration ("module:attr" paths, imported on use).

    `models`: Auto class name -> model class; `heads`: classes without an Auto class (via architectures);
    `architectures`: the presets {name: {"task", "config"}}; `names`: the published models, each one name
    that is its hub id ``deqzoo/<name>``, its preset's name and (with ``_``) its timm name; `app`: the models
    the app shows (default first);
    `hypersolver_state`: "multires", "sequence" or None ("vector"); `task`: its cards' `deqzoo_task`; `extra`
    / `requires`: the pip extra it needs and the modules that provide it. For :mod:`deqzoo.export`: `export`
    (head class -> wrapper kind, or why none), `export_refused`, `export_prepare` ("module:function" run as
    ``prepare(model, graph)``), `onnx_refused`. `row_independent`: "eval", "always", "no" or "unless_dropout"
    (eval, and training when the config's ``dropout`` is 0: f's only batch coupling in training is a dropout
    mask), when its forward solve may hand f only the rows still iterating (`deqzoo.core.halting.rowwise`).
    """

    model_type: str
    config: str
    models: dict[str, str]
    architectures: str
    image_processor: str | None = None
    tokenizer: str | None = None
    timm_module: str | None = None
    heads: dict[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    app: tuple[str, ...] = ()
    hypersolver_state: str | None = None
    task: str | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()
    export: dict[str, str] | str = "its forward has not been checked for tracing"
    export_refused: dict[str, str] = field(default_factory=dict)
    export_prepare: str | None = None
    onnx_refused: str = ""
    row_independent: str = "no"

    def load(self, path: str):
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class PipelineFamily:
    """A checkpoint kind that is not a transformers model (a diffusers repository)."""

    name: str
    loader: str  # "module:function" taking (directory, **kwargs)
    names: tuple[str, ...] = ()  # its repositories (no preset: diffusers builds their UNets)
    app: tuple[str, ...] = ()
    task: str | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()


PIPELINES: list[PipelineFamily] = [
    PipelineFamily(
        name="deq_ddim",
        loader="deqzoo.pipelines.deq_ddim:load_repository",
        names=("ddim-digits-16",),
        app=("ddim-digits-16",),
        task="ddim_digits",
        extra="diffusion",
        requires=("diffusers",),
    ),
]

_PACKAGE = __name__.rpartition(".")[0]  # deqzoo.models
_EXTRA_FAMILIES: dict[str, Family] = {}  # declared at run time (a plugin's family, a test's toy family)


def lazy_exports(package: str, exports: dict[str, str]):
    """A family package's ``__getattr__`` and ``__dir__``: each name of `exports` (-> its relative module) is
    imported on first use.

    Example (in ``deqzoo/models/<family>/__init__.py``):
        >>> from deqzoo.models.registry import lazy_exports
        >>> getattr_, dir_ = lazy_exports("deqzoo.models.ignn", {"IGNNConfig": ".configuration_ignn"})
        >>> getattr_("IGNNConfig").model_type, "IGNNConfig" in dir_()
        ('ignn', True)
    """

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__


def _family_of_package(name: str) -> Family | None:
    """The `FAMILY` a package of deqzoo.models declares (importing its light ``__init__`` only)."""
    module = importlib.import_module(f"{_PACKAGE}.{name}")
    family = getattr(module, "FAMILY", None)
    return family if isinstance(family, Family) else None


@cache
def _builtin_families() -> dict[str, Family]:
    """{model_type: declaration} of every package under deqzoo/models that declares a `FAMILY`."""
    package = importlib.import_module(_PACKAGE)
    found = (_family_of_package(info.name) for info in pkgutil.iter_modules(package.__path__) if info.ispkg)
    return {family.model_type: family for family in found if family is not None}


def __getattr__(name: str):
    if name == "FAMILIES":  # our own declarations, collected on first use
        return list(_builtin_families().values())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def declare_family(family: Family) -> None:
    """Add a family declared outside deqzoo/models: listed, created, loaded and registered like ours."""
    _EXTRA_FAMILIES[family.model_type] = family


def forget_family(model_type: str) -> None:
    """Drop a family declared with :func:`declare_family` (tests)."""
    _EXTRA_FAMILIES.pop(model_type, None)


def declared_families() -> dict[str, Family]:
    """{model_type: declaration} of every family: ours, then those declared at run time."""
    return {**_builtin_families(), **_EXTRA_FAMILIES}


def declared_family(model_type: str) -> Family | None:
    """The declaration of `model_type`; only the package of that name is imported when it declares it."""
    if model_type in _EXTRA_FAMILIES:
        return _EXTRA_FAMILIES[model_type]
    if model_type.isidentifier() and importlib.util.find_spec(f"{_PACKAGE}.{model_type}") is not None:
        family = _family_of_package(model_type)
        if family is not None and family.model_type == model_type:
            return family
    return _builtin_families().get(model_type)


def family_for(model_type: str) -> Family:
    """The declaration of a model_type, its extra checked (MissingExtraError names it); an unknown type's
    error lists the known ones."""
    family = declared_family(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"Unknown deqzoo model_type {model_type!r}; known model types: "
                         f"{sorted(declared_families())}")
    require(family.extra, family.requires, f"the {model_type} family")
    return family


def available_families() -> dict[str, Family]:
    """{model_type: declaration} of the families whose extras are installed."""
    missing = unavailable_families()
    return {t: family for t, family in declared_families().items() if t not in missing}


def unavailable_families() -> dict[str, str]:
    """{model_type: reason (the extra to install)} for declared families that cannot be used here."""
    reasons = {}
    for model_type, family in declared_families().items():
        try:
            require(family.extra, family.requires, f"the {model_type} family")
        except MissingExtraError as err:
            reasons[model_type] = str(err)
    return reasons


def model_names_table() -> dict[str, str | None]:
    """Each published model's name -> its architecture preset (the same name; None for a diffusers
    repository), over every declaration (families and pipelines)."""
    table: dict[str, str | None] = {name: name for family in declared_families().values()
                                    for name in family.names}
    return table | {name: None for pipeline in PIPELINES for name in pipeline.names}


def timm_names(family: Family) -> dict[str, tuple[str, str | None]]:
    """timm name -> (preset, hub id or None): each published model's name (``-`` -> ``_``), then each
    image-classification preset no published model names.

    Example:
        >>> table = timm_names(declared_family("mdeq"))
        >>> table["mdeq_tiny_mnist"], table["mdeq_cifar_tiny"]
        (('mdeq-tiny-mnist', 'deqzoo/mdeq-tiny-mnist'), ('mdeq-cifar-tiny', None))
    """
    if not family.timm_module:
        return {}
    table = {name.replace("-", "_"): (name, f"deqzoo/{name}") for name in family.names}
    for preset, spec in family.load(family.architectures).items():
        if preset not in family.names and spec.get("task") == "image-classification":
            table.setdefault(preset.replace("-", "_"), (preset, None))
    return table


def app_checkpoints() -> dict[str, list[str]]:
    """{model_type or pipeline name: the hub ids the app shows, its default first}, from the declarations.

    Example:
        >>> app_checkpoints()["mdeq"][0]
        'deqzoo/mdeq-tiny-mnist'
    """
    items = [*declared_families().values(), *PIPELINES]
    return {getattr(item, "model_type", None) or item.name: [f"deqzoo/{n}" for n in item.app]
            for item in items if item.app}


class MissingExtraError(DeqzooError, ImportError):
    """A family or command needs an optional dependency that is not installed; the message names the extra."""


# top-level module -> the extra that installs it (for errors raised deep inside a task or command)
EXTRA_OF_MODULE = {"torchvision": "vision", "PIL": "vision", "timm": "timm", "diffusers": "diffusion",
                   "mlxtend": "data", "sklearn": "data", "skimage": "data", "cv2": "data",
                   "matplotlib": "plot",
                   "accelerate": "train", "torch_geometric": "graph", "torchdeq": "bench", "onnx": "export",
                   "onnxruntime": "export", "onnxscript": "export"}


def missing_extra_message(err: ModuleNotFoundError) -> str | None:
    """'... pip install "deqzoo[<extra>]"' for a missing optional dependency, None for any other module."""
    top = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return f"this needs {top}, which is not installed: pip install \"deqzoo[{extra}]\""


def require(extra: str | None, modules: tuple[str, ...], what: str) -> None:
    """Raise MissingExtraError naming ``pip install "deqzoo[<extra>]"`` when one of `modules` is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)}, which is not installed: "
                                f'pip install "deqzoo[{extra}]"')
