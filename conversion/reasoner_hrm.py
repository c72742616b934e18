"""Convert HRM release checkpoints (sapientinc/HRM, ``models/hrm/hrm_act_v1.py``) to deqzoo's reasoner family.

Input: the folder the original ``pretrain.py`` writes (and the released checkpoints on the Hub carry):
``all_config.yaml`` (``yaml.dump`` of its PretrainConfig: the ``arch`` section holds H_cycles, L_cycles,
layers, widths, halting settings) beside a state dict file (``step_<N>`` from
``torch.save(model.state_dict())`` or ``checkpoint`` as released). The state dict is read with
``torch.load(weights_only=True)``; the YAML with ``yaml.safe_load``: neither can run code. SRC is the state
dict file or its folder (the highest ``step_<N>``, else ``checkpoint``); only ``all_config.yaml`` in that same
folder is read.

Keys are those of the ACT loss head around the model, ``model.inner.*``, prefixed ``_orig_mod.`` when the run
used ``torch.compile`` (both accepted). Mapping: L_level -> ``reasoner.l_net``, H_level -> ``reasoner.h_net``
(attention ``qkv_proj``/``o_proj`` -> ``attn.qkv``/``attn.out``, SwiGLU ``gate_up_proj``/``down_proj`` ->
``gate_up``/``down``, TRM's ``mlp_t`` -> ``token_mlp``), ``H_init``/``L_init`` -> ``y_init``/``z_init``
(bfloat16 buffers in bfloat16 runs: widened exactly), ``embed_pos`` -> ``position``, ``q_head`` kept with its
(halt, continue) rows.

What the reasoner does not model, and how it is handled:
- The puzzle-identifier embedding (``puzzle_emb.weights``, one row per identifier, ``puzzle_emb_ndim`` wide):
  deqzoo's prefix is one learned block shared by every input. A table of one row (the Sudoku and Maze
  releases: every puzzle has identifier 0) becomes that prefix exactly (zero-padded to whole positions, as
  the original pads). A table of several rows (ARC) is refused unless ``--option puzzle_identifier=K`` picks
  the row the converted model will always use. ``puzzle_emb_ndim: 0`` is refused (the reasoner needs a
  prefix position for its Q-head).
- ``seq_len`` is dataset metadata, not in all_config.yaml; it is read from the weights where they fix it
  (learned positions, TRM's mlp_t) and otherwise needs ``--option seq_len=N`` (Sudoku 81, Maze 900).
- Halting: the converted config carries halt_max_steps, halt_exploration_prob, H_cycles, L_cycles and the
  gradient mode (HRM: 1-step); ``halting`` is "budget", what the originals do at evaluation (every sample runs
  halt_max_steps segments). deqzoo's "act" rule is TRM's ``no_ACT_continue`` rule (halt logit > 0); HRM's
  training rule (halt > continue, with a Q-learning target) is not implemented.

    deqzoo convert hrm-sapientinc checkpoints/HRM-checkpoint-sudoku-extreme out_dir --option seq_len=81
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ._common import check_output, fill_model, load_state_dict, with_options

CONFIG_FILE = "all_config.yaml"
_MAX_CONFIG_BYTES = 1 << 20  # an all_config.yaml is about 1 KB
HRM_ARCH_NAMES = ("hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1",)
_STEP = re.compile(r"step_(\d+)")
_BLOCK = {"self_attn.qkv_proj.weight": "attn.qkv.weight", "self_attn.o_proj.weight": "attn.out.weight",
          "mlp.gate_up_proj.weight": "mlp.gate_up.weight", "mlp.down_proj.weight": "mlp.down.weight",
          "mlp_t.gate_up_proj.weight": "token_mlp.gate_up.weight",
          "mlp_t.down_proj.weight": "token_mlp.down.weight"}
_TOP = {"embed_tokens.embedding_weight": "reasoner.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
        "q_head.weight": "q_head.weight", "q_head.bias": "q_head.bias", "H_init": "reasoner.y_init",
        "L_init": "reasoner.z_init", "embed_pos.embedding_weight": "reasoner.position"}


def locate(src: str | Path) -> tuple[Path, Path]:
    """(state dict file, all_config.yaml beside it) for SRC, a state dict file or the folder holding one."""
    src = Path(src)
    if src.is_dir():
        steps = sorted((int(m.group(1)), p) for p in src.iterdir()
                       if p.is_file() and (m := _STEP.fullmatch(p.name)))
        if steps:
            weights = steps[-1][1]
        elif (src / "checkpoint").is_file():
            weights = src / "checkpoint"
        else:
            raise FileNotFoundError(f"{src}: no state dict in the folder (expected step_<N> or checkpoint)")
    elif src.is_file():
        weights = src
    else:
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    config = weights.parent / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: the original run's {CONFIG_FILE} must sit beside "
                                f"the state dict {weights.name}")
    return weights, config


def read_arch(path: Path, names: tuple[str, ...], fmt: str) -> dict[str, Any]:
    """The ``arch`` section of an all_config.yaml, read with ``yaml.safe_load`` (no tags that build
    objects), its ``name`` one of `names`."""
    import yaml

    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, larger than any all_config.yaml "
                         f"({_MAX_CONFIG_BYTES} at most)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a plain YAML all_config ({err})") from err
    arch = data.get("arch") if isinstance(data, dict) else None
    if not isinstance(arch, dict):
        raise ValueError(f"{path}: no 'arch' section (not an HRM/TRM all_config.yaml)")
    if arch.get("name") not in names:
        raise ValueError(f"{path}: key 'arch.name' is {arch.get('name')!r}; the {fmt} converter reads "
                         f"{list(names)}")
    return arch


def _number(arch: dict, key: str, kind: type, path: Path, default: Any = None) -> Any:
    value = arch.get(key, default)
    if value is None:
        raise ValueError(f"{path}: key 'arch.{key}' is missing")
    ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{path}: key 'arch.{key}' must be {kind.__name__}, got {value!r}")
    return kind(value)


def strip_prefixes(sd: dict[str, torch.Tensor], src: Path) -> dict[str, torch.Tensor]:
    """``_orig_mod.`` (torch.compile) and ``model.`` (the ACT loss head) removed; every key must then lie
    under ``inner.`` (the original's inner model)."""
    out = {}
    for key, value in sd.items():
        name = key.removeprefix("_orig_mod.").removeprefix("model.")
        if not name.startswith("inner."):
            raise ValueError(f"{src}: unexpected key {key!r} (an HRM/TRM state dict holds "
                             "[_orig_mod.]model.inner.* keys)")
        out[name.removeprefix("inner.")] = value
    return out


def _shape(sd: dict[str, torch.Tensor], key: str, src: Path, ndim: int) -> torch.Size:
    if key not in sd:
        raise ValueError(f"{src}: missing key 'inner.{key}'")
    if sd[key].dim() != ndim:
        raise ValueError(f"{src}: key 'inner.{key}' has shape {tuple(sd[key].shape)}, expected {ndim} dims")
    return sd[key].shape


def puzzle_prefix(sd: dict[str, torch.Tensor], arch: dict, prefix_len: int, hidden: int, src: Path,
                  cfg_path: Path, puzzle_identifier: int | None) -> torch.Tensor:
    """The original's puzzle embedding of one identifier as deqzoo's shared prefix (prefix_len, hidden):
    the row, zero-padded to whole positions, exactly as the original's forward lays it out."""
    ndim = _number(arch, "puzzle_emb_ndim", int, cfg_path, 0)
    if ndim <= 0:
        raise ValueError(f"{cfg_path}: key 'arch.puzzle_emb_ndim' is {ndim}: checkpoints without a puzzle "
                         "embedding are not supported (deqzoo's reasoner reads its Q-head from a prefix "
                         "position)")
    rows, width = _shape(sd, "puzzle_emb.weights", src, 2)
    if width != ndim:
        raise ValueError(f"{src}: key 'inner.puzzle_emb.weights' has shape {(rows, width)}; all_config's "
                         f"puzzle_emb_ndim is {ndim}")
    if prefix_len * hidden < ndim:
        raise ValueError(f"{cfg_path}: {prefix_len} puzzle positions of {hidden} cannot hold "
                         f"puzzle_emb_ndim={ndim}")
    if puzzle_identifier is None:
        if rows != 1:
            raise ValueError(
                f"{src}: key 'inner.puzzle_emb.weights' holds {rows} puzzle-identifier embeddings "
                f"(num_puzzle_identifiers={rows}); deqzoo's reasoner has one prefix shared by every input: "
                "pass --option puzzle_identifier=K to convert the model for identifier K")
        puzzle_identifier = 0
    if isinstance(puzzle_identifier, bool) or not isinstance(puzzle_identifier, int) \
            or not 0 <= puzzle_identifier < rows:
        raise ValueError(f"option puzzle_identifier={puzzle_identifier!r} must be an integer in [0, {rows})")
    row = sd.pop("puzzle_emb.weights")[puzzle_identifier].float()
    return F.pad(row, (0, prefix_len * hidden - ndim)).view(prefix_len, hidden)


def reasoner_config(sd: dict[str, torch.Tensor], arch: dict, *, architecture: str, prefix_len: int,
                    mlp_t: bool, src: Path, cfg_path: Path, seq_len: int | None) -> dict[str, Any]:
    """deqzoo ReasonerConfig keywords from the original's arch settings and tensor shapes (the shapes win
    where both tell: a disagreement is an error naming the key)."""
    hidden = _number(arch, "hidden_size", int, cfg_path)
    vocab, width = _shape(sd, "embed_tokens.embedding_weight", src, 2)
    if width != hidden:
        raise ValueError(f"{src}: key 'inner.embed_tokens.embedding_weight' has shape {(vocab, width)}; "
                         f"all_config's hidden_size is {hidden}")
    labels = _shape(sd, "lm_head.weight", src, 2)[0]
    pos = arch.get("pos_encodings")
    if pos not in ("rope", "learned"):
        if architecture == "hrm":  # the HRM original raises NotImplementedError for anything else
            raise ValueError(f"{cfg_path}: key 'arch.pos_encodings' is {pos!r}; HRM knows rope and learned")
        pos = "none"  # TRM: any other value means no position encoding
    positions = None  # seq_len + prefix, where the weights fix it
    if pos == "learned":
        positions = _shape(sd, "embed_pos.embedding_weight", src, 2)[0]
    elif mlp_t:
        positions = _shape(sd, "L_level.layers.0.mlp_t.gate_up_proj.weight", src, 2)[1]
    if positions is not None:
        if seq_len is not None and seq_len != positions - prefix_len:
            raise ValueError(f"option seq_len={seq_len} disagrees with {src}: its weights hold "
                             f"{positions} positions, {prefix_len} of them puzzle positions")
        seq_len = positions - prefix_len
    if seq_len is None:
        raise ValueError(f"{src}: the sequence length is not in the weights or in {cfg_path.name} (it is "
                         "dataset metadata): pass --option seq_len=N (Sudoku 81, Maze 900, ARC 900)")
    l_layers = _number(arch, "L_layers", int, cfg_path)
    kw: dict[str, Any] = dict(
        architecture=architecture, vocab_size=int(vocab), num_labels=int(labels), seq_len=int(seq_len),
        num_prefix_tokens=prefix_len, hidden_size=hidden, num_heads=_number(arch, "num_heads", int, cfg_path),
        expansion=_number(arch, "expansion", float, cfg_path),
        intermediate_size=int(_shape(sd, "L_level.layers.0.mlp.down_proj.weight", src, 2)[1]),
        num_layers=l_layers, mixer="mlp" if mlp_t else "attention", pos_encodings=pos,
        rms_norm_eps=_number(arch, "rms_norm_eps", float, cfg_path, 1e-5),
        rope_theta=_number(arch, "rope_theta", float, cfg_path, 10000.0),
        h_cycles=_number(arch, "H_cycles", int, cfg_path), l_cycles=_number(arch, "L_cycles", int, cfg_path),
        halt_max_steps=_number(arch, "halt_max_steps", int, cfg_path),
        halt_exploration_prob=_number(arch, "halt_exploration_prob", float, cfg_path),
        architectures=["ReasonerForGridClassification"])
    if architecture == "hrm":
        kw["h_layers"] = _number(arch, "H_layers", int, cfg_path)
    if mlp_t:
        kw["token_intermediate_size"] = int(_shape(sd, "L_level.layers.0.mlp_t.down_proj.weight", src, 2)[1])
        kw["token_mlp_norm"] = "positions"
    return kw


def convert_state_dict(sd: dict[str, torch.Tensor], prefix: torch.Tensor,
                       src: Path) -> dict[str, torch.Tensor]:
    """Original keys (prefixes stripped, puzzle embedding taken out) -> deqzoo keys; a key the mapping does
    not know is an error naming it."""
    out = {"reasoner.prefix": prefix}
    for key, value in sd.items():
        m = re.fullmatch(r"([HL])_level\.layers\.(\d+)\.(.+)", key)
        if key in _TOP:
            out[_TOP[key]] = value
        elif m and m.group(3) in _BLOCK:
            net = "l_net" if m.group(1) == "L" else "h_net"
            out[f"reasoner.{net}.layers.{m.group(2)}.{_BLOCK[m.group(3)]}"] = value
        else:
            raise ValueError(f"{src}: unexpected key 'inner.{key}' (shape {tuple(value.shape)}) that the "
                             "converter does not know")
    return out


def convert_release(src: str | Path, out: str | Path, *, architecture: str, arch_names: tuple[str, ...],
                    fmt: str, source: str, options: dict[str, Any]) -> Path:
    """The conversion both formats share; `architecture` is "hrm" or "trm"."""
    import deqzoo  # noqa: F401 - registers the family
    from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification
    from utils.cards import build_metadata, render_model_card

    check_output(src, out)
    options = dict(options)
    seq_len = options.pop("seq_len", None)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise ValueError(f"option seq_len={seq_len!r} must be an integer")
    puzzle_identifier = options.pop("puzzle_identifier", None)
    weights, cfg_path = locate(src)
    arch = read_arch(cfg_path, arch_names, fmt)
    sd = strip_prefixes(load_state_dict(weights), weights)
    hidden = _number(arch, "hidden_size", int, cfg_path)
    ndim = _number(arch, "puzzle_emb_ndim", int, cfg_path, 0)
    prefix_len = math.ceil(ndim / hidden) if hidden > 0 else 0
    mlp_t = False
    if architecture == "trm":
        explicit = _number(arch, "puzzle_emb_len", int, cfg_path, 16)
        prefix_len = explicit if explicit != 0 else prefix_len
        mlp_t = bool(arch.get("mlp_t", False))
    prefix = puzzle_prefix(sd, arch, prefix_len, hidden, weights, cfg_path, puzzle_identifier)
    fixed = reasoner_config(sd, arch, architecture=architecture, prefix_len=prefix_len, mlp_t=mlp_t,
                            src=weights, cfg_path=cfg_path, seq_len=seq_len)
    # what the weights do not fix (the original's gradient, its evaluation halting): options may change it
    free = {"grad_mode": "one_step" if architecture == "hrm" else "last_cycle", "halting": "budget"}
    try:  # validated (types, ranges, sizes) before any weight is allocated
        config = ReasonerConfig(**with_options(weights, fixed, {**free, **options}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{cfg_path}: settings do not make a deqzoo reasoner config: {err}") from err
    state = convert_state_dict(sd, prefix, weights)
    model = ReasonerForGridClassification(config)
    fill_model(model, state, weights)
    out = Path(out)
    model.save_pretrained(out)
    meta = build_metadata(model_id=f"converted/{out.name}", pipeline_tag="token-classification",
                          task_module="grid_reasoning", datasets=[], dataset_name="puzzles", metrics=[],
                          tags=["reasoner", architecture, "converted"])
    settings = ", ".join(f"{k}={arch[k]!r}" for k in ("H_cycles", "L_cycles", "H_layers", "L_layers",
                                                     "halt_max_steps", "halt_exploration_prob", "mlp_t",
                                                     "puzzle_emb_ndim", "puzzle_emb_len", "no_ACT_continue",
                                                     "pos_encodings") if k in arch)
    body = (f"# {architecture.upper()} converted from {source}\n\nWeights of `{weights.name}` converted with "
            f"`deqzoo convert {fmt}` (`conversion/reasoner_{architecture}.py`); the original's settings "
            f"({arch['name']}): {settings}. Parity with the original code is tested on small fixtures "
            "(`conversion/fixtures/reasoner_*`). Inference runs `halt_max_steps` segments (`halting: budget`,"
            " the original's evaluation); no evaluation was run on the converted weights.")
    (out / "README.md").write_text(render_model_card(meta, body), encoding="utf-8")
    return out


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert an HRM release (``all_config.yaml`` + state dict) into a deqzoo reasoner checkpoint folder;
    returns `out`.

    Options: seq_len (when the weights do not fix it), puzzle_identifier (for a multi-puzzle embedding
    table), and any other ReasonerConfig keyword that the checkpoint does not fix (halting, deq, ...).

    Example:
        >>> convert("HRM-checkpoint-sudoku-extreme", "hrm-sudoku", seq_len=81)  # doctest: +SKIP
    """
    return convert_release(src, out, architecture="hrm", arch_names=HRM_ARCH_NAMES, fmt="hrm-sapientinc",
                           source="sapientinc/HRM", options=options)


FORMATS = {"hrm-sapientinc": convert}
