"""Convert TorchDEQ deq-zoo ``deq-lm`` (DEQ-Transformer, TorchDEQ paper appendix E) checkpoints to deqzoo.

Input: the state dict ``deq-lm/train.py`` saves (``torch.save(model.state_dict(), ...)``), loaded with
``torch.load(weights_only=True)``. Sizes and the number of blocks in f come from tensor shapes; segment and
memory
lengths and the solver come from options (defaults: deq-lm's ``run.sh``: 150/150 and 12 fixed-point
iterations).

Mapping: TorchDEQ lays out q/k/v per head ((H, 3, d_head) rows); deqzoo chunks q/k/v first ((3, H, d_head)),
so
the q/k/v projection and the injection are permuted rows. Weight-normalized layers (``*_g``/``*_v``, TorchDEQ
names) are folded into plain weights. TorchDEQ's solvers return f of the best iterate, so the converted config
sets ``final_f_step=True``.

    deqzoo convert deq-transformer-torchdeq ckpt.pth out_dir --option mem_len=150
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ._common import check_output, load_state_dict
from .deq_transformer_locuslab import _take, adaptive_layout, write_converted

# deq-lm's run.sh evaluation: fixed-point iteration, 12 steps
DEFAULT_DEQ = {"f_solver": "fixed_point", "f_max_iter": 12, "f_tol": 1e-3, "f_stop_mode": "rel"}


def fold_norms(sd: dict[str, torch.Tensor], target_norm: float = 1.0, clip: bool = False,
               clip_value: float = 1.0) -> dict[str, torch.Tensor]:
    """Fold TorchDEQ weight norm (``X_v`` with ``X_g`` or a fixed ``target_norm``) into plain ``X``."""
    out = dict(sd)
    if any(k.endswith("_orig") for k in sd):
        raise ValueError("spectral-norm checkpoints (keys ending in '_orig') are not supported by this "
                         "converter")
    for key in [k for k in sd if k.endswith("_v")]:
        base = key[:-2]
        v = out.pop(key)
        g = out.pop(base + "_g", None)
        norm = v.reshape(v.shape[0], -1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        factor = (g if g is not None else torch.full_like(norm, target_norm)) / norm
        if clip:
            factor = factor.clamp(max=clip_value)
        out[base] = v * factor
    return out


def _qkv_rows(w: torch.Tensor, n_head: int, d_head: int) -> torch.Tensor:
    """(H, 3, d_head) row layout -> (3, H, d_head)."""
    rest = w.shape[1:]
    return w.reshape(n_head, 3, d_head, *rest).transpose(0, 1).reshape(3 * n_head * d_head, *rest)


def infer_config(sd: dict[str, torch.Tensor], **options: Any) -> dict:
    """deqzoo config kwargs from the folded state dict's shapes plus options."""
    layout = adaptive_layout(sd, options.get("cutoffs"), "TorchDEQ deq-lm")
    blocks = sorted({int(m.group(1)) for k in sd if (m := re.match(r"func\.dec_attn\.(\d+)\.", k))})
    if not blocks:
        raise KeyError("no func.dec_attn.* keys: not a TorchDEQ deq-lm checkpoint")
    n_head, d_head = sd["func.dec_attn.0.r_w_bias"].shape
    return dict(**layout, d_model=sd["injection.weight"].shape[1], n_head=n_head, d_head=d_head,
                d_inner=sd["func.pos_ff.0.ff1_net.weight"].shape[0], variant="torchdeq", n_block=len(blocks),
                tgt_len=int(options.get("tgt_len", 150)), mem_len=int(options.get("mem_len", 150)),
                local_size=int(options.get("local_size", 0)), final_f_step=True,
                architectures=["DEQTransformerForCausalLM"], deq=options.get("deq") or dict(DEFAULT_DEQ))


