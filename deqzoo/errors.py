"""The base class of deqzoo's errors: ``except deqzoo.DeqzooError`` catches every failure deqzoo reports.

Each concrete error also derives from the built-in class its callers caught before (ValueError, OSError, ...),
so existing handlers keep working; messages name the file, key and shapes at fault.
"""


class DeqzooError(Exception):
    """Base class of every error deqzoo raises on purpose."""


class CheckpointError(DeqzooError, ValueError):
    """A checkpoint file is missing, unsafe, corrupt or does not match its config."""


class CheckpointMismatchError(CheckpointError, RuntimeError):
    """Weights whose shapes, dtypes or keys do not fit the config. Also a RuntimeError: transformers raises
    RuntimeError there, and fine-tuning code catches that."""
