"""DEQ-DDIM: the DDIM chain solved as one fixed point, as a `diffusers.DiffusionPipeline`."""

from .pipeline_deq_ddim import (
    DDIMChain,
    DEQDDIMInversionOutput,
    DEQDDIMPipeline,
    DEQDDIMPipelineOutput,
    check_components,
    ddim_invert,
    load_repository,
    sequential_ddim,
)

__all__ = ["DDIMChain", "DEQDDIMInversionOutput", "DEQDDIMPipeline", "DEQDDIMPipelineOutput",
           "check_components", "ddim_invert", "load_repository", "sequential_ddim"]
