"""Convert locuslab/deq DEQ-Sequence (DEQ-Transformer, Bai et al. 2019) checkpoints to deqzoo.

Input: the state dict the original ``train_transformer.py`` saves (``model.save_weights`` ->
``pretrained_deq.pth``
or ``torch.save(model.state_dict(), ...)``), loaded with ``torch.load(weights_only=True)``; a whole pickled
model
(``model.pt``) is refused. Architecture sizes are read from tensor shapes; what shapes cannot tell (LayerNorm
placement, adaptive-softmax cutoffs when ``div_val == 1``, segment and memory lengths) comes from options with
the WikiText-103 script's values as defaults.

Mapping: Conv1d(k=1) weights become Linear weights; weight-normalized layers (``*_g``, ``*_v``) are folded
into
plain weights (w = g * v / ||v|| per output, exactly the original's formula); output layers and projections
tied
to the embedding are checked equal and dropped (the deqzoo head reads the embedding).

    deqzoo convert deq-transformer-locuslab pretrained_deq.pth out_dir --option pre_lnorm=false --option
    mem_len=150
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ._common import check_output, load_state_dict

_ATTN = "model.func.blocks.0.dec_attn."
_FF = "model.func.blocks.0.pos_ff."


def fold_weight_norm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every ``X_g``/``X_v`` pair by ``X = v * g / ||v||`` (norm over all dims but the first)."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith("_g")]:
        base = key[:-2]
        if base + "_v" not in sd:
            continue
        g, v = out.pop(key), out.pop(base + "_v")
        norm = v.reshape(v.shape[0], -1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        out[base] = v * (g / norm)
    return out


def _take(sd: dict[str, torch.Tensor], key: str, src: str) -> torch.Tensor:
    if key not in sd:
        raise KeyError(f"{src}: missing key {key!r} (keys present: {sorted(sd)[:12]}...)")
    return sd.pop(key)


def _linear(w: torch.Tensor) -> torch.Tensor:
    return w[..., 0] if w.dim() == 3 else w  # Conv1d(kernel_size=1) -> Linear


def adaptive_layout(sd: dict[str, torch.Tensor], cutoffs: list[int] | None, kind: str) -> dict:
    """The adaptive embedding / softmax layout both DEQ-Transformer releases share (Transformer-XL's):
    vocabulary, embedding width, cluster cutoffs, div_val and which output layers / projections are tied."""
    emb = sorted((int(m.group(1)), v) for k, v in sd.items()
                 if (m := re.fullmatch(r"word_emb\.emb_layers\.(\d+)\.weight", k)))
    if not emb:
        raise KeyError(f"no word_emb.emb_layers.*.weight in the state dict: not a {kind} checkpoint")
    d_embed = emb[0][1].shape[1]
    if len(emb) > 1:  # the cluster sizes are the embedding tables' sizes
        div_val = d_embed // emb[1][1].shape[1]
        sizes = [v.shape[0] for _, v in emb]
        cutoffs = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    else:  # one table: the cutoffs are not in the weights, only their number
        div_val = 1
        n_clusters = sd["crit.cluster_weight"].shape[0] if "crit.cluster_weight" in sd else 0
        cutoffs = list(cutoffs or [])
        if len(cutoffs) != n_clusters:
            raise ValueError(f"the checkpoint has {n_clusters} adaptive-softmax tail clusters; pass "
                             f"cutoffs= with {n_clusters} values (got {cutoffs})")

    def tied_proj(i: int) -> bool:
        a, b = f"crit.out_projs.{i}.weight", f"word_emb.emb_projs.{i if div_val > 1 else 0}.weight"
        return a in sd and b in sd and torch.equal(sd[a], sd[b])

    tie_weights = all(f"crit.out_layers.{i}.weight" not in sd
                      or torch.equal(sd[f"crit.out_layers.{i}.weight"], v) for i, v in emb)
    return dict(vocab_size=sum(v.shape[0] for _, v in emb), d_embed=d_embed, cutoffs=cutoffs, div_val=div_val,
                tie_weights=tie_weights, tie_projs=[tied_proj(i) for i in range(len(cutoffs) + 1)])


def infer_config(sd: dict[str, torch.Tensor], *, cutoffs: list[int] | None = None, **options: Any) -> dict:
    """deqzoo config kwargs from the original tensors' shapes plus options."""
    layout = adaptive_layout(sd, cutoffs, "DEQ-Transformer")
    n_head, d_head = sd["func.dec_attn.r_w_bias"].shape
    ff1 = sd.get("func.pos_ff.ff1_net.weight", sd.get("func.pos_ff.ff1_net.weight_v"))
    return dict(**layout, d_model=sd["inject_conv.weight"].shape[1], n_head=n_head, d_head=d_head,
                d_inner=ff1.shape[0], variant="bai2019", pre_lnorm=bool(options.get("pre_lnorm", False)),
                tgt_len=int(options.get("tgt_len", 150)), mem_len=int(options.get("mem_len", 150)),
                local_size=int(options.get("local_size", 0)), architectures=["DEQTransformerForCausalLM"],
                deq=options.get("deq") or {"f_solver": "anderson", "f_max_iter": 30, "f_tol": 1e-3})


def convert_state_dict(sd: dict[str, torch.Tensor], config: dict,
                       src: str = "state dict") -> dict[str, torch.Tensor]:
    """Original keys -> deqzoo keys (after weight-norm folding)."""
    sd = fold_weight_norm({k: v.float() for k, v in sd.items()})
    sd.pop("pos_emb.inv_freq", None)
    out: dict[str, torch.Tensor] = {}
    n_emb = len(config["cutoffs"]) + 1 if config["div_val"] > 1 else 1
    for i in range(n_emb):
        out[f"model.word_emb.emb_layers.{i}.weight"] = _take(sd, f"word_emb.emb_layers.{i}.weight", src)
        if f"word_emb.emb_projs.{i}.weight" in sd:
            out[f"model.word_emb.emb_projs.{i}.weight"] = _take(sd, f"word_emb.emb_projs.{i}.weight", src)
    out["model.injection.weight"] = _linear(_take(sd, "inject_conv.weight", src))
    out["model.injection.bias"] = _take(sd, "inject_conv.bias", src)
    for name in ("qkv_net", "r_net", "o_net"):
        out[_ATTN + name + ".weight"] = _linear(_take(sd, f"func.dec_attn.{name}.weight", src))
    out[_ATTN + "o_net.bias"] = _take(sd, "func.dec_attn.o_net.bias", src)
    for name in ("r_w_bias", "r_r_bias"):
        out[_ATTN + name] = _take(sd, f"func.dec_attn.{name}", src)
    for name in ("ff1_net", "ff2_net"):
        out[_FF + name + ".weight"] = _take(sd, f"func.pos_ff.{name}.weight", src)
        out[_FF + name + ".bias"] = _take(sd, f"func.pos_ff.{name}.bias", src)
    if config["cutoffs"]:
        out["crit.cluster_weight"] = _take(sd, "crit.cluster_weight", src)
        out["crit.cluster_bias"] = _take(sd, "crit.cluster_bias", src)
    n_out = len(config["cutoffs"]) + 1 if config["div_val"] > 1 else 1
    for i in range(n_out):
        out[f"crit.out_biases.{i}"] = _take(sd, f"crit.out_layers.{i}.bias", src)
        w = _take(sd, f"crit.out_layers.{i}.weight", src)
        if not config["tie_weights"]:
            out[f"crit.out_weights.{i}"] = w
    for i in range(len(config["cutoffs"]) + 1):
        key = f"crit.out_projs.{i}.weight"
        if key in sd:
            w = sd.pop(key)
            if not config["tie_projs"][i]:
                out[f"crit.out_projs.{i}"] = w
    if sd:
        raise ValueError(f"{src}: unexpected key(s) not understood by the converter: {sorted(sd)}")
    return out


def write_converted(model_sd: dict[str, torch.Tensor], config_kwargs: dict, out: str | Path, *, source: str,
                    src: str | Path, tags: tuple[str, ...] = ()) -> Path:
    """Build the model from `config_kwargs`, load the converted weights strictly (an error lists missing,
    unexpected and mis-shaped keys, naming `src`), save it and write its card."""
    import deqzoo  # noqa: F401 - registers the family
    from deqzoo.hub.loading import check_state_dict
    from deqzoo.models.deq_transformer import DEQTransformerConfig, DEQTransformerForCausalLM
    from utils.cards import build_metadata, render_model_card

    model = DEQTransformerForCausalLM(DEQTransformerConfig(**config_kwargs))
    check_state_dict(model, model_sd, f"{src} (converted)")
    model.load_state_dict(model_sd, strict=True)
    out = Path(out)
    model.save_pretrained(out)
    meta = build_metadata(model_id=f"converted/{out.name}", pipeline_tag="text-generation",
                          task_module="pydoc_lm", datasets=["wikitext-103"], dataset_name="WikiText-103",
                          metrics=[], tags=["deq-transformer", *tags, "converted"])
    body = (f"# DEQ-Transformer converted from {source}\n\nWeights converted from a {source} checkpoint "
            "(`conversion/deq_transformer_*.py`), trained by the original authors and converted with "
            "`deqzoo convert`. Parity with the original code is tested on a small fixture. Evaluate with the "
            "original WikiText-103 pipeline (no tokenizer is shipped).")
    (out / "README.md").write_text(render_model_card(meta, body), encoding="utf-8")
    return out


def convert(src: str | Path, out: str | Path, **options: Any) -> Path:
    """Convert a locuslab/deq DEQ-Sequence state dict into a deqzoo checkpoint directory; returns `out`.

    Options: pre_lnorm (bool, default False), cutoffs (list, only when div_val == 1 with an adaptive softmax),
    tgt_len, mem_len (default 150), local_size (0), deq (a DEQConfig dict).

    Example:
        >>> convert("pretrained_deq.pth", "deq-wt103", pre_lnorm=False)  # doctest: +SKIP
    """
    check_output(src, out)
    sd = load_state_dict(src)
    folded = fold_weight_norm(sd)
    kwargs = infer_config(folded, **options)
    return write_converted(convert_state_dict(sd, kwargs, str(src)), kwargs, out,
                           source="locuslab/deq DEQ-Sequence", src=src)


FORMATS = {"deq-transformer-locuslab": convert}
