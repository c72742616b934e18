"""DEQ-Flow training: memory constant in the number of supervised states (data: examples/deq_flow/flow.py)."""

from __future__ import annotations

import torch

from ...core import backward_in_stages

__all__ = ["two_stage_backward"]


def two_stage_backward(model, image1: torch.Tensor, image2: torch.Tensor, flow_gt: torch.Tensor,
                       valid: torch.Tensor | None = None):
    """One DEQ-Flow training step's backward with memory constant in the number of supervised states.

    Given the detached iterate it starts from, each fixed-point-correction state's graph (its phantom steps,
    the upsampler and its loss) is independent of the others; only the encoders and the correlation pyramid
    are shared. So the encoders run once with their graph and their outputs are detached into leaves, the
    solve runs without a graph, and the engine's `backward_in_stages` builds, backpropagates and frees each
    loss term (`DEQFlowOutput.loss_terms`: one per supervised state, plus the drift term) in turn, then
    sends the leaves' gradients back through the encoders once. The gradients equal those of
    ``model(...).loss.backward()`` (to rounding); the peak holds the encoders' graph and one state's graph
    instead of every state's. RAFT cannot do this: its updates chain, each iterate feeding the next.

    Accumulates into the parameters' .grad like ``loss.backward()``; returns the model output with ``loss``
    set to the total (detached).

    Example:
        >>> import torch, deqzoo
        >>> model = deqzoo.create_model("deq-flow-cpu-synth").train()
        >>> _ = model.set_deq(on_nonconvergence="ignore")
        >>> a, b, gt = torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64), torch.zeros(1, 2, 64, 64)
        >>> out = two_stage_backward(model, a, b, gt)
        >>> len(out.loss_terms), model.update_block.flow_head.conv2.bias.grad is not None
        (3, True)
    """
    features = model.features(image1, image2)
    leaves = features.detached()
    out = model(image1, image2, flow_gt=flow_gt, valid=valid, features=leaves, defer_loss=True,
                return_dict=True)
    out.loss = backward_in_stages(features.tensors(), leaves.tensors(), out.loss_terms)
    return out
