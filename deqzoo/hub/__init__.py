"""Hub: resolution (local -> embedded -> HF cache -> Hub), catalog, safe loading, push, model cards."""

from .cards import read_model_card
from .catalog import load_catalog
from .loading import is_offline, load_state_dict, resolve
from .push import push_folder
from .safetensors_io import CheckpointError
from .saving import atomic_save

__all__ = ["CheckpointError", "atomic_save", "is_offline", "load_catalog", "load_state_dict", "push_folder",
           "read_model_card", "resolve"]
