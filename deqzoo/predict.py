"""File helpers shared by the task modules' `predict`/`demo` writers."""

from __future__ import annotations

from pathlib import Path


def free_path(path: str | Path) -> Path:
    """`path`, or path-1, path-2, ... when a file is there: a prediction never overwrites a user's file.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "flow.png").write_bytes(b"mine")
        >>> free_path(folder / "flow.png").name
        'flow-1.png'
    """
    path = Path(path)
    if not path.exists():
        return path
    for i in range(1, 10000):
        candidate = path.with_name(f"{path.stem}-{i}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"{path}: 10,000 numbered files already exist beside it; choose another name")


def open_image(path: str | Path, label: str, *, max_pixels: int, modes: tuple[str, ...] | None = None):
    """A loaded PIL image from `path`, checked before decoding: the pixel count from the header against
    `max_pixels`, the mode against `modes` (any when None); a decompression bomb or an unreadable file is a
    ValueError. Every message starts with `label` (the command and file it is about).

    Example:
        >>> import tempfile
        >>> from PIL import Image
        >>> file = Path(tempfile.mkdtemp()) / "digit.png"
        >>> Image.new("L", (28, 28)).save(file)
        >>> open_image(file, "predict: 'digit.png'", max_pixels=4096 * 4096).size
        (28, 28)
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"{label} is {width}x{height} = {width * height:,} pixels, above the "
                                 f"limit of {max_pixels:,}; not decoded")
            if modes is not None and image.mode not in modes:
                raise ValueError(f"{label} has image mode {image.mode!r}; readable modes are "
                                 f"{', '.join(modes)} (save it as an 8-bit PNG or JPEG)")
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ValueError(f"{label} is a decompression bomb ({err})") from err
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{label} is not a readable image ({err})") from err
    return image
