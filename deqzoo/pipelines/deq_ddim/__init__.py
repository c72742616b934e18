"""DEQ-DDIM: the DDIM chain solved as one fixed point, as a `diffusers.DiffusionPipeline`."""

from .pipeline_deq_ddim import (
    DDIMChain,
    DEQDDIMInversionOutput,
    DEQDDIMPipeline,
    DEQDDIMPipelineOutput,
    check_components,
    load_repository,
)

__all__ = ["DDIMChain", "DEQDDIMInversionOutput", "DEQDDIMPipeline", "DEQDDIMPipelineOutput",
           "check_components", "load_repository"]
