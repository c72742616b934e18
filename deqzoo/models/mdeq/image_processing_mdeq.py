"""MDEQImageProcessor: PIL / numpy / torch images -> normalized ``pixel_values`` for MDEQ models.

Follows transformers' image-processor conventions (saved as ``preprocessor_config.json`` next to the weights,
loaded by ``AutoImageProcessor``, torchvision backend), so ``pipeline("image-classification",
model=directory)`` works on raw images as people give them:

* **modes**: grayscale models (``num_channels=1``) convert any input to luminance (ITU-R 601, as PIL's "L");
  RGB models convert to RGB. Images with transparency (RGBA, LA, palette with a transparent colour, or
  4-channel arrays) are first composited over a **white** background, as an image viewer shows them.
* **polarity** (``do_invert``): the MNIST models were trained on light digits on a dark background, whereas a
  paint program or a scan gives dark ink on light paper. ``do_invert=True`` always inverts (``max - x``),
  ``False`` never does, and the default ``None`` decides per image for grayscale models: the image is inverted
  when its border (a ring of ``max(1, round(min(H, W) / 14))`` pixels, 2 at 28x28) is brighter on average than
  the midpoint of the image's darkest and brightest values, i.e. when the background is light. RGB models
  never invert unless asked.

Example:
    >>> import numpy as np
    >>> from PIL import Image
    >>> from deqzoo.models.mdeq import MDEQConfig
    >>> from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor
    >>> proc = MDEQImageProcessor.from_config(MDEQConfig(in_channels=1, image_size=(28, 28),
    ...                                                  image_mean=[0.1307],
    ...                                                  image_std=[0.3081]))
    >>> proc(Image.new("RGB", (40, 30)), return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 1, 28, 28])
    >>> ink = np.full((28, 28), 255, np.uint8); ink[8:20, 12:16] = 0    # a dark stroke on white paper
    >>> light = np.where(ink == 0, 255, 0).astype(np.uint8)           # the same stroke, light on dark
    >>> bool((proc(ink)["pixel_values"][0] == proc(light)["pixel_values"][0]).all())
    True
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_utils import ChannelDimension, PILImageResampling, infer_channel_dimension_format
from transformers.processing_utils import ImagesKwargs

__all__ = ["MDEQImageProcessor", "MDEQImageProcessorKwargs", "has_light_background"]

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64).reshape(3, 1, 1)  # ITU-R 601, as PIL's "L"


class MDEQImageProcessorKwargs(ImagesKwargs, total=False):
    """The processor's own options beyond transformers' ``ImagesKwargs`` (per call or saved)."""

    num_channels: int
    do_invert: bool | None


def has_light_background(image: np.ndarray) -> bool:
    """Whether a channels-first image's border is brighter than the midpoint of its value range (a light
    background, e.g. dark ink on paper). A uniform image has no background to judge: False.

    Example:
        >>> paper = np.full((1, 28, 28), 250, np.uint8); paper[0, 10:18, 10:18] = 5
        >>> has_light_background(paper), has_light_background(255 - paper)
        (True, False)
    """
    gray = image.astype(np.float64).mean(axis=0)
    h, w = gray.shape
    ring = max(1, round(min(h, w) / 14))
    lo, hi = float(gray.min()), float(gray.max())
    if hi <= lo:
        return False
    inner = gray[ring : h - ring, ring : w - ring]
    border_sum = gray.sum() - inner.sum()
    border_mean = border_sum / (gray.size - inner.size)
    return bool(border_mean > (lo + hi) / 2)


def _value_range_top(arr: np.ndarray) -> float:
    """The value of full intensity: 255 for integer images, 1 for float images in [0, 1], else 255."""
    if np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
        return 255.0
    return 1.0 if float(arr.max()) <= 1.0 else 255.0


def _pil_to_array(image, num_channels: int) -> np.ndarray:
    """A PIL image -> channels-first uint8 array with `num_channels` channels (transparency over white)."""
    from PIL import Image

    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode in ("P", "L", "RGB") and "transparency" in image.info
    )
    if transparent:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    arr = np.asarray(image.convert("L" if num_channels == 1 else "RGB"))
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _array_to_channels(arr: np.ndarray, num_channels: int, input_data_format) -> np.ndarray:
    """A numpy image (H, W), (C, H, W) or (H, W, C) with C in 1, 3, 4 -> channels-first, `num_channels`."""
    if arr.ndim == 2:
        arr = arr[None]
    elif arr.ndim != 3:
        raise ValueError(f"an image must have 2 or 3 dimensions, got shape {tuple(arr.shape)}")
    else:
        if input_data_format is None:
            input_data_format = infer_channel_dimension_format(arr, num_channels=(1, 3, 4))
        if ChannelDimension(input_data_format) == ChannelDimension.LAST:
            arr = arr.transpose(2, 0, 1)
    channels = arr.shape[0]
    if channels == 4:  # straight alpha, composited over white as for PIL images
        top = _value_range_top(arr[:3])
        alpha = arr[3:].astype(np.float64) / top
        rgb = arr[:3].astype(np.float64) * alpha + top * (1.0 - alpha)
        arr = (np.rint(rgb) if np.issubdtype(arr.dtype, np.integer) else rgb).astype(arr.dtype)
        channels = 3
    if channels == num_channels:
        return arr
    if num_channels == 1 and channels == 3:
        gray = (arr.astype(np.float64) * _LUMA).sum(0, keepdims=True)
        return (np.rint(gray) if np.issubdtype(arr.dtype, np.integer) else gray).astype(arr.dtype)
    if num_channels == 3 and channels == 1:
        return np.repeat(arr, 3, axis=0)
    raise ValueError(f"image with {channels} channels cannot be converted to {num_channels}")


def _with_channel_axis(images):
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 2:
        return images[None]
    if isinstance(images, (list, tuple)):
        return [_with_channel_axis(im) for im in images]
    return images


class MDEQImageProcessor(TorchvisionBackend):
    """Convert to ``num_channels`` (1: gray, 3: RGB; transparency over white), invert dark-on-light images
    (``do_invert``, see the module docstring), resize to ``size``, rescale to [0, 1], normalize."""

    model_input_names = ["pixel_values"]
    valid_kwargs = MDEQImageProcessorKwargs
    resample = PILImageResampling.BILINEAR
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"height": 32, "width": 32}
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = False
    num_channels = 3
    do_invert = None

    def __init__(self, num_channels: int = 3, do_invert: bool | None = None, **kwargs):
        if num_channels not in (1, 3):
            raise ValueError(f"MDEQImageProcessor.num_channels must be 1 or 3, got {num_channels}")
        if do_invert is not None and not isinstance(do_invert, bool):
            raise ValueError(
                f"MDEQImageProcessor.do_invert must be True, False or None (auto), got {do_invert!r}")
        super().__init__(num_channels=num_channels, do_invert=do_invert, **kwargs)

    @classmethod
    def from_config(cls, config, **kwargs) -> MDEQImageProcessor:
        """The processor matching an :class:`MDEQConfig` (size, channels, mean, std)."""
        h, w = config.image_size
        return cls(num_channels=config.in_channels, size={"height": h, "width": w},
                   image_mean=list(config.image_mean), image_std=list(config.image_std), **kwargs)

    def preprocess(self, images, *args, **kwargs):
        # a 2-D array or tensor is one grayscale image (H, W): given a channel axis, as PIL's "L" images are
        return super().preprocess(_with_channel_axis(images), *args, **kwargs)

    def process_image(self, image, do_convert_rgb=None, input_data_format=None, device=None,
                      num_channels=None, do_invert=None, **kwargs) -> torch.Tensor:
        from PIL import Image

        channels = self.num_channels if num_channels is None else num_channels
        if isinstance(image, Image.Image):
            arr = _pil_to_array(image, channels)
        else:
            arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
            arr = _array_to_channels(arr, channels, input_data_format)
        invert = self.do_invert if do_invert is None else do_invert
        if invert is None:  # auto: only grayscale (digit) models, on a light background
            invert = channels == 1 and has_light_background(arr)
        if invert:
            arr = (_value_range_top(arr) - arr.astype(np.float64)).astype(arr.dtype)
        tensor = torch.from_numpy(np.array(arr, copy=True))  # a copy: PIL's arrays are read-only
        return tensor if device is None else tensor.to(device)
