"""Hub: resolution (local -> embedded -> HF cache -> Hub), catalog, safe loading, push, model cards."""

from .cards import read_model_card
from .catalog import load_catalog
from .loading import is_offline, load_state_dict, resolve
from .push import push_folder
from .safetensors_io import CheckpointError
from .saving import atomic_save


def save(model, directory, processor=None):
    """Save a model (and optional processor/tokenizer) atomically into `directory`.

    Example:
        >>> deqzoo.hub.save(model, "model_cards/mdeq-tiny-mnist", processor)  # doctest: +SKIP
    """
    def write(tmp):
        model.save_pretrained(tmp / "m")  # itself atomic; moved up so model + processor land in one rename
        for item in (tmp / "m").iterdir():
            item.rename(tmp / item.name)
        (tmp / "m").rmdir()
        if processor is not None:
            processor.save_pretrained(str(tmp))

    return atomic_save(directory, write)


__all__ = ["CheckpointError", "atomic_save", "is_offline", "load_catalog", "load_state_dict", "push_folder",
           "read_model_card", "resolve", "save"]
