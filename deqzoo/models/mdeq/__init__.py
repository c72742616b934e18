"""MDEQ family: multiscale deep equilibrium models (Bai et al. 2020) and Lipschitz MDEQ (Sato & Iiduka).

Example:
    >>> from deqzoo.models.mdeq import lipschitz_bound
    >>> round(lipschitz_bound(0.5, 0.3, 2.0, 1.0, 0.35, 4, 0.3), 2)
    0.9
"""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="mdeq",
    row_independent="unless_dropout",  # GroupNorm per sample; see modeling_mdeq.MDEQModel.forward
    config=f"{_P}.configuration_mdeq:MDEQConfig",
    models={
        "AutoModel": f"{_P}.modeling_mdeq:MDEQModel",
        "AutoModelForImageClassification": f"{_P}.modeling_mdeq:MDEQForImageClassification",
        "AutoModelForSemanticSegmentation": f"{_P}.modeling_mdeq:MDEQForSemanticSegmentation",
    },
    architectures=f"{_P}.configuration_mdeq:ARCHITECTURES",
    image_processor=f"{_P}.image_processing_mdeq:MDEQImageProcessor",
    timm_module="deqzoo.integrations.timm",
    heads={"MDEQTimm": "deqzoo.integrations.timm:MDEQTimm"},  # a timm model saved with save_pretrained
    names=("mdeq-tiny-mnist", "mdeq-tiny-mnist-reversible", "lipschitz-mdeq-tiny-mnist"),
    app=("mdeq-tiny-mnist", "lipschitz-mdeq-tiny-mnist"),
    hypersolver_state="multires",
    task="mnist",
    export={"MDEQForImageClassification": "image classifier"},
)

_EXPORTS = {
    "ARCHITECTURES": ".configuration_mdeq", "MDEQConfig": ".configuration_mdeq",
    "conv_operator_norm": ".lipschitz", "lipschitz_bound": ".lipschitz", "project_lipschitz": ".lipschitz",
    "MDEQForImageClassification": ".modeling_mdeq", "MDEQForSemanticSegmentation": ".modeling_mdeq",
    "MDEQModel": ".modeling_mdeq", "MDEQPreTrainedModel": ".modeling_mdeq",
    # the Trainer callback's module imports transformers' Trainer: only on first use
    "LipschitzProjectionCallback": ".lipschitz_callback",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
