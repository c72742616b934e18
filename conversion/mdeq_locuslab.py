"""Convert the original MDEQ checkpoints of locuslab (``.pkl`` state dicts) to deqzoo checkpoint directories.

Two upstream releases share one format, both accepted here as ``mdeq-locuslab``:

* locuslab/deq ``MDEQ-Vision`` (the maintained code): ``torch.save(model.state_dict())`` of ``MDEQClsNet`` /
  ``MDEQSegNet``; the released ImageNet and Cityscapes ``.pkl`` files and ``final_state.pth.tar``.
* locuslab/mdeq (the 2020 code): the same keys plus ``fullstage_copy.*`` (a frozen copy of f_θ used by its
  backward pass) and the aliases ``deq.func.*`` / ``deq.func_copy.*``; the copies are dropped, the alias is
  checked to equal ``fullstage.*``.

Training checkpoints (``checkpoint.pth.tar``: a dict holding ``state_dict``) and DataParallel prefixes
(``module.``) are unwrapped. Pickles are read with ``torch.load(weights_only=True)`` only.

The key map is explicit: :data:`KEY_MAP` maps every original prefix to ours, :data:`DROPPED` lists what is
dropped, and :func:`key_map` expands both for a given config into one row per deqzoo key (with the weight-norm
re-parametrization when the two sides store a conv differently). A key of the checkpoint that no row uses,
or a row whose original key is absent, is an error naming the key and the file.

The architecture comes from ``--option arch=<preset>`` (an ``mdeq-*`` preset of
:data:`deqzoo.models.mdeq.ARCHITECTURES`), from ``--option yaml=<original experiments/*.yaml>``, or, by
default, from the checkpoint's shapes matched against the presets (fields that no shape reveals, such as
``num_groups`` and the stem's strides, come from the matching preset or from options).

Command line::

    deqzoo convert mdeq-locuslab MDEQ_XL_cls.pkl out/mdeq-imagenet-xl --option arch=mdeq-imagenet-xl
    deqzoo convert mdeq-locuslab final_state.pth.tar out/tiny \
        --option yaml=experiments/cifar/cls_mdeq_TINY.yaml

Example:
    >>> from pathlib import Path
    >>> import tempfile, deqzoo
    >>> src = Path("conversion/fixtures/mdeq/mdeq_vision_tiny.pkl")
    >>> out = convert(src, tempfile.mkdtemp()) if src.exists() else None   # doctest: +SKIP
    >>> model = deqzoo.from_pretrained(out)                                 # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from deqzoo.hub.catalog import sha256_file

from ._common import check_output

__all__ = [
    "DROPPED", "FORMATS", "KEY_MAP", "ConversionError", "KeyMapEntry", "apply_key_map", "canonical_locuslab",
    "config_from_yaml", "convert", "convert_state_dict", "infer_structure", "key_map", "load_checkpoint",
    "resolve_config", "write_converted",
]

FORMAT = "mdeq-locuslab"

# Original prefix -> deqzoo prefix. Every kept key of an original checkpoint starts with one of these.
KEY_MAP: list[tuple[str, str]] = [
    ("downsample.", "mdeq.downsample."),  # stem (+ DS3... stages when DOWNSAMPLE_TIMES > 2)
    ("stage0.", "mdeq.stage0."),  # input injection
    ("fullstage.", "mdeq.fullstage."),  # f_θ: branches, fuse_layers, post_fuse_layers
    ("incre_modules.", "incre_modules."),  # classification head
    ("downsamp_modules.", "downsamp_modules."),
    ("final_layer.", "final_layer."),
    ("classifier.", "classifier."),
    ("last_layer.", "last_layer."),  # segmentation head
]
# Prefixes dropped: the 2020 release's frozen copy of f_θ (refreshed from fullstage every forward) and the
# MDEQWrapper's aliases of fullstage / fullstage_copy. `deq.func.` is verified equal to `fullstage.` first.
DROPPED: tuple[str, ...] = ("fullstage_copy.", "deq.func_copy.", "deq.func.")
_ALIAS = ("deq.func.", "fullstage.")
_CONTAINER_KEYS = ("state_dict", "model_state_dict", "model")


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file and the key or value at fault."""


