"""deqzoo: the model zoo and pretrained-model hub for deep equilibrium models.

Example:
    >>> import deqzoo
    >>> isinstance(deqzoo.list_models(), list)
    True
"""

__version__ = "0.1.0"

from .factory import ModelInfo, create_model, from_pretrained, list_models  # noqa: E402
from .integrations.transformers import register_all as _register_all  # noqa: E402

_register_all()

__all__ = ["ModelInfo", "__version__", "create_model", "from_pretrained", "list_models"]
