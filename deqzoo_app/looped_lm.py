"""The looped-LM tab: a stock transformers ``HrmTextForCausalLM`` generating through
`deqzoo.integrations.looped_lm.LoopedLM`, with the f calls of every generated token shown as a colour.

The checkpoint is the directory named by ``$DEQZOO_LOOPED_LM``, else the first of `CARD_DIRS` holding a model:
the clone's ``model_cards/hrm-text-tiny-pydoc`` (once published), then the card folder that
``examples/looped_lm/write_card.py`` wrote beside the evaluation results; loaded with the stock class,
safetensors only. Without either, the tab says so and computes nothing. No Gradio here except in
`tab`, which `deqzoo_app.ui` calls.

Example:
    >>> from deqzoo_app.looped_lm import budget
    >>> budget(1.0, 8), budget(0.25, 8), budget(100, 8)     # f calls per token from the compute slider
    (8, 2, 32)
"""

from __future__ import annotations

import html
import json
import os
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from . import families as F

CARD = "hrm-text-tiny-pydoc"
ENV = "DEQZOO_LOOPED_LM"
MODES = ("per-token halting", "Anderson fixed point", "own loop")
COMPUTE = (0.25, 4.0)  # the compute slider: the f-call budget per token, in multiples of the model's own loop
PROMPT = "The for statement is used to"
_ROOT = Path(__file__).resolve().parents[1]
CARD_DIRS = (_ROOT / "model_cards" / CARD, _ROOT / "examples" / "looped_lm" / "results" / CARD)
_LOCK = threading.Lock()  # one request at a time: the tab's model is shared


def model_dir() -> Path | None:
    """The checkpoint the tab runs: ``$DEQZOO_LOOPED_LM`` if set, else the first of `CARD_DIRS` that holds a
    model; None without one."""
    env = os.environ.get(ENV)
    if env:
        return Path(env)
    return next((d for d in CARD_DIRS if (d / "model.safetensors").is_file()), None)


def budget(compute: Any, own_steps: int) -> int:
    """The f-call budget per token: `compute` (clamped to `COMPUTE`) times the model's own loop length."""
    low, high = COMPUTE
    compute = min(max(F._number(compute, "compute", low, high), low), high)
    return max(1, round(compute * own_steps))


@cache
def _load(path: str):
    from transformers import AutoTokenizer, HrmTextForCausalLM

    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"looped LM checkpoint {str(folder)!r}: no config.json")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type != "hrm_text":
        raise ValueError(f"looped LM checkpoint {config}: model_type is {model_type!r}; the tab runs "
                         "'hrm_text'")  # fmt: skip
    model = HrmTextForCausalLM.from_pretrained(folder, use_safetensors=True).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _looped(model, mode: str, max_iter: int, tol: float):
    from deqzoo.integrations.looped_lm import LoopedLM

    if mode == "own loop":  # the model's map for exactly max_iter calls per token (residuals relative)
        return LoopedLM.own_loop(model, max_iter=max_iter, stop_mode="rel")
    if mode == "Anderson fixed point":
        return LoopedLM.from_model(model, solver="anderson", max_iter=max_iter, tol=tol,
                                   solver_kwargs={"m": 5})  # fmt: skip
    # the model's own loop, each token stopping once its relative residual is below tol
    return LoopedLM.from_model(model, solver="fixed_point", max_iter=max_iter, tol=tol, answer="last")


def _colour(fraction: float) -> str:
    """A light-to-mid blue for 0..1 of the budget (dark text stays readable on it)."""
    f = min(max(fraction, 0.0), 1.0)
    r, g, b = (int(238 - 130 * f), int(244 - 100 * f), int(255 - 30 * f))
    return f"#{r:02x}{g:02x}{b:02x}"


def token_html(prompt: str, pieces: list[str], ids: list[int], nfes: list[int], converged: list[bool],
               cap: int) -> str:  # fmt: skip
    """The prompt, then each generated token on a background as dark as its f calls over the budget; a
    token that did not converge gets a red wavy underline. Hovering shows the numbers; each token's id is in
    ``data-id``.

    Example:
        >>> page = token_html("a", ["<b>"], [7], [2], [False], 4)
        >>> 'data-id="7" data-nfe="2" data-converged="false" title="2 f calls, not converged"' in page
        True
        >>> "&lt;b&gt;</span></div>" in page                     # the token's text is escaped
        True
    """
    spans = []
    for piece, token, nfe, ok in zip(pieces, ids, nfes, converged):
        outline = "" if ok else "text-decoration: underline wavy #d62728; "
        title = f"{nfe} f calls, " + ("converged" if ok else "not converged")
        style = f"background: {_colour(nfe / cap)}; color: #111; {outline}white-space: pre-wrap"
        spans.append(f'<span class="looped-token" data-id="{token}" data-nfe="{nfe}" '
                     f'data-converged="{str(ok).lower()}" title="{title}" style="{style}">'
                     f'{html.escape(piece)}</span>')  # fmt: skip
    return ('<div class="looped-text" style="font-family: ui-monospace, monospace; line-height: 1.8; '
            f'white-space: pre-wrap">{html.escape(prompt)}{"".join(spans)}</div>')  # fmt: skip


