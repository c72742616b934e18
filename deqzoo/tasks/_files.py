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