def convert_state_dict(sd: dict[str, torch.Tensor], config: dict,
                       src: str = "state dict") -> dict[str, torch.Tensor]:
    """deq-lm keys (weight norm already folded) -> deqzoo keys."""
    sd = {k: v.float() for k, v in sd.items()}
    sd.pop("pos_emb.inv_freq", None)
    h, dh = config["n_head"], config["d_head"]
    out: dict[str, torch.Tensor] = {}
    for i in range(len(config["cutoffs"]) + 1 if config["div_val"] > 1 else 1):
        out[f"model.word_emb.emb_layers.{i}.weight"] = _take(sd, f"word_emb.emb_layers.{i}.weight", src)
        if f"word_emb.emb_projs.{i}.weight" in sd:
            out[f"model.word_emb.emb_projs.{i}.weight"] = _take(sd, f"word_emb.emb_projs.{i}.weight", src)
    out["model.injection.weight"] = _qkv_rows(_take(sd, "injection.weight", src), h, dh)
    out["model.injection.bias"] = _qkv_rows(_take(sd, "injection.bias", src), h, dh)
    for b in range(config["n_block"]):
        a, f, pa, pf = (f"func.dec_attn.{b}.", f"func.pos_ff.{b}.", f"model.func.blocks.{b}.dec_attn.",
                        f"model.func.blocks.{b}.pos_ff.")
        out[pa + "qkv_net.weight"] = _qkv_rows(_take(sd, a + "qkv_net.weight", src), h, dh)
        for name in ("r_net.weight", "o_net.weight", "o_net.bias", "r_w_bias", "r_r_bias", "ln1.weight",
                     "ln1.bias", "ln2.weight", "ln2.bias"):
            out[pa + name] = _take(sd, a + name, src)
        for name in ("ff1_net.weight", "ff1_net.bias", "ff2_net.weight", "ff2_net.bias", "ln.weight",
                     "ln.bias"):
            out[pf + name] = _take(sd, f + name, src)
    if config["cutoffs"]:
        out["crit.cluster_weight"] = _take(sd, "crit.cluster_weight", src)
        out["crit.cluster_bias"] = _take(sd, "crit.cluster_bias", src)
    for i in range(len(config["cutoffs"]) + 1 if config["div_val"] > 1 else 1):
        out[f"crit.out_biases.{i}"] = _take(sd, f"crit.out_layers.{i}.bias", src)
        w = _take(sd, f"crit.out_layers.{i}.weight", src)
        if not config["tie_weights"]:
            out[f"crit.out_weights.{i}"] = w
    for i in range(len(config["cutoffs"]) + 1):
        w = sd.pop(f"crit.out_projs.{i}.weight", None)
        if w is not None and not config["tie_projs"][i]:
            out[f"crit.out_projs.{i}"] = w
    if sd:
        raise ValueError(f"{src}: unexpected key(s) not understood by the converter: {sorted(sd)}")
    return out


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert a TorchDEQ deq-lm state dict into a deqzoo checkpoint directory; returns `out`.

    Options: tgt_len, mem_len (150), local_size (0), cutoffs (only when div_val == 1 with an adaptive
    softmax),
    deq (a DEQConfig dict; default deq-lm's 12 fixed-point steps), norm_target_norm, norm_clip,
    norm_clip_value
    (TorchDEQ weight-norm settings, needed only for checkpoints trained without a learned scale or with
    clipping).

    Example:
        >>> convert("deq_lm.pth", "deq-lm-wt103")  # doctest: +SKIP
    """
    check_output(src, out)
    raw = load_state_dict(src)
    sd = fold_norms(raw, target_norm=float(options.get("norm_target_norm", 1.0)),
                    clip=bool(options.get("norm_clip", False)),
                    clip_value=float(options.get("norm_clip_value", 1.0)))
    kwargs = infer_config(sd, **options)
    return write_converted(convert_state_dict(sd, kwargs, str(src)), kwargs, out, source="TorchDEQ deq-lm",
                           src=src, tags=("torchdeq",))


FORMATS = {"deq-transformer-torchdeq": convert}
