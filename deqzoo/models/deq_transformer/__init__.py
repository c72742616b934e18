"""DEQ-Transformer language models (Bai et al. 2019; TorchDEQ's redesign) as config variants of one model."""

from ..registry import Family, lazy_exports

_P = __name__
FAMILY = Family(
    model_type="deq_transformer",
    row_independent="eval",
    config=f"{_P}.configuration_deq_transformer:DEQTransformerConfig",
    models={
        "AutoModel": f"{_P}.modeling_deq_transformer:DEQTransformerModel",
        "AutoModelForCausalLM": f"{_P}.modeling_deq_transformer:DEQTransformerForCausalLM",
    },
    architectures=f"{_P}.configuration_deq_transformer:ARCHITECTURES",
    names=("deq-transformer-tiny-pydoc", "deq-transformer-small-pystd",
           "deq-transformer-small-pystd-explicit"),
    app=("deq-transformer-small-pystd", "deq-transformer-tiny-pydoc"),
    hypersolver_state="sequence",
    task="pydoc_lm",
    export={"DEQTransformerForCausalLM": "causal LM"},
    # measured (deqzoo.export's docstring, tests/test_export.py)
    onnx_refused="its fixed-point map is not contractive, so fixed iteration amplifies rounding "
                 "differences: ONNX Runtime's kernels give logits 2.0e-3 / 0.17 / 3.5 from eager at "
                 "batch 1 / 7 / 64 (eager float32 vs float64: 8e-3 / 0.19 / 5.5), far above 1e-4. Use "
                 "export_program (torch.export) or trace, which run torch's kernels",
)

_EXPORTS = {
    "ARCHITECTURES": ".configuration_deq_transformer",
    "DEQTransformerConfig": ".configuration_deq_transformer",
    **{name: ".modeling_deq_transformer" for name in (
        "DEQTransformerCache", "DEQTransformerCausalLMOutput", "DEQTransformerForCausalLM",
        "DEQTransformerModel", "DEQTransformerModelOutput", "DEQTransformerPreTrainedModel")},
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # modules imported on first use


__all__ = ["FAMILY", *_EXPORTS]
