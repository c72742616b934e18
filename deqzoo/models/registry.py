"""The families of the zoo: ONE declaration per family; every other table of names is derived from these.

A family is its two files (``configuration_<family>.py``, ``modeling_<family>.py``) and one `Family` entry
here (or one :func:`deqzoo.integrations.transformers.register_family` call for a family shipped elsewhere).
The name table (`deqzoo.factory.model_names`), timm's entries (`deqzoo.integrations.timm`), the hypersolver's
state kinds (`deqzoo.hypersolver.attach`), the heads `deqzoo.export` serves and the Auto registrations are all
read from the declarations. This module imports nothing heavy: classes are "module:attribute" strings imported
on demand.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..errors import DeqzooError


@dataclass(frozen=True)
class Family:
    """One family's declaration.

    `models` maps a transformers Auto class name (e.g. "AutoModelForImageClassification") to the model class;
    `heads` names model classes with no transformers Auto class (found through config.architectures);
    `architectures` is the module attribute holding named presets: {name: {"task": ..., "config": {...}}};
    `names`: each published model's canonical name (its hub id's short name) -> (architecture preset,
    older spellings kept as aliases); `timm`: timm model name -> canonical name or preset (timm names are
    Python identifiers); `hypersolver_state`: the state kind a HyperDEQ hypersolver serves ("multires",
    "sequence"; None: "vector"); `task`: the `deqzoo.tasks` name that evaluates its checkpoints; `extra`: the
    pip extra the family needs beyond deqzoo's own dependencies (None: none), with `requires`, the modules
    that extra provides. :mod:`deqzoo.export` reads `export`: head class name (its subclasses too) -> the
    wrapper kind serving it, or why no head is exported; `export_refused`: head class name -> why it is not;
    `export_prepare`: "module:function" run as ``prepare(model, graph)`` on the fixed-iteration copy (a graph
    head's returns the map from the dense operator to its ``graph`` argument); `onnx_refused`: why ONNX export
    is refused.
    """

    model_type: str
    config: str
    models: dict[str, str]
    architectures: str
    image_processor: str | None = None
    tokenizer: str | None = None
    timm_module: str | None = None
    heads: dict[str, str] = field(default_factory=dict)
    names: dict[str, tuple[str | None, tuple[str, ...]]] = field(default_factory=dict)
    timm: dict[str, str] = field(default_factory=dict)
    hypersolver_state: str | None = None
    task: str | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()
    export: dict[str, str] | str = "its forward has not been checked for tracing"
    export_refused: dict[str, str] = field(default_factory=dict)
    export_prepare: str | None = None
    onnx_refused: str = ""

    def load(self, path: str):
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class PipelineFamily:
    """A checkpoint kind that is not a transformers model (a diffusers repository): its loader, names, task
    and extra."""

    name: str
    loader: str  # "module:function" taking (directory, **kwargs)
    names: dict[str, tuple[str | None, tuple[str, ...]]] = field(default_factory=dict)
    task: str | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()


_M = "deqzoo.models"
_DT = f"{_M}.deq_transformer"

FAMILIES: list[Family] = [
    Family(
        model_type="mdeq",
        config=f"{_M}.mdeq.configuration_mdeq:MDEQConfig",
        models={
            "AutoModel": f"{_M}.mdeq.modeling_mdeq:MDEQModel",
            "AutoModelForImageClassification": f"{_M}.mdeq.modeling_mdeq:MDEQForImageClassification",
            "AutoModelForSemanticSegmentation": f"{_M}.mdeq.modeling_mdeq:MDEQForSemanticSegmentation",
        },
        architectures=f"{_M}.mdeq.configuration_mdeq:ARCHITECTURES",
        image_processor=f"{_M}.mdeq.image_processing_mdeq:MDEQImageProcessor",
        timm_module="deqzoo.integrations.timm",
        names={
            "mdeq-tiny-mnist": ("mdeq-mnist-tiny", ("mdeq-mnist-tiny",)),
            "mdeq-tiny-mnist-reversible": ("mdeq-mnist-tiny", ()),  # same architecture, b_mode="reversible"
            "lipschitz-mdeq-tiny-mnist": ("lipschitz-mdeq-mnist-tiny",
                                          ("lipschitz-mdeq-mnist-tiny", "mdeq-lipschitz-tiny-mnist")),
        },
        timm={
            "mdeq_cifar_tiny": "mdeq-cifar-tiny",
            "mdeq_cifar_large": "mdeq-cifar-large",
            "mdeq_imagenet_small": "mdeq-imagenet-small",
            "mdeq_imagenet_large": "mdeq-imagenet-large",
            "mdeq_imagenet_xl": "mdeq-imagenet-xl",
            "mdeq_tiny_mnist": "mdeq-tiny-mnist",
            "mdeq_tiny_mnist_reversible": "mdeq-tiny-mnist-reversible",
            "lipschitz_mdeq_tiny_mnist": "lipschitz-mdeq-tiny-mnist",
            "mdeq_lipschitz_tiny_mnist": "lipschitz-mdeq-tiny-mnist",  # alias (the first spelling)
        },
        hypersolver_state="multires",
        task="mnist",
        export={"MDEQForImageClassification": "image classifier"},
    ),
    Family(
        model_type="deq_transformer",
        config=f"{_DT}.configuration_deq_transformer:DEQTransformerConfig",
        models={
            "AutoModel": f"{_DT}.modeling_deq_transformer:DEQTransformerModel",
            "AutoModelForCausalLM": f"{_DT}.modeling_deq_transformer:DEQTransformerForCausalLM",
        },
        architectures=f"{_DT}.configuration_deq_transformer:ARCHITECTURES",
        names={"deq-transformer-tiny-pydoc": ("deq-transformer-tiny", ()),
               "deq-transformer-small-pystd": ("deq-transformer-small", ()),
               "deq-transformer-small-pystd-explicit": ("deq-transformer-small-explicit", ())},
        hypersolver_state="sequence",
        task="pydoc_lm",
        export={"DEQTransformerForCausalLM": "causal LM"},
        # measured (deqzoo.export's docstring, tests/test_export.py)
        onnx_refused="its fixed-point map is not contractive, so fixed iteration amplifies rounding "
                     "differences: ONNX Runtime's kernels give logits 2.0e-3 / 0.17 / 3.5 from eager at "
                     "batch 1 / 7 / 64 (eager float32 vs float64: 8e-3 / 0.19 / 5.5), far above 1e-4. Use "
                     "export_program (torch.export) or trace, which run torch's kernels",
    ),
    Family(
        model_type="ignn",
        config=f"{_M}.ignn.configuration_ignn:IGNNConfig",
        models={"AutoModel": f"{_M}.ignn.modeling_ignn:IGNNModel"},
        # transformers has no Auto class for graph tasks: the heads are found by config.architectures
        heads={
            "IGNNForNodeClassification": f"{_M}.ignn.modeling_ignn:IGNNForNodeClassification",
            "IGNNForGraphClassification": f"{_M}.ignn.modeling_ignn:IGNNForGraphClassification",
        },
        architectures=f"{_M}.ignn.configuration_ignn:ARCHITECTURES",
        names={"ignn-chains": ("ignn-chains", ())},
        task="chains",
        export={"IGNNForNodeClassification": "graph node classifier"},
        export_refused={"IGNNForGraphClassification": "graph pooling takes the number of graphs from the "
                                                      "batch vector's values"},
        export_prepare=f"{_M}.ignn.modeling_ignn:prepare_export",
    ),
    Family(
        model_type="implicit2",
        config=f"{_M}.implicit2.configuration_implicit2:Implicit2Config",
        models={"AutoModel": f"{_M}.implicit2.modeling_implicit2:Implicit2Model"},
        # no Auto class for coordinate-to-signal networks: heads found by config.architectures
        heads={"Implicit2ForSignalRepresentation": (
            f"{_M}.implicit2.modeling_implicit2:Implicit2ForSignalRepresentation")},
        architectures=f"{_M}.implicit2.configuration_implicit2:ARCHITECTURES",
        names={"implicit2-isiren-camera": ("implicit2-isiren-1l256d", ()),
               "implicit2-igabor-mfn-camera": ("implicit2-igabor-mfn-1l256d", ())},
        task="implicit2",
        export={"Implicit2ForSignalRepresentation": "signal"},
    ),
    Family(
        model_type="deq_flow",
        config=f"{_M}.deq_flow.configuration_deq_flow:DEQFlowConfig",
        models={"AutoModel": f"{_M}.deq_flow.modeling_deq_flow:DEQFlowModel"},
        # no Auto class for optical flow: the head is found by config.architectures
        heads={"DEQFlowForOpticalFlow": f"{_M}.deq_flow.modeling_deq_flow:DEQFlowForOpticalFlow"},
        architectures=f"{_M}.deq_flow.configuration_deq_flow:ARCHITECTURES",
        names={"deq-flow-cpu-synth": ("deq-flow-cpu", ()), "deq-flow-cpu-raft-baseline": ("raft-cpu", ()),
               "deq-flow-cpu-synth-20k": ("deq-flow-cpu", ()),
               "deq-flow-cpu-raft-baseline-20k": ("raft-cpu", ())},
        task="flow",
        extra="vision",  # torchvision's RAFT blocks
        requires=("torchvision",),
        export="its solve reuses frame-to-frame state and its padding, correlation pyramid and convex "
               "upsampling are not checked for a dynamic image size or batch",
    ),
    Family(
        model_type="reasoner",
        config="deqzoo.models.reasoner.configuration_reasoner:ReasonerConfig",
        models={"AutoModel": "deqzoo.models.reasoner.modeling_reasoner:ReasonerModel"},
        # no Auto class for grid classification with a halting head: the head is found by config.architectures
        heads={"ReasonerForGridClassification": (
            "deqzoo.models.reasoner.modeling_reasoner:ReasonerForGridClassification")},
        architectures="deqzoo.models.reasoner.configuration_reasoner:ARCHITECTURES",
        export="its per-sample halting changes the batch between segments; not checked for tracing",
    ),
]

PIPELINES: list[PipelineFamily] = [
    PipelineFamily(
        name="deq_ddim",
        loader="deqzoo.pipelines.deq_ddim:load_repository",
        names={"ddim-digits-16": (None, ())},  # a diffusers repository: its UNet is built by diffusers
        task="ddim_digits",
        extra="diffusion",
        requires=("diffusers",),
    ),
]

_EXTRA_FAMILIES: dict[str, Family] = {}  # declared at run time (a plugin's family, a test's toy family)


def declare_family(family: Family) -> None:
    """Add a family declared outside this file: listed, created, loaded and registered like ours."""
    _EXTRA_FAMILIES[family.model_type] = family


def forget_family(model_type: str) -> None:
    """Drop a family declared with :func:`declare_family` (tests)."""
    _EXTRA_FAMILIES.pop(model_type, None)


def declared_families() -> dict[str, Family]:
    """{model_type: declaration} of every family: ours, then those declared at run time."""
    return {**{f.model_type: f for f in FAMILIES}, **_EXTRA_FAMILIES}


def declared_family(model_type: str) -> Family | None:
    return declared_families().get(model_type)


def family_for(model_type: str) -> Family:
    """The declaration of a model_type, its extra checked (MissingExtraError names it); imports nothing of the
    family. The error for an unknown type lists the known ones."""
    family = declared_families().get(model_type)
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


def model_names_table() -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """canonical name -> (architecture preset, aliases), over every declaration (families and pipelines)."""
    table: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for item in [*declared_families().values(), *PIPELINES]:
        table.update(item.names)
    return table


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
