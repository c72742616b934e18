"""What every converter shares: reading an original state dict without unpickling code."""

from __future__ import annotations

from pathlib import Path

import torch

# containers the original training scripts nest their weights under
_NESTED_KEYS = ("model_state_dict", "state_dict", "model")


def check_output(src: str | Path, out: str | Path) -> None:
    """Refuse an output folder that is, or contains, the source file (a save there must never touch it), or
    that is an existing file."""
    src_path, out_path = Path(src).resolve(), Path(out).resolve()
    if src_path == out_path or out_path in src_path.parents:
        raise ValueError(f"output {out} contains the source {src}; choose an output folder outside it")
    if out_path.exists() and not out_path.is_dir():
        raise FileExistsError(f"output {out} exists and is a file; a checkpoint is a folder")


def load_state_dict(src: str | Path) -> dict[str, torch.Tensor]:
    """An original-format state dict (plain, or nested under a training container's key), read with
    ``torch.load(weights_only=True)``: a whole pickled model, or any pickle that would run code, is refused.
    DataParallel's ``module.`` prefix is removed."""
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{src}: not a weights-only torch state dict ({err}); whole pickled models are "
                         "refused, save model.state_dict() instead") from err
    for key in _NESTED_KEYS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{src}: expected a dict of tensors (a state dict), got {type(obj).__name__}")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def fill_model(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load converted weights into `model`, strictly: missing, unexpected and mis-shaped keys are one error
    naming `source` and both shapes; values are cast to the parameters' dtypes."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"{source}: converted weights do not fit {type(model).__name__}: missing {missing}, "
            f"unexpected {unexpected}, mis-shaped {shapes}"
        )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def with_options(src: str | Path, fixed: dict, options: dict) -> dict:
    """Config keywords: what the checkpoint's weights fix (`fixed`) plus the user's `options`. An option that
    would change what the weights fix is refused naming it (passed twice it would be a bare TypeError)."""
    clash = sorted(set(fixed) & set(options))
    if clash:
        key = clash[0]
        raise ValueError(f"{src}: option {key}={options[key]!r} cannot be set: the checkpoint fixes it "
                         f"({key}={fixed[key]!r})")
    return {**fixed, **options}


# What each original release's evaluation forward returns from its solve, per forward solver (issue 58), as
# read from its code: f of the accepted (lowest-residual) iterate applied n times (DEQConfig.f_final_step=n),
# or the iterate itself (absent: False). Solvers an original does not have return the iterate.
RETURNED_POINT: dict[str, dict[str, int]] = {
    # torchdeq/solver/fp_iter.py and anderson.py keep f of each sample's lowest iterate (broyden.py: the
    # iterate); TorchDEQ's DEQIndexing returns it unchanged in eval
    "torchdeq": {"fixed_point": 1, "anderson": 1},
    # deq-flow code.v.2.0/core/deq/solvers.py: naive_solver returns its last f output, anderson F of the
    # lowest iterate (broyden: the iterate)
    "deq-flow-v2.0": {"fixed_point": 1, "anderson": 1},
    # locuslab/deq lib/solvers.py (DEQ-Transformer, MDEQ-Vision), locuslab/mdeq's broyden and deq-flow
    # code.v.1.0/core/lib/solvers.py: anderson's X and broyden's x, the iterate itself
    "locuslab": {},
    # SwiftieH/IGNN inn_pred: the iterate whose residual passed (at its budget: the last f output)
    "swiftieh": {},
    # locuslab/ImpSq forward_iteration returns its last f output, and ImplicitLayer.forward applies f again
    "impsq": {"fixed_point": 2},
}


def original_returned_point(origin: str, settings: dict, given: dict | None = None) -> dict:
    """`settings` (a DEQConfig dict) with ``f_final_step`` set to what the `origin` release returns for its
    forward solver (`RETURNED_POINT`), unless the user's own `given` settings name ``f_final_step``.

    Example:
        >>> original_returned_point("torchdeq", {"f_solver": "fixed_point"})["f_final_step"]
        1
        >>> original_returned_point("locuslab", {"f_solver": "anderson"})["f_final_step"]
        False
    """
    if given and "f_final_step" in given:
        return dict(settings)
    steps = RETURNED_POINT[origin].get(settings.get("f_solver", "anderson"), False)
    return {**settings, "f_final_step": steps}
