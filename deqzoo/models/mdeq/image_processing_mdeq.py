"""MDEQImageProcessor: PIL / numpy / torch images -> normalized ``pixel_values`` for MDEQ models.

Follows transformers' image-processor conventions (saved as ``preprocessor_config.json`` next to the weights,
loaded by ``AutoImageProcessor``), so ``pipeline("image-classification", model=directory)`` works on raw
images. Grayscale models (``num_channels=1``) convert any input to luminance; RGB models convert to RGB.

Example:
    >>> from PIL import Image
    >>> from deqzoo.models.mdeq import MDEQConfig
    >>> from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor
    >>> proc = MDEQImageProcessor.from_config(MDEQConfig(in_channels=1, image_size=(28, 28),
    ...                                                  image_mean=[0.1307],
    ...                                                  image_std=[0.3081]))
    >>> proc(Image.new("RGB", (40, 30)), return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 1, 28, 28])
"""

from __future__ import annotations

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling

__all__ = ["MDEQImageProcessor"]


class MDEQImageProcessor(PilBackend):
    """Resize to ``size``, convert to ``num_channels`` (1: gray, 3: RGB), rescale to [0, 1], normalize."""

    model_input_names = ["pixel_values"]
    resample = PILImageResampling.BILINEAR
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"height": 32, "width": 32}
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = False

    def __init__(self, num_channels: int = 3, **kwargs):
        if num_channels not in (1, 3):
            raise ValueError(f"MDEQImageProcessor.num_channels must be 1 or 3, got {num_channels}")
        super().__init__(**kwargs)
        self.num_channels = num_channels

    @classmethod
    def from_config(cls, config) -> MDEQImageProcessor:
        """The processor matching an :class:`MDEQConfig` (size, channels, mean, std)."""
        h, w = config.image_size
        return cls(
            num_channels=config.in_channels,
            size={"height": h, "width": w},
            image_mean=list(config.image_mean),
            image_std=list(config.image_std),
        )

    def process_image(self, image, do_convert_rgb=None, input_data_format=None, **kwargs) -> np.ndarray:
        from PIL import Image

        if isinstance(image, Image.Image):
            image = np.array(image.convert("L" if self.num_channels == 1 else "RGB"))
            input_data_format = None
        arr = super().process_image(
            image, do_convert_rgb=False, input_data_format=input_data_format, **kwargs
        )
        channels = arr.shape[0]
        if channels == 4:  # RGBA arrays: drop alpha
            arr, channels = arr[:3], 3
        if channels == self.num_channels:
            return arr
        if self.num_channels == 1 and channels == 3:  # ITU-R 601 luminance, as PIL's "L"
            weights = np.array([0.299, 0.587, 0.114], dtype=np.float64).reshape(3, 1, 1)
            gray = (arr.astype(np.float64) * weights).sum(0, keepdims=True)
            return (np.rint(gray) if np.issubdtype(arr.dtype, np.integer) else gray).astype(arr.dtype)
        if self.num_channels == 3 and channels == 1:
            return np.repeat(arr, 3, axis=0)
        raise ValueError(f"image with {channels} channels cannot be converted to {self.num_channels}")