# ---- reading -------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read an original checkpoint as a flat {key: tensor} dict.

    Unpickles with weights_only=True, unwraps training containers, strips ``module.`` prefixes.

    Example:
        >>> sd = load_checkpoint("conversion/fixtures/mdeq/mdeq_vision_tiny.pkl")   # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError) as err:
        raise ConversionError(
            f"{path}: not a loadable weights-only torch checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from err
    if isinstance(obj, dict):
        for key in _CONTAINER_KEYS:
            if isinstance(obj.get(key), dict) and obj[key] and all(isinstance(k, str) for k in obj[key]):
                if any(isinstance(v, torch.Tensor) for v in obj[key].values()):
                    obj = obj[key]
                    break
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: expected a state dict (dict of tensors), got {type(obj).__name__}")
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise ConversionError(f"{path}: state dict key {key!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise ConversionError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        name = key
        while name.startswith("module."):
            name = name[len("module.") :]
        if name in out:
            raise ConversionError(f"{path}: key {key!r} collides with another key after stripping 'module.'")
        out[name] = value
    if not out:
        raise ConversionError(f"{path}: the state dict is empty")
    return out


def canonical_locuslab(sd: dict[str, torch.Tensor], path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Drop the 2020 release's copies/aliases (checking the alias) and return the MDEQ-Vision key set."""
    alias, target = _ALIAS
    out = {}
    for key, value in sd.items():
        if key.startswith(alias):
            twin = target + key[len(alias) :]
            if twin in sd and value.device.type != "meta" and not torch.equal(sd[twin], value):
                raise ConversionError(f"{path}: {key!r} should alias {twin!r} but holds different values")
            if twin not in sd:
                raise ConversionError(f"{path}: {key!r} has no counterpart {twin!r}")
            continue
        if key.startswith(DROPPED):
            continue
        out[key] = value
    return out


# ---- the architecture ----------------------------------------------------------------------------


def _need(sd: dict[str, torch.Tensor], key: str, path) -> torch.Tensor:
    if key not in sd:
        raise ConversionError(f"{path}: missing key {key!r}, needed to read the architecture")
    return sd[key]


def _conv_weight_shape(sd, prefix: str, path) -> torch.Size:
    for suffix in ("weight", "weight_v"):
        if prefix + suffix in sd:
            return sd[prefix + suffix].shape
    raise ConversionError(
        f"{path}: missing key {prefix + 'weight'!r} (or its weight-norm {prefix + 'weight_v'!r})"
    )


def infer_structure(sd: dict[str, torch.Tensor], path: str | os.PathLike = "<state dict>") -> dict[str, Any]:
    """The MDEQConfig fields that a canonical (MDEQ-Vision-named) state dict's keys and shapes determine."""
    branch_ids = sorted({int(m.group(1)) for k in sd if (m := re.match(r"fullstage\.branches\.(\d+)\.", k))})
    if not branch_ids or branch_ids != list(range(len(branch_ids))):
        raise ConversionError(
            f"{path}: no consecutive 'fullstage.branches.<i>.' keys found (got branches "
            f"{branch_ids}); is this an MDEQ checkpoint?"
        )
    n = len(branch_ids)
    channels, blocks, big, inner = [], [], [], []
    for i in range(n):
        nb = len(
            {int(m.group(1)) for k in sd if (m := re.match(rf"fullstage\.branches\.{i}\.blocks\.(\d+)\.", k))}
        )
        c1 = _conv_weight_shape(sd, f"fullstage.branches.{i}.blocks.0.conv1.", path)
        c2 = _conv_weight_shape(sd, f"fullstage.branches.{i}.blocks.0.conv2.", path)
        channels.append(int(c1[1]))
        inner.append(int(c1[0]))
        blocks.append(nb)
        big.append(0 if c1[-1] == 3 and c2[-1] == 3 else 1 if c2[-1] == 3 else 2)
    expansion = inner[0] / channels[0]
    expansion = int(expansion) if float(expansion).is_integer() else expansion
    for i in range(n):
        if int(expansion * channels[i]) != inner[i]:
            raise ConversionError(
                f"{path}: branch {i} inner width {inner[i]} != expansion {expansion} x "
                f"{channels[i]} channels (inconsistent expansion factors)"
            )
    wnorm_keys = [f"fullstage.branches.{i}.blocks.0.conv1.weight_g" for i in range(n)]
    fields: dict[str, Any] = {
        "in_channels": int(_need(sd, "downsample.0.weight", path).shape[1]),
        "branch_channels": channels,
        "num_blocks": blocks,
        "big_kernels": big,
        "expansion_factor": expansion,
        "wnorm": all(k in sd for k in wnorm_keys),
        "block_gn_affine": "fullstage.branches.0.blocks.0.gn1.weight" in sd,
        "post_gn_affine": "fullstage.post_fuse_layers.0.gnorm.weight" in sd,
        "has_stage0": any(k.startswith("stage0.") for k in sd),
        "extra_stem_downsamples": len(
            {m.group(1) for k in sd if (m := re.match(r"downsample\.DS(\d+)\.", k))}
        ),
    }
    if n > 1:
        fields["fuse_gn_affine"] = "fullstage.fuse_layers.0.1.net.gnorm.weight" in sd
    if "classifier.weight" in sd:
        fields["task"] = "image-classification"
        fields["num_labels"] = int(sd["classifier.weight"].shape[0])
        fields["final_chansize"] = int(sd["classifier.weight"].shape[1])
        fields["head_channels"] = [
            int(_need(sd, f"incre_modules.{i}.0.conv1.weight", path).shape[0]) for i in range(n)
        ]
    elif "last_layer.3.weight" in sd:
        fields["task"] = "image-segmentation"
        w = sd["last_layer.3.weight"]
        fields["num_labels"] = int(w.shape[0])
        fields["final_conv_kernel"] = int(w.shape[-1])
    else:
        raise ConversionError(
            f"{path}: neither 'classifier.weight' (classification) nor 'last_layer.3.weight' "
            "(segmentation) found: cannot tell the task head"
        )
    return fields


# config fields that shapes cannot tell; they come from a preset, a yaml, or options
_HIDDEN_FIELDS = (
    "num_groups",
    "downsample_times",
    "dropout",
    "num_layers",
    "bn_momentum",
    "image_size",
    "image_mean",
    "image_std",
    "deq",
)
_STRUCT_FIELDS = (
    "in_channels",
    "branch_channels",
    "num_blocks",
    "big_kernels",
    "expansion_factor",
    "head_channels",
    "final_chansize",
    "num_labels",
    "final_conv_kernel",
)


def _architectures() -> dict[str, dict[str, Any]]:
    from deqzoo.models.mdeq import ARCHITECTURES

    return {k: v for k, v in ARCHITECTURES.items() if not v["config"].get("lipschitz")}


def _preset_fields(name: str) -> tuple[dict[str, Any], str]:
    from deqzoo.models.mdeq import MDEQConfig

    presets = _architectures()
    if name not in presets:
        raise ConversionError(f"unknown arch={name!r}; MDEQ presets: {sorted(presets)}")
    cfg = MDEQConfig(**presets[name]["config"])
    names = _STRUCT_FIELDS + _HIDDEN_FIELDS + ("wnorm", "block_gn_affine", "fuse_gn_affine", "post_gn_affine")
    fields = {k: getattr(cfg, k) for k in names}
    fields["deq"] = presets[name]["config"]["deq"]   # as written in the preset, not expanded
    return fields, presets[name]["task"]


def _matches(structure: dict[str, Any], preset: dict[str, Any], task: str) -> bool:
    if structure["task"] != task:
        return False
    keys = [
        k
        for k in _STRUCT_FIELDS
        if k in structure and not (task == "image-segmentation" and k in ("head_channels", "final_chansize"))
    ]
    return all(_same(structure[k], preset[k]) for k in keys)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return float(a) == float(b)


def config_from_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """MDEQConfig kwargs from an original ``experiments/*/*.yaml`` (MDEQ-Vision or locuslab/mdeq).

    Example:
        >>> config_from_yaml("MDEQ-Vision/experiments/cifar/cls_mdeq_TINY.yaml")   # doctest: +SKIP
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ConversionError(f"{path}: cannot read the yaml config ({err})") from err
    model = (doc or {}).get("MODEL")
    if not isinstance(model, dict) or "EXTRA" not in model:
        raise ConversionError(f"{path}: no MODEL.EXTRA section; not an MDEQ experiment yaml")
    stage = model["EXTRA"].get("FULL_STAGE") or {}
    if "NUM_CHANNELS" not in stage:
        raise ConversionError(f"{path}: MODEL.EXTRA.FULL_STAGE.NUM_CHANNELS missing")
    n = len(stage["NUM_CHANNELS"])
    is_seg = "FINAL_CONV_KERNEL" in model["EXTRA"] or "HEAD_CHANNELS" not in stage
    out: dict[str, Any] = {
        "branch_channels": stage["NUM_CHANNELS"],
        "num_blocks": stage.get("NUM_BLOCKS", [1] * n),
        "big_kernels": stage.get("BIG_KERNELS", [0] * n),
        "expansion_factor": model.get("EXPANSION_FACTOR", 5),
        "num_groups": model.get("NUM_GROUPS", 4),
        "dropout": float(model.get("DROPOUT", 0.0)),
        "wnorm": bool(model.get("WNORM", False)),
        "downsample_times": model.get("DOWNSAMPLE_TIMES", 2),
        "block_gn_affine": model.get("BLOCK_GN_AFFINE", True),
        "fuse_gn_affine": model.get("FUSE_GN_AFFINE", True),
        "post_gn_affine": model.get("POST_GN_AFFINE", True),
        "num_layers": model.get("NUM_LAYERS", 5),
    }
    size = model.get("IMAGE_SIZE") or (doc.get("TEST") or {}).get("IMAGE_SIZE")
    if size:
        out["image_size"] = [int(size[1]), int(size[0])]  # yaml is (W, H)
    if is_seg:
        out["num_labels"] = (doc.get("DATASET") or {}).get("NUM_CLASSES", model.get("NUM_CLASSES"))
        out["final_conv_kernel"] = model["EXTRA"].get("FINAL_CONV_KERNEL", 1)
        out["bn_momentum"] = 0.01
    else:
        out["num_labels"] = model.get("NUM_CLASSES", 1000)
        out["head_channels"] = stage["HEAD_CHANNELS"]
        out["final_chansize"] = stage["FINAL_CHANSIZE"]
    deq = doc.get("DEQ") or {}
    f_solver = str(deq.get("F_SOLVER", "broyden")).strip("'\"")
    b_solver = deq.get("B_SOLVER")
    b_solver = f_solver if b_solver in (None, "None") else str(b_solver).strip("'\"")
    stop = deq.get("STOP_MODE", "abs")  # the originals' default
    out["deq"] = {
        "f_solver": f_solver,
        "f_max_iter": int(deq.get("F_THRES", model.get("F_THRES", 30))),
        "f_stop_mode": stop,
        "f_tol": 1e-3,
        "b_mode": "ift",
        "b_solver": b_solver,
        "b_max_iter": int(deq.get("B_THRES", model.get("B_THRES", 40))),
        "b_stop_mode": stop,
        "b_tol": 1e-3,
    }
    return out


def resolve_config(
    structure: dict[str, Any], options: dict[str, Any], path: str | os.PathLike = "<state dict>"
):
    """(MDEQConfig, task, preset name or None).

    Structure from the checkpoint; hidden fields from arch / yaml / the preset matching its shapes;
    options last.
    """
    from deqzoo.models.mdeq import MDEQConfig

    options = dict(options)
    arch, yaml_path = options.pop("arch", None), options.pop("yaml", None)
    if arch and yaml_path:
        raise ConversionError("give either arch=<preset> or yaml=<file>, not both")
    task = structure["task"]
    base: dict[str, Any]
    preset = None
    if yaml_path:
        # fields no yaml states (input normalization, ...) come from the preset of the same shapes, if any
        found = [name for name in _architectures() if _matches(structure, _preset_fields(name)[0], task)]
        base = {**(_preset_fields(found[0])[0] if found else {}), **config_from_yaml(yaml_path)}
        preset = found[0] if found else None
    elif arch:
        base, preset_task = _preset_fields(arch)
        if preset_task != task:
            raise ConversionError(
                f"{path}: the checkpoint has a {task} head but arch={arch!r} is {preset_task}"
            )
        preset = arch
    else:
        found = [name for name in _architectures() if _matches(structure, _preset_fields(name)[0], task)]
        if not found:
            base = {}
            missing = [k for k in ("num_groups", "downsample_times") if k not in options]
            if missing:
                raise ConversionError(
                    f"{path}: its shapes ({_describe(structure)}) match no MDEQ preset, and {missing} "
                    "cannot be "
                    "read from shapes; pass --option arch=<preset>, --option yaml=<original yaml>, or the "
                    f"missing fields as options (e.g. --option num_groups=8 --option downsample_times=2)"
                )
        else:
            preset = found[0]  # presets with equal shapes differ only in solver settings
            base = _preset_fields(preset)[0]
    fields = {**base}
    fields.update(
        {
            k: v
            for k, v in structure.items()
            if k in _STRUCT_FIELDS or k in ("wnorm", "block_gn_affine", "fuse_gn_affine", "post_gn_affine")
        }
    )
    if (yaml_path or arch) and any(
        not _same(structure[k], base[k]) for k in _STRUCT_FIELDS if k in structure and k in base
    ):
        diffs = {
            k: (structure[k], base[k])
            for k in _STRUCT_FIELDS
            if k in structure and k in base and not _same(structure[k], base[k])
        }
        raise ConversionError(
            f"{path}: checkpoint shapes disagree with {'yaml' if yaml_path else 'arch'} "
            f"(field: (checkpoint, config)) {diffs}"
        )
    if task == "image-segmentation":
        fields.pop("head_channels", None)
        fields.pop("final_chansize", None)
    fields.update(options)
    try:
        config = MDEQConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"{path}: cannot build an MDEQConfig from {fields}: {err}") from err
    _check_stem(config, structure, path)
    labels = _LABELS.get((task, config.num_labels))
    if labels and "id2label" not in options:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    return config, task, preset


# class names of the originals' datasets (CIFAR-10 order; Cityscapes train ids), for pipelines' labels;
# `--option id2label=...` overrides
_LABELS: dict[tuple[str, int], list[str]] = {
    ("image-classification", 10): ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                   "ship", "truck"],
    ("image-segmentation", 19): ["road", "sidewalk", "building", "wall", "fence", "pole", "traffic light",
                                 "traffic sign", "vegetation", "terrain", "sky", "person", "rider", "car",
                                 "truck", "bus", "train", "motorcycle", "bicycle"],
}


def _describe(s: dict[str, Any]) -> str:
    keys = ("branch_channels", "expansion_factor", "head_channels", "final_chansize", "num_labels")
    return ", ".join(f"{k}={s[k]}" for k in keys if k in s)


def _check_stem(config, structure: dict[str, Any], path) -> None:
    want_stage0 = not (config.downsample_times == 0 and config.num_branches <= 2)
    if want_stage0 != structure["has_stage0"]:
        raise ConversionError(
            f"{path}: the checkpoint {'has' if structure['has_stage0'] else 'lacks'} 'stage0.*' "
            f"keys, which contradicts downsample_times={config.downsample_times} with "
            f"{config.num_branches} branches"
        )
    extra = max(0, config.downsample_times - 2)
    if extra != structure["extra_stem_downsamples"]:
        raise ConversionError(
            f"{path}: the checkpoint has {structure['extra_stem_downsamples']} extra stem stages "
            f"('downsample.DS<i>.*') but downsample_times={config.downsample_times} needs {extra}"
        )


# ---- the key map ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyMapEntry:
    """deqzoo key <- original key(s); `transform`: "copy", "fold_weight_norm" (w = g v / ||v||), or
    "weight_norm_g" / "weight_norm_v" (split a plain weight into weight norm's g = ||w||, v = w)."""

    target: str
    sources: tuple[str, ...]
    transform: str = "copy"


def _to_original(target: str, key_map: list[tuple[str, str]]) -> str:
    for orig, ours in key_map:
        if target.startswith(ours):
            return orig + target[len(ours) :]
    raise ConversionError(f"deqzoo key {target!r} has no row in the key map")


def key_map(
    target_keys: list[str], source_keys, key_map_rows: list[tuple[str, str]] = KEY_MAP
) -> list[KeyMapEntry]:
    """One entry per deqzoo key: where it comes from in the (canonical) original state dict."""
    source_keys = set(source_keys)
    entries = []
    for target in target_keys:
        orig = _to_original(target, key_map_rows)
        if orig in source_keys:
            entries.append(KeyMapEntry(target, (orig,)))
        elif orig.endswith(".weight") and {orig + "_g", orig + "_v"} <= source_keys:
            entries.append(KeyMapEntry(target, (orig + "_g", orig + "_v"), "fold_weight_norm"))
        elif orig.endswith((".weight_g", ".weight_v")) and orig[:-2] in source_keys:
            entries.append(KeyMapEntry(target, (orig[:-2],), "weight_norm_" + orig[-1]))
        else:
            entries.append(KeyMapEntry(target, (orig,), "missing"))
    return entries


def _norm_except_dim0(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(w.double(), dim=tuple(range(1, w.dim())), keepdim=True)


def apply_key_map(
    entries: list[KeyMapEntry],
    source: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    path: str | os.PathLike = "<state dict>",
) -> dict[str, torch.Tensor]:
    """Build the deqzoo state dict; errors name every missing, unused and mis-shaped key at once."""
    missing = [e.sources[0] for e in entries if e.transform == "missing"]
    used = {s for e in entries for s in e.sources}
    unused = sorted(set(source) - used)
    problems = []
    if missing:
        problems.append(f"missing original key(s) {missing}")
    if unused:
        problems.append(f"unknown key(s) not in the MDEQ key map for this config {unused}")
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.transform == "missing":
            continue
        if e.transform == "copy":
            value = source[e.sources[0]]
        elif e.transform == "fold_weight_norm":
            g, v = source[e.sources[0]], source[e.sources[1]]
            value = (v.double() * (g.double() / _norm_except_dim0(v))).to(v.dtype)
        elif e.transform == "weight_norm_g":
            value = _norm_except_dim0(source[e.sources[0]]).to(source[e.sources[0]].dtype)
        elif e.transform == "weight_norm_v":
            value = source[e.sources[0]]
        else:
            raise AssertionError(e.transform)
        want = expected[e.target]
        if tuple(value.shape) != tuple(want.shape):
            problems.append(
                f"shape mismatch {e.sources} -> {e.target!r}: checkpoint {tuple(value.shape)} vs "
                f"model {tuple(want.shape)}"
            )
            continue
        if value.is_floating_point() != want.is_floating_point():
            problems.append(f"dtype mismatch {e.sources} -> {e.target!r}: {value.dtype} vs {want.dtype}")
            continue
        out[e.target] = value.to(want.dtype).clone().contiguous()
    if problems:
        raise ConversionError(f"{path}: " + "; ".join(problems))
    return out


# ---- end to end ----------------------------------------------------------------------------------


def release_2020_solver(deq: dict[str, Any]) -> dict[str, Any]:
    """The forward solver of locuslab/mdeq (the 2020 release; lib/modules/deq2d.py and broyden.py), from
    the settings read from its yaml or preset (`deq`, with ``f_max_iter`` = F_THRES).

    Its forward is always Broyden, stopped when the whole batch's residual norm is below eps = 1e-5
    sqrt(B D) (absolute; tol 1e-5 per element) or after F_THRES steps, which are F_THRES + 1 evaluations of
    f (x0's included), and it returns the iterate with the lowest whole-batch residual for every sample
    (broyden's ``best="batch"``), not f of it. That selection makes a sample's answer depend on its
    batch-mates, as in the original: converted 2020 checkpoints reproduce the release batch by batch, and
    ``deq={"f_solver_kwargs": {}}`` at load gives deqzoo's per-sample (batch-independent) selection instead.

    Example:
        >>> release_2020_solver({"f_solver": "anderson", "f_max_iter": 22})["f_solver_kwargs"]
        {'best': 'batch'}
    """
    return {**deq, "f_solver": "broyden", "f_max_iter": int(deq.get("f_max_iter", 30)) + 1, "f_tol": 1e-5,
            "f_stop_mode": "abs", "f_solver_kwargs": {"best": "batch"}, "f_final_step": False}


def convert_state_dict(
    sd: dict[str, torch.Tensor],
    options: dict[str, Any] | None = None,
    path: str | os.PathLike = "<state dict>",
    key_map_rows: list[tuple[str, str]] = KEY_MAP,
    device: str | None = None,
    release_2020: bool = False,
):
    """(deqzoo model with the converted weights, info dict) from a canonical original state dict, in memory.

    ``release_2020``: the checkpoint is locuslab/mdeq's; its forward solver is `release_2020_solver`.

    ``device="meta"`` checks keys and shapes only (no memory for the weights; the model is left unloaded).
    """
    from deqzoo.models.mdeq import MDEQForImageClassification, MDEQForSemanticSegmentation

    structure = infer_structure(sd, path)
    config, task, preset = resolve_config(structure, options or {}, path)
    if release_2020 and "deq" not in (options or {}):
        config.deq = release_2020_solver(config.deq)
    cls = MDEQForImageClassification if task == "image-classification" else MDEQForSemanticSegmentation
    with torch.device(device or "cpu"):
        model = cls(config)
    expected = model.state_dict()
    entries = key_map(list(expected), sd, key_map_rows)
    new = apply_key_map(entries, sd, expected, path)
    info = {"task": task, "preset": preset, "key_map": entries, "structure": structure}
    if device != "meta":
        model.load_state_dict(new, strict=True)
    return model.eval(), info


def write_converted(model, info: dict[str, Any], src: Path, out: Path, fmt: str, source_desc: str) -> Path:
    """Save config.json + model.safetensors + preprocessor_config.json + README.md (card) into `out`."""
    from deqzoo.models.mdeq.image_processing_mdeq import MDEQImageProcessor

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # the preset's input size and normalization, so pipeline(task, model=out) works on raw images
    MDEQImageProcessor.from_config(model.config).save_pretrained(out)
    _write_card(out, model, info, src, fmt, source_desc)
    return out


def _write_card(out: Path, model, info: dict[str, Any], src: Path, fmt: str, source_desc: str) -> None:
    cfg = model.config
    preset = info["preset"]
    short = out.name or "converted"
    folded = [e for e in info["key_map"] if e.transform != "copy"]
    rows = (
        "\n".join(f"| `{o}` | `{n}` |" for o, n in KEY_MAP)
        if fmt == FORMAT
        else "\n".join(f"| `{o}` | `{n}` |" for o, n in info.get("key_map_rows", KEY_MAP))
    )
    n_params = sum(p.numel() for p in model.parameters())
    solver = {k: v for k, v in cfg.deq.items() if k.startswith("f_") and k != "f_solver_kwargs"}
    body = f"""Converted from an original checkpoint ({source_desc}) with `deqzoo convert {fmt}`.

- Source file: `{src.name}` (sha256 `{sha256_file(src)}`)
- Architecture: {f"preset `{preset}`" if preset else "read from the checkpoint and options"}; branch channels
  {cfg.branch_channels}, expansion {cfg.expansion_factor}, {n_params:,} parameters
- Solver settings (from the original config; change with `model.set_deq(...)`): `{solver}`
- Key map: original prefix -> deqzoo prefix; {len(folded)} conv weight(s) re-parametrized between weight norm
  (`weight_g`, `weight_v`) and plain `weight`, exactly (w = g v / ||v||).

| original | deqzoo |
|---|---|
{rows}

The weights are the original authors'; no metric was re-measured by this conversion.
"""
    try:
        from utils.cards import build_metadata, render_model_card
    except ImportError:  # pragma: no cover - hub helper absent
        (out / "README.md").write_text(f"# {short}\n\n{body}", encoding="utf-8")
        return
    dataset = {
        "image-classification": ("imagenet-1k" if cfg.num_labels == 1000 else "cifar10"),
        "image-segmentation": "cityscapes",
    }[info["task"]]
    meta = build_metadata(
        model_id=f"deqzoo/{short}",
        pipeline_tag=info["task"],
        task_module="mdeq_converted",
        datasets=[dataset],
        dataset_name=dataset,
        metrics=[],
        tags=["mdeq", "converted", fmt],
    )
    meta.pop("deqzoo_task", None)  # no deqzoo task module evaluates these datasets offline
    title = f"# MDEQ {preset or ''} converted from {source_desc}".replace("  ", " ")
    render = render_model_card(meta, f"{title}\n\n{body}")
    (out / "README.md").write_text(render, encoding="utf-8")


def convert(src: str | os.PathLike, out: str | os.PathLike, **options: Any) -> Path:
    """Convert a locuslab MDEQ ``.pkl`` (MDEQ-Vision or locuslab/mdeq) into a deqzoo checkpoint directory.

    Options: ``arch`` (an ``mdeq-*`` preset), ``yaml`` (the original experiment yaml), or any MDEQConfig field
    (e.g. ``num_groups``, ``downsample_times``, ``deq``).

    Example:
        >>> convert("MDEQ_S.pkl", "out/mdeq-imagenet-small", arch="mdeq-imagenet-small")  # doctest: +SKIP
        PosixPath('out/mdeq-imagenet-small')
    """
    check_output(src, out)
    src, out = Path(src), Path(out)
    raw = load_checkpoint(src)
    release_2020 = any(k.startswith(DROPPED) for k in raw)  # only locuslab/mdeq's checkpoints carry copies
    sd = canonical_locuslab(raw, src)
    model, info = convert_state_dict(sd, options, src, release_2020=release_2020)
    return write_converted(model, info, src, out, FORMAT, "locuslab MDEQ (MDEQ-Vision / locuslab/mdeq) .pkl")


FORMATS = {FORMAT: convert}