def generate_looped(prompt: str = PROMPT, max_new_tokens: int = 24, mode: str = MODES[0],
                    compute: float = 1.0, tol: float = 0.2, seed: int = 0) -> tuple[str, str]:  # fmt: skip
    """Sample a continuation (temperature 0.8, top-k 40, `seed`) token by token with the KV cache, each
    token's core solved by `mode` within ``compute x H_cycles`` f calls. Returns (HTML with each token
    coloured by its f calls, Markdown summary)."""
    folder = model_dir()
    if folder is None:
        where = " or ".join(str(d.relative_to(_ROOT) if d.is_relative_to(_ROOT) else d) for d in CARD_DIRS)
        raise ValueError(f"no looped LM in this clone: no model in {where} (train one with "
                         f"examples/looped_lm/train.py and point ${ENV} at its model folder)")  # fmt: skip
    F._check_choice(mode, MODES, "mode")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty")
    if len(prompt) > F.MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(prompt):,} characters; the app takes at most "
                         f"{F.MAX_PROMPT_TOKENS} tokens")  # fmt: skip
    max_new_tokens = F.clamp_int(max_new_tokens, "new_tokens", "new tokens")
    tol = F.clamp_float(tol, "tol", "tolerance")
    seed = F.clamp_int(seed, "seed", "seed")
    deadline = F.Deadline()
    model, tok = _load(str(folder))
    own = model.config.H_cycles
    cap = budget(compute, own)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise ValueError("the prompt is empty after tokenization")
    if ids.shape[1] > F.MAX_PROMPT_TOKENS:
        raise ValueError(f"the prompt is {ids.shape[1]:,} tokens for this model's tokenizer; the app takes "
                         f"at most {F.MAX_PROMPT_TOKENS}")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    pieces, chosen, nfes, conv = [], [], [], []
    stopped = ""
    with _LOCK, torch.no_grad():
        looped = _looped(model, mode, cap, tol)
        start = time.perf_counter()
        out = looped(ids, use_cache=True)
        prompt_calls = float(out.nfe.double().mean())
        for _ in range(max_new_tokens):
            if deadline.left() <= 0:
                stopped = f" Stopped after {len(nfes)} of {max_new_tokens} tokens: the app's time limit."
                break
            top = torch.topk(out.logits[0, -1].float() / 0.8, min(40, out.logits.shape[-1]))
            choice = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)]
            out = looped(choice.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            pieces.append(tok.decode(choice.tolist()))
            chosen.append(int(choice))
            nfes.append(int(out.nfe[0, -1]))
            # the own loop has no stopping tolerance: there "converged" is its last residual below tol
            ok = out.residual[0, -1] < tol if mode == "own loop" else out.converged[0, -1]
            conv.append(bool(ok))
        elapsed = time.perf_counter() - start
    mean = sum(nfes) / max(1, len(nfes))
    n_params = sum(p.numel() for p in model.parameters())
    unconverged = len(conv) - sum(conv)
    summary = (
        f"**{mode}**, budget {cap} f calls per token ({cap / own:g}x the model's own loop of {own})"
        + ("" if mode == "own loop" else f", tolerance {tol:g} (relative residual)") + ". "
        f"{len(nfes)} new tokens: mean **{mean:.2f} f calls per token** ({mean / own:.2f}x the own loop), "
        f"{unconverged} not converged (red wavy underline). Prompt: {ids.shape[1]} tokens, mean "
        f"{prompt_calls:.2f} f calls each. {elapsed:.2f} s in all.{stopped} Sampling: temperature 0.8, "
        f"top-k 40, seed {seed}. The model: `{folder.name}` ({n_params:,} parameters, H_cycles {own}, "
        f"L_cycles {model.config.L_cycles})."
    )
    return token_html(prompt, pieces, chosen, nfes, conv, cap), summary


def warm_up() -> None:
    """Load the checkpoint and generate two tokens (nothing without a checkpoint)."""
    if model_dir() is not None:
        generate_looped(max_new_tokens=2)


def tab() -> None:
    """The tab's layout (called by `deqzoo_app.ui.build` inside a ``gr.Tab``)."""
    import gradio as gr

    from .ui import _click, _slider

    gr.Markdown(
        "**Looped LM**: a stock transformers `HrmTextForCausalLM` (HRM-Text: one small block applied "
        "again and again per token) run through deqzoo's `LoopedLM`. Choose how each token's loop is "
        "solved and how many f calls it may take (the compute slider, in multiples of the model's own "
        "loop); each generated token is shaded by the f calls it took, darker = more, a red wavy "
        "underline = not converged."
    )
    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(PROMPT, label="prompt", lines=2)
            tokens = _slider("new_tokens", 24, 1, "new tokens")
            seed = gr.Number(0, label="seed", precision=0)
        with gr.Column():
            mode = gr.Dropdown(list(MODES), value=MODES[0], label="how each token's loop is solved")
            compute = gr.Slider(*COMPUTE, value=1.0, step=0.25, label="compute (f-call budget per token, "
                                "x the model's own loop)")  # fmt: skip
            low, high = F.LIMITS["tol"]
            # 0.2: where the card's per-token halting and Anderson meet the own loop's loss in fewer calls
            tol = gr.Number(value=0.2, label="tolerance (relative residual)", minimum=low, maximum=high)
            run = gr.Button("Generate with the looped LM", variant="primary")
    text = gr.HTML(label="generation (f calls per token as colour)", elem_id="looped-text")
    summary = gr.Markdown(elem_id="looped-summary")
    _click(run, generate_looped, [prompt, tokens, mode, compute, tol, seed], [text, summary],
           "generate_looped", "looped_lm")  # fmt: skip
