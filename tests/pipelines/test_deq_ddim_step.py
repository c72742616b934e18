"""DDIMChain.step is diffusers' batched DDIM step (images at different timesteps in one call): pinned here
against DDIMScheduler.step itself, image by image, for every prediction type, with and without
clipping, clipped-model-output and dynamic thresholding, in float32 and float64."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler  # noqa: E402

from deqzoo.pipelines.deq_ddim import DDIMChain  # noqa: E402


class _FixedUNet(torch.nn.Module):
    """A deterministic 'denoiser' whose output depends on the image and its timestep (no weights to train)."""

    class _Out:
        def __init__(self, sample):
            self.sample = sample

    def forward(self, x, t):
        t = t.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        return self._Out(torch.sin(3.0 * x + t / 97.0) * 1.5 + 0.1 * t / 1000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("clip", ["none", "clip", "threshold"])
@pytest.mark.parametrize("use_clipped", [False, True])
@pytest.mark.parametrize("alpha_one", [True, False])  # False: the last step's alpha is alphas_cumprod[0]
def test_batched_step_equals_ddim_scheduler_step(dtype, prediction_type, clip, use_clipped, alpha_one):
    scheduler = DDIMScheduler(prediction_type=prediction_type, clip_sample=clip == "clip",
                              set_alpha_to_one=alpha_one,
                              clip_sample_range=0.8, thresholding=clip == "threshold",
                              dynamic_thresholding_ratio=0.9, sample_max_value=1.2)
    T = 12
    chain = DDIMChain(_FixedUNet(), scheduler, T, use_clipped_model_output=use_clipped)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2 * T, 2, 5, 5, generator=g) * 1.7).to(dtype)
    idx = torch.arange(T).repeat(2)  # every timestep, twice, in one batch
    got = chain.step(x, idx)

    reference = DDIMScheduler.from_config(scheduler.config)
    reference.set_timesteps(T)
    unet = _FixedUNet()
    for n in range(len(x)):
        t = reference.timesteps[idx[n]]
        eps = unet(x[n : n + 1], t.view(1)).sample
        want = reference.step(eps, t, x[n : n + 1], eta=0.0, use_clipped_model_output=use_clipped).prev_sample
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got[n : n + 1], want, rtol=tol, atol=tol)
