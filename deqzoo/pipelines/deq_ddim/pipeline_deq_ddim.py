"""DEQ-DDIM (Pokle, Geng & Kolter, 2022): a `diffusers.DiffusionPipeline` for any UNet2DModel + DDIMScheduler.

The deterministic DDIM chain x_T -> x_{t_1} -> ... -> x_0 (eta = 0) is one fixed-point system over all T
states Z = (X_1, ..., X_T), solved jointly by the deqzoo engine (Anderson by default) with the UNet
evaluated batched over all timesteps. The map is the paper's telescoped form: with c_i = sqrt(alpha_bar)
of state i and S_j = ddim_step(X_{j-1}, t_{j-1}),

    f(Z)_i = c_i * ( x_T / c_0 + sum_{j <= i} (S_j / c_j - X_{j-1} / c_{j-1}) ),

whose fixed point is exactly the sequential chain (X_i = S_i by induction), for any step (clipping and
thresholding included), and which hands x_T to every state in one evaluation (without clipping the sum is the
paper's cumulative eps sum). Inversion (`invert`) optimizes x_T with gradients through the fixed point:
warm-started Anderson solves and the engine's phantom gradient (one damped step, tau = 0.1), from DDIM
ODE inversion.

Example:
    >>> import torch
    >>> from diffusers import DDIMScheduler, UNet2DModel
    >>> from deqzoo.pipelines.deq_ddim import DEQDDIMPipeline
    >>> unet = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
    ...     down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    ...                    layers_per_block=1, norm_num_groups=4)
    >>> pipe = DEQDDIMPipeline(unet=unet, scheduler=DDIMScheduler())
    >>> out = pipe(batch_size=2, num_inference_steps=5, generator=torch.manual_seed(0), output_type="pt")
    >>> out.images.shape, out.deq_stats.nfe > 0
    (torch.Size([2, 1, 8, 8]), True)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DDIMInverseScheduler, DDIMScheduler, DiffusionPipeline, ImagePipelineOutput, UNet2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.schedulers import DDIMParallelScheduler
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from ...core import DEQ, DEQConfig, SolverStats, solve
from ...errors import CheckpointError
from ...hub.loading import RESOLVE_KEYWORDS, resolve
from ...hub.safetensors_io import check_component_folder
from ...hub.validation import confined, read_json

__all__ = [
    "DDIMChain", "DEQDDIMInversionOutput", "DEQDDIMPipeline", "DEQDDIMPipelineOutput", "check_components",
    "ieee_convolutions", "load_repository",
]


def check_components(unet: Any, scheduler: Any, eta: float = 0.0) -> None:
    """Raise a ValueError naming the component DEQ-DDIM cannot run (never falls back to another algorithm)."""
    if not isinstance(unet, UNet2DModel):
        raise ValueError(
            f"DEQDDIMPipeline: unet is a {type(unet).__name__}; DEQ-DDIM supports unconditional "
            "diffusers.UNet2DModel denoisers only"
        )
    if not isinstance(scheduler, DDIMScheduler):
        raise ValueError(
            f"DEQDDIMPipeline: scheduler is a {type(scheduler).__name__}; DEQ-DDIM solves the deterministic "
            "DDIM chain and needs a diffusers.DDIMScheduler (e.g. "
            "DDIMScheduler.from_config(scheduler.config), a different sampler than the configured one)"
        )
    if eta != 0:
        raise ValueError(
            f"DEQDDIMPipeline: eta={eta}; DEQ-DDIM solves the deterministic DDIM chain (eta = 0) only: "
            "stochastic DDIM/DDPM sampling is not a fixed point of the states"
        )


def _to_model_space(images: Any, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """PIL list / (N, H, W, C) numpy / (N, C, H, W) tensor, in [0, 1] -> float32 tensor in [-1, 1]
    (diffusers' own image preprocessing, without resizing)."""
    if isinstance(images, (list, tuple, np.ndarray, torch.Tensor)) and len(images) == 0:
        raise ValueError(f"images is an empty batch ({type(images).__name__} of length 0); "
                         "give at least one image")
    # vae_latent_channels=0: a 4-channel image is an image here, not a latent to pass through unnormalized
    images = VaeImageProcessor(do_resize=False, vae_latent_channels=0).preprocess(images).float()
    if shape is not None and tuple(images.shape[1:]) != tuple(shape):
        raise ValueError(
            f"images have shape (C, H, W) = {tuple(images.shape[1:])}; the UNet expects {tuple(shape)}"
        )
    return images


# Why: on Ampere and later GPUs torch runs cuDNN convolutions in TF32 by default (torch.backends.cudnn.conv
# .fp32_precision is "tf32"), rounding the UNet's products to about 1e-3 relative. The chain's fixed point is
# then defined only to that precision: the residual stalls near 1e-3, above the solve's default tol 1e-5, and
# the safeguard re-runs T + 1 exact sweeps. Measured on an H100 (ddim-digits-16, batch 8, T = 10 / 25 / 50;
# benchmarks/results/gpu_h100/2026-11-27/ddim_global_tf32_*.json): with TF32, depth 21 / 51 / 101 and
# 1.6 / 2.6 / 2.3x DDIMPipeline's time; in IEEE float32, depth 14 / 19 / 26 (Anderson alone converges) and
# 1.06 / 0.95 / 0.60x, max error against the sequential chain 1e-4 instead of 7e-4; at this size the IEEE
# convolutions cost no visible time per image. torch's per-operator flag (the API torch documents for TF32;
# it refuses the legacy `cudnn.allow_tf32` once conv and RNN differ) switches the convolutions only: RNNs and
# matmuls keep the process's setting.
class _IEEEConvolutions:
    """torch.backends.cudnn.conv.fp32_precision = "ieee" while held. The flag is process-wide and solves may
    overlap (threads of a server, nested calls), which torch's save-and-restore contexts do not cover: the
    first holder switches, the last one out restores, so an overlap never leaves the process switched."""

    def __init__(self) -> None:
        self.lock, self.holders, self.restore = threading.Lock(), 0, None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self.lock:
            if self.holders == 0:
                self.restore = torch.backends.cudnn.conv.fp32_precision
                torch.backends.cudnn.conv.fp32_precision = "ieee"
            self.holders += 1
        try:
            yield
        finally:
            with self.lock:
                self.holders -= 1
                if self.holders == 0:
                    torch.backends.cudnn.conv.fp32_precision = self.restore


_IEEE = _IEEEConvolutions()


@contextlib.contextmanager
def ieee_convolutions(device: torch.device | str) -> Iterator[None]:
    """cuDNN convolutions in IEEE float32 for the duration on a CUDA device, whatever the process's TF32
    setting, which is restored after (also on an exception, and when calls overlap: after the last); on other
    devices nothing changes.

    Example:
        >>> with ieee_convolutions("cuda"):
        ...     inside = torch.backends.cudnn.conv.fp32_precision
        >>> inside, torch.backends.cudnn.conv.fp32_precision
        ('ieee', 'tf32')
    """
    if torch.device(device).type != "cuda":
        yield
        return
    with _IEEE.hold():
        yield


class DDIMChain:
    """The deterministic DDIM chain of one scheduler setting as batched steps and as a fixed-point map.

    `timesteps` are the scheduler's (descending). State i = 0..T has scale c_i = sqrt(alpha_bar): c_0 at
    timesteps[0] (x_T), c_i for i >= 1 the "previous" alpha_bar of step i - 1, exactly as DDIMScheduler.step
    computes it. UNet evaluations are counted (`unet_calls`, `unet_images`) and chunked to `max_unet_batch`.
    On a GPU they run in IEEE float32 (`ieee_convolutions`) unless `allow_tf32`: TF32's rounding sits above
    the solve's tolerance.
    """

    def __init__(self, unet: UNet2DModel, scheduler: DDIMScheduler, num_inference_steps: int, *,
                 use_clipped_model_output: bool = False, max_unet_batch: int = 512, allow_tf32: bool = False):
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
        if max_unet_batch < 1:
            raise ValueError(f"max_unet_batch must be >= 1, got {max_unet_batch}")
        self.unet, self.scheduler = unet, scheduler
        scheduler.set_timesteps(num_inference_steps)
        self.T = len(scheduler.timesteps)
        self.timesteps = scheduler.timesteps.to(torch.long)
        prev = self.timesteps - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
        ac = scheduler.alphas_cumprod
        self.a_t = ac[self.timesteps]
        self.a_prev = torch.where(prev >= 0, ac[prev.clamp(min=0)], scheduler.final_alpha_cumprod)
        self.scale = torch.cat([self.a_t[:1], self.a_prev]).sqrt()  # c_0 .. c_T
        self.use_clipped = use_clipped_model_output
        # the batched step takes the final alpha as 1: a scheduler with set_alpha_to_one=False steps one
        # timestep at a time with DDIMScheduler.step
        self.batched = None
        if scheduler.config.set_alpha_to_one:
            self.batched = DDIMParallelScheduler.from_config(scheduler.config)
            self.batched.set_timesteps(num_inference_steps)
        self.max_unet_batch = max_unet_batch
        self.allow_tf32 = allow_tf32
        self.unet_calls = 0
        self.unet_images = 0

    def eps(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """UNet output for images x (N, C, H, W) at per-image timesteps t (N,), in chunks."""
        outs = []
        with contextlib.nullcontext() if self.allow_tf32 else ieee_convolutions(x.device):
            for lo in range(0, len(x), self.max_unet_batch):
                xs, ts = x[lo : lo + self.max_unet_batch], t[lo : lo + self.max_unet_batch]
                outs.append(self.unet(xs, ts.to(x.device)).sample)
                self.unet_calls += 1
                self.unet_images += len(xs)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def step(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """DDIM steps (eta = 0) of images x (N, C, H, W) at step indices idx (N,): diffusers' batched step
        (`DDIMParallelScheduler.batch_step_no_noise`), pinned against DDIMScheduler.step by
        tests/pipelines/test_deq_ddim_step.py for every prediction type, clipping and thresholding."""
        model_output = self.eps(x, self.timesteps[idx])
        if self.batched is not None:
            return self.batched.batch_step_no_noise(model_output, self.timesteps[idx], x, eta=0.0,
                                                    use_clipped_model_output=self.use_clipped)
        out = torch.empty_like(x)  # diffusers' own step, one call per timestep present (see __init__)
        for i in torch.unique(idx).tolist():
            sel = idx == i
            out[sel] = self.scheduler.step(model_output[sel], int(self.timesteps[i]), x[sel], eta=0.0,
                                           use_clipped_model_output=self.use_clipped).prev_sample
        return out

    def fixed_point_map(self, x_T: torch.Tensor, on_iterate: Callable[[torch.Tensor], None] | None = None,
                        form: str = "telescoped"):
        """f(Z) over states Z (B, T, C, H, W) = X_1..X_T given x_T (B, C, H, W); see the module docstring."""
        T = self.T
        c = self.scale.to(x_T.device, x_T.dtype).view(1, T + 1, *([1] * (x_T.ndim - 1)))
        if form == "drift":
            c = torch.ones_like(c)
        idx = torch.arange(T).repeat(x_T.shape[0])
        base = x_T.unsqueeze(1) / c[:, :1]

        def f(Z: torch.Tensor) -> torch.Tensor:
            if on_iterate is not None:
                on_iterate(Z)
            inputs = torch.cat([x_T.unsqueeze(1), Z[:, :-1]], dim=1)  # X_0 .. X_{T-1}
            S = self.step(inputs.flatten(0, 1), idx).view_as(Z)  # S_1 .. S_T
            if form == "step":
                return S
            D = S / c[:, 1:] - inputs / c[:, :-1]
            return c[:, 1:] * (base + torch.cumsum(D, dim=1))

        return f

    def inverse_map(self, x0: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """g(Y) over the unknown states Y (B, T, C, H, W) = X_0..X_{T-1} (X_0 = x_T) given the image
        x0 = X_T: the chain telescoped from its end,

            g(Y)_i = c_i (x0 / c_T - sum_{j >= i} (S_j(Y_j) / c_{j+1} - Y_j / c_j)),

        whose fixed points are exactly the chains that end at x0 (Y_{i+1} = S_i(Y_i), by induction from the
        end). Each evaluation hands x0 to every state, as the forward map hands x_T (the ODE inversion is one
        sequential sweep of the same equations with eps taken at the next state instead)."""
        T = self.T
        c = self.scale.to(x0.device, x0.dtype).view(1, T + 1, *([1] * (x0.ndim - 1)))
        idx = torch.arange(T).repeat(x0.shape[0])
        end = x0.unsqueeze(1) / c[:, -1:]

        def g(Y: torch.Tensor) -> torch.Tensor:
            S = self.step(Y.flatten(0, 1), idx).view_as(Y)  # S_i(X_i), i = 0..T-1
            D = S / c[:, 1:] - Y / c[:, :-1]
            tail = torch.flip(torch.cumsum(torch.flip(D, [1]), dim=1), [1])  # sum over j >= i
            return c[:, :-1] * (end - tail)

        return g

    def sequential(self, x_T: torch.Tensor) -> torch.Tensor:
        """All states X_1..X_T (B, T, C, H, W) by running the chain step after step (T batched calls;
        differentiable: the backprop baseline)."""
        states, x = [], x_T
        for i in range(self.T):
            x = self.step(x, torch.full((len(x),), i, dtype=torch.long))
            states.append(x)
        return torch.stack(states, dim=1)

    def invert_ode(self, x0: torch.Tensor) -> torch.Tensor:
        """DDIM ODE inversion (diffusers' `DDIMInverseScheduler`, no clipping): run the deterministic chain
        backwards from x_0, approximating eps(X_i, t_i) by eps(X_{i+1}, t_i); returns the x_T estimate."""
        inverse = DDIMInverseScheduler.from_config(self.scheduler.config, clip_sample=False)
        inverse.set_timesteps(self.T)
        x = x0
        for t in self.timesteps.flip(0):
            x = inverse.step(self.eps(x, t.repeat(len(x))), int(t), x).prev_sample
        return x


@dataclass
class DEQDDIMPipelineOutput(ImagePipelineOutput):
    """`images` as DDIMPipeline returns them, plus the engine's `deq_stats` and counts of UNet work.

    unet_images: images the UNet evaluated; unet_calls: batched UNet calls (chunks included); depth:
    sequential
    depth in batched evaluations of the whole chain (solver f evaluations + 1 for x_T's step)."""

    deq_stats: SolverStats | None = None
    unet_images: int = 0
    unet_calls: int = 0
    depth: int = 0


@dataclass
class DEQDDIMInversionOutput(BaseOutput):
    """latents: the x_T found (B, C, H, W); images: its DEQ-DDIM reconstruction in [0, 1] (B, C, H, W);
    mse: per-image mean squared error in [0, 1] pixel space (B,); history: (seconds, mean mse) per step;
    init_mse: the same error at the DDIM ODE inversion start."""

    latents: torch.Tensor
    images: torch.Tensor
    mse: torch.Tensor
    init_mse: torch.Tensor
    history: list = field(default_factory=list)


class DEQDDIMPipeline(DiffusionPipeline):
    r"""Deterministic DDIM sampling (eta = 0) as one fixed point over all T states, for any UNet2DModel +
    DDIMScheduler; `invert` finds the x_T that reproduces given images.

    Loads like any diffusers pipeline, e.g. ``DEQDDIMPipeline.from_pretrained(path_or_repo_id)`` on a
    DDIMPipeline repository (model_index.json, unet/, scheduler/). A repository whose scheduler is not a
    DDIMScheduler is refused; pass ``scheduler=DDIMScheduler.from_pretrained(repo, subfolder="scheduler")`` to
    choose DDIM deliberately.

    Example:
        >>> import torch
        >>> from deqzoo.pipelines.deq_ddim import DEQDDIMPipeline
        >>> pipe = DEQDDIMPipeline.from_pretrained("model_cards/ddim-digits-16")  # doctest: +SKIP
        >>> out = pipe(batch_size=4, num_inference_steps=25, generator=torch.manual_seed(0))  # doctest: +SKIP
        >>> out.images[0].size, out.deq_stats.nfe  # doctest: +SKIP
        ((16, 16), 14)
    """

    model_cpu_offload_seq = "unet"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> DEQDDIMPipeline:
        """diffusers' own loader, safetensors only, on a repository deqzoo resolved (local folder, embedded
        id, HF cache, Hub: safe files only) and checked first (`check_repository`): component classes from an
        allow-list, no file linking out of its folder, no pickle-only weights."""
        if kwargs.pop("use_safetensors", True) is False:
            raise ValueError("DEQDDIMPipeline loads safetensors only; use_safetensors=False is not supported")
        hub = {k: kwargs.pop(k) for k in RESOLVE_KEYWORDS if k in kwargs}
        directory = check_repository(resolve(pretrained_model_name_or_path, **hub),
                                     scheduler_given=kwargs.get("scheduler") is not None)
        return super().from_pretrained(str(directory), use_safetensors=True, **kwargs)

    def __init__(self, unet: UNet2DModel, scheduler: DDIMScheduler):
        super().__init__()
        check_components(unet, scheduler)
        self.register_modules(unet=unet, scheduler=scheduler)

    def _image_shape(self, batch_size: int) -> tuple[int, ...]:
        size = self.unet.config.sample_size
        hw = (size, size) if isinstance(size, int) else tuple(size)
        return (batch_size, self.unet.config.in_channels, *hw)

    def chain(self, num_inference_steps: int, *, use_clipped_model_output: bool = False,
              max_unet_batch: int = 512, allow_tf32: bool = False) -> DDIMChain:
        """The DDIM chain of this pipeline's UNet and scheduler at `num_inference_steps` (see DDIMChain)."""
        check_components(self.unet, self.scheduler)
        return DDIMChain(self.unet, self.scheduler, num_inference_steps,
                         use_clipped_model_output=use_clipped_model_output, max_unet_batch=max_unet_batch,
                         allow_tf32=allow_tf32)

    def solve_chain(self, chain: DDIMChain, x_T: torch.Tensor, *, solver: str = "anderson",
                    max_iter: int | None = None, tol: float = 1e-5, init: torch.Tensor | None = None,
                    on_iterate: Callable[[torch.Tensor], None] | None = None, form: str = "telescoped",
                    safeguard: bool = True, **solver_kwargs) -> tuple[torch.Tensor, SolverStats]:
        """Solve for all states (B, T, C, H, W) from x_T with the engine.

        `init` warm-starts (default: x_T in every state, as the paper). `form`: "telescoped" (the paper's map,
        default), "drift" (ParaDiGMS' cumulative drift, c_i = 1) or "step" (f(Z)_i = S_i). `max_iter` bounds
        the solver (default T). Every form's Jacobian is strictly block lower-triangular, so plain fixed-point
        iteration from any start is exact after T evaluations: with `safeguard`, a solve the solver leaves
        above `tol` continues with at most T + 1 fixed-point evaluations of the "step" form from its best
        iterate (``stats.solver`` then reads e.g. "anderson+fixed_point", ``stats.extra["safeguard_nfe"]``
        counts them), so a solve never returns a wrong chain for want of iterations.
        `on_iterate(Z)` sees every iterate f is evaluated at.
        """
        if form not in ("telescoped", "drift", "step"):
            raise ValueError(f"form must be 'telescoped', 'drift' or 'step', got {form!r}")
        T = chain.T
        z0 = x_T.unsqueeze(1).expand(-1, T, *x_T.shape[1:]).contiguous() if init is None else init
        if tuple(z0.shape) != (x_T.shape[0], T, *x_T.shape[1:]):
            raise ValueError(
                f"init has shape {tuple(z0.shape)}; expected {(x_T.shape[0], T, *x_T.shape[1:])}"
            )
        f = chain.fixed_point_map(x_T, on_iterate, form)
        with torch.no_grad():
            Z, stats = solve(f, z0, solver=solver, max_iter=max_iter if max_iter is not None else T, tol=tol,
                             stop_mode="rel", **solver_kwargs)
            stats.extra["safeguard_nfe"] = 0
            if safeguard and solver != "fixed_point" and not bool(stats.converged.all()):
                # the step form evaluates each state from its predecessor only (no cumulative sums through
                # the solver's unconverged states, which lose float precision), exact after T evaluations
                start = Z if bool(torch.isfinite(Z).all()) else z0
                Z, picard = solve(chain.fixed_point_map(x_T, on_iterate, "step"), start, solver="fixed_point",
                                  max_iter=T + 1, tol=tol, stop_mode="rel", div_factor=float("inf"))
                stats = replace(picard, nfe=stats.nfe + picard.nfe,
                                trace=torch.cat([stats.trace, picard.trace]), solver=f"{solver}+fixed_point",
                                extra={**stats.extra, "safeguard_nfe": picard.nfe})
        return Z, stats

    @torch.no_grad()
    def __call__(self, batch_size: int = 1, generator: torch.Generator | list[torch.Generator] | None = None,
                 eta: float = 0.0, num_inference_steps: int = 50,
                 use_clipped_model_output: bool | None = None, output_type: str | None = "pil",
                 return_dict: bool = True, latents: torch.Tensor | None = None, solver: str = "anderson",
                 max_iter: int | None = None, tol: float = 1e-5, max_unet_batch: int = 512,
                 form: str = "telescoped", safeguard: bool = True, allow_tf32: bool = False,
                 **solver_kwargs: Any) -> DEQDDIMPipelineOutput | tuple:
        r"""Sample like `DDIMPipeline(batch_size, generator, eta=0, num_inference_steps)`, solving the chain
        one fixed point.

        Args:
            latents: x_T (B, C, H, W); default: drawn from `generator` exactly as DDIMPipeline draws it.
            solver, max_iter, tol (relative residual of the whole chain), form, safeguard, solver_kwargs: see
                `solve_chain` (solver_kwargs go to `deqzoo.core.solve`, e.g. ``m=6`` for Anderson).
            max_unet_batch: the most images one UNet call sees (the memory budget).
            allow_tf32: on a GPU, let the UNet's convolutions run in TF32 as the process is set to (torch's
                default). Off by default: TF32 rounds to about 1e-3, above `tol`, so the solve stalls and the
                safeguard takes T + 1 more evaluations (`ieee_convolutions`); turn it on with a `tol` above
                1e-3.
        Returns:
            DEQDDIMPipelineOutput (images, deq_stats, unet_images, unet_calls, depth) or ``(images,)``.
        """
        check_components(self.unet, self.scheduler, eta)
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")
        if latents is None:
            if isinstance(generator, list) and len(generator) != batch_size:
                raise ValueError(f"{len(generator)} generators for batch_size {batch_size}")
            latents = randn_tensor(self._image_shape(batch_size), generator=generator,
                                   device=self._execution_device, dtype=self.unet.dtype)
        elif tuple(latents.shape[1:]) != self._image_shape(1)[1:]:
            raise ValueError(
                f"latents have shape {tuple(latents.shape)}; the UNet expects (B, "
                f"{', '.join(map(str, self._image_shape(1)[1:]))})"
            )
        chain = self.chain(num_inference_steps, use_clipped_model_output=bool(use_clipped_model_output),
                           max_unet_batch=max_unet_batch, allow_tf32=allow_tf32)
        Z, stats = self.solve_chain(chain, latents, solver=solver, max_iter=max_iter, tol=tol, form=form,
                                    safeguard=safeguard, **solver_kwargs)
        # [-1, 1] -> [0, 1] as DDIMPipeline does, keeping the UNet's dtype (diffusers' VaeImageProcessor
        # casts to float32, so a float64 UNet's samples would come back rounded)
        image = (Z[:, -1] / 2 + 0.5).clamp(0, 1)
        if output_type != "pt":
            image = image.cpu().permute(0, 2, 3, 1).numpy()
            if output_type == "pil":
                image = self.numpy_to_pil(image)
        if not return_dict:
            return (image,)
        return DEQDDIMPipelineOutput(images=image, deq_stats=stats, unet_images=chain.unet_images,
                                     unet_calls=chain.unet_calls, depth=stats.nfe)

    def invert(self, images: Any, num_inference_steps: int = 25, *, steps: int = 100, lr: float = 0.01,
               time_budget: float | None = None, init: str = "equilibrium", init_iter: int = 20,
               solver: str = "anderson", f_max_iter: int = 8, f_tol: float = 1e-3, tau: float = 0.1,
               k: int = 1, max_unet_batch: int = 512, progress: bool = False,
               callback: Callable[[int, float, torch.Tensor], None] | None = None, allow_tf32: bool = False
    ) -> DEQDDIMInversionOutput:
        r"""Find x_T whose DEQ-DDIM sample reproduces `images` (PIL list, (N, H, W, C) array or (N, C, H, W)
        tensor, in [0, 1]).

        `init="equilibrium"` (default) starts from the inverse chain solved as one fixed point over all T
        states (`DDIMChain.inverse_map`, `solver` for `init_iter` evaluations from the DDIM ODE inversion's
        trajectory); `init="ode"` starts at the DDIM ODE inversion, as the paper. With clipping the inverse
        system is ill-posed where pred_x0 is clipped (the step ignores those pixels), so its residual stalls
        and a fixed, small budget is used rather than a tolerance. Then `steps` Adam steps (lr) on x_T, each
        solving the chain with `solver` warm-started at the previous trajectory (at most `f_max_iter`
        evaluations, tolerance `f_tol`) and differentiating through the fixed point with the engine's phantom
        gradient (`k` damped steps, `tau`), as in the paper. `time_budget` (seconds) stops early;
        `callback(step, seconds, mse)` is called after each step; `allow_tf32` as in `__call__`. The
        returned latents are the best seen
        (lowest mean MSE of the warm-started solve at that x_T); their reconstruction and MSE come from a
        tight final solve. `init_mse` is the error at the start of the Adam steps; `history` starts with the
        ODE inversion's error.

        Example:
            >>> out = pipe.invert(images, num_inference_steps=25, steps=50)  # doctest: +SKIP
            >>> float(out.mse.mean()) < float(out.init_mse.mean())  # doctest: +SKIP
            True
        """
        check_components(self.unet, self.scheduler)
        if init not in ("equilibrium", "ode"):
            raise ValueError(f"init must be 'equilibrium' or 'ode', got {init!r}")
        if not isinstance(init_iter, int) or init_iter < 1:
            raise ValueError(f"init_iter must be a positive int, got {init_iter!r}")
        target = _to_model_space(images, self._image_shape(1)[1:]).to(self._execution_device, self.unet.dtype)
        chain = self.chain(num_inference_steps, max_unet_batch=max_unet_batch, allow_tf32=allow_tf32)
        t0 = time.perf_counter()
        with torch.no_grad():
            # start trajectories come from the sequential chain: exact, and T images cost less than a solve
            x_T = chain.invert_ode(target)
            Z = chain.sequential(x_T)
            history = [(time.perf_counter() - t0, float(_mse01(Z[:, -1], target).mean()))]
            if init == "equilibrium":
                # from the ODE trajectory X_0..X_{T-1}, a fixed budget (the system is ill-posed where clipping
                # is active, see above); the solver returns its best iterate by residual
                Y0 = torch.cat([x_T.unsqueeze(1), Z[:, :-1]], dim=1)
                Y, _ = solve(chain.inverse_map(target), Y0, solver=solver, max_iter=init_iter, tol=1e-12)
                x_T = Y[:, 0].contiguous()
                Z = chain.sequential(x_T)
                history.append((time.perf_counter() - t0, float(_mse01(Z[:, -1], target).mean())))
        init_mse = _mse01(Z[:, -1], target)
        deq = DEQ(
            DEQConfig(f_solver=solver, f_max_iter=f_max_iter, f_tol=f_tol, b_mode="phantom",
                      b_mode_kwargs={"k": k, "tau": tau}, on_nonconvergence="ignore")
        )
        param = torch.nn.Parameter(x_T.clone())
        opt = torch.optim.Adam([param], lr=lr)
        best_mse, best_x = float(init_mse.mean()), x_T.clone()
        self.unet.requires_grad_(False)
        try:
            for s in tqdm(range(steps), desc="invert", disable=not progress):
                Zs, _ = deq(chain.fixed_point_map(param), Z)
                loss = ((Zs[:, -1] - target) ** 2).mean()
                x_before = param.detach().clone()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                Z = Zs.detach()
                mse = _mse01(Z[:, -1], target)  # error of the trajectory at the pre-step x_T
                if float(mse.mean()) < best_mse:
                    best_mse, best_x = float(mse.mean()), x_before
                elapsed = time.perf_counter() - t0
                history.append((elapsed, float(mse.mean())))
                if callback is not None:
                    callback(s, elapsed, mse)
                if time_budget is not None and elapsed >= time_budget:
                    break
        finally:
            self.unet.requires_grad_(True)
        with torch.no_grad():  # the reconstruction of the returned x_T, solved tightly
            Z, _ = self.solve_chain(chain, best_x, solver=solver, tol=1e-5)
        return DEQDDIMInversionOutput(latents=best_x, images=(Z[:, -1] / 2 + 0.5).clamp(0, 1),
                                      mse=_mse01(Z[:, -1], target), init_mse=init_mse, history=history)


# What a diffusers repository may name in model_index.json when loaded through deqzoo: these classes only, so
# the repository's content never chooses code to import (diffusers itself imports any library it names).
_REPO_COMPONENTS = {"unet": ("diffusers", {"UNet2DModel"}),
                    "scheduler": ("diffusers", {"DDIMScheduler", "DDPMScheduler", "PNDMScheduler"})}


def check_repository(directory: Any, *, scheduler_given: bool = False) -> Any:
    """A local diffusers repository (model_index.json, unet/, scheduler/) checked before diffusers reads it:
    model_index.json names only the UNet2DModel and a scheduler from `_REPO_COMPONENTS` (its content never
    chooses code), every component file stays inside its folder and weights are safetensors
    (`deqzoo.hub.safetensors_io.check_component_folder`). Returns the directory."""
    directory = Path(directory)
    index_path = confined(directory, "model_index.json", directory)
    index = read_json(index_path)
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if key not in _REPO_COMPONENTS:
            raise CheckpointError(f"{index_path}: component {key!r} is not supported "
                                  f"(a DEQ-DDIM repository has {sorted(_REPO_COMPONENTS)})")
        library, classes = _REPO_COMPONENTS[key]
        if not (isinstance(value, list) and len(value) == 2 and value[0] == library and value[1] in classes):
            raise CheckpointError(f"{index_path}: component {key!r} = {value!r}; "
                                  f"expected [{library!r}, one of {sorted(classes)}]")
    for key in _REPO_COMPONENTS:
        if key not in index:
            raise CheckpointError(f"{index_path}: no {key!r} component")
        check_component_folder(confined(directory, key, index_path), index_path)
    if not scheduler_given and index["scheduler"][1] != "DDIMScheduler":
        raise ValueError(f"{index_path}: scheduler {index['scheduler'][1]} is not a DDIMScheduler; "
                         "DEQ-DDIM solves the deterministic DDIM chain only (pass "
                         "scheduler=DDIMScheduler(...) to choose DDIM deliberately)")
    return directory


# the loader the family declaration names (deqzoo.models.registry): diffusers' own, after `check_repository`
load_repository = DEQDDIMPipeline.from_pretrained


def _mse01(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image MSE in [0, 1] pixel space of model-space tensors (B, C, H, W)."""
    d = (x.detach().clamp(-1, 1) - target) / 2.0
    return d.pow(2).flatten(1).mean(1)
