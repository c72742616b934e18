"""Language modelling on Python's ``pydoc_data.topics`` (shipped with CPython, so it is always offline).

Data split (deterministic, documented on the card): the help topics are sorted by name; a topic is held out
when the first byte of sha256(name) is below 26 (about 10% of topics), everything else is training text. Each
split is the concatenation of its topics in name order, each topic's text followed by a blank line.

Evaluation follows Transformer-XL/DEQ: the held-out token stream is cut into consecutive chunks of
``config.tgt_len`` tokens, processed in order with the memory of past equilibria carried from chunk to chunk;
perplexity = exp(mean next-token NLL over every predicted token), mean NFE = mean forward-solve f evaluations
per chunk (explicit models report their layer count).

Example:
    >>> from deqzoo.tasks import pydoc_lm
    >>> train, held_out = pydoc_lm.split_topics()
    >>> len(held_out) > 0 and not set(train) & set(held_out)
    True
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core import SolverStats
from ._demo import DemoSummary

DEMO_PROMPT = "The for statement is used to"
# The card's recommended decoding: greedy decoding of a model this small loops ("the in the in ..."); sampling
# from the top 20 tokens at temperature 0.7 with a repetition penalty reads like text. Seeded: reproducible.
DECODING: dict = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.2}
DECODING_SEED = 0
_HELD_OUT_BELOW = 26  # first sha256 byte threshold: 26/256 ~ 10% of topics


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def is_held_out(topic: str) -> bool:
    """True when `topic` belongs to the held-out split."""
    return hashlib.sha256(topic.encode("utf-8")).digest()[0] < _HELD_OUT_BELOW


def split_topics() -> tuple[list[str], list[str]]:
    """(train topic names, held-out topic names), each sorted."""
    names = sorted(_topics())
    return [n for n in names if not is_held_out(n)], [n for n in names if is_held_out(n)]


def split_text(split: str) -> str:
    """The concatenated text of one split ("train" or "held_out")."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    train, held = split_topics()
    topics = _topics()
    return "".join(topics[n].strip() + "\n\n" for n in (train if split == "train" else held))


def token_stream(tokenizer, split: str) -> torch.Tensor:
    """All token ids of one split as a 1-D LongTensor."""
    return torch.tensor(tokenizer(split_text(split))["input_ids"], dtype=torch.long)


def load_tokenizer(model):
    """The tokenizer saved with the checkpoint the model was loaded from."""
    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if path and not (Path(path) / "tokenizer.json").is_file():
        from ..hub import resolve  # a hub id (e.g. the embedded checkpoint): its local directory

        try:
            path = str(resolve(path))
        except Exception:  # noqa: BLE001 - reported below with the name that failed
            pass
    if not path or not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json next to the model (name_or_path={path!r}); load the "
                                "model from a checkpoint directory that contains its tokenizer")
    from ..integrations.transformers import register_family  # AutoTokenizer may read config.json's type
    from ..models.registry import family_for

    register_family(family_for(model.config.model_type))
    return AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, *, limit: int | None = None, progress: bool = True
               ) -> tuple[float, int, list[int]]:
    """Next-token NLL over a token stream, chunk by chunk with memory: (nll_sum, n_tokens, nfe_per_chunk)."""
    model.eval()
    seg = model.config.tgt_len
    n_chunks = math.ceil((ids.numel() - 1) / seg)
    if limit is not None:
        n_chunks = min(n_chunks, limit)
    cache, nll, count, nfes = None, 0.0, 0, []
    for i in tqdm(range(n_chunks), desc="pydoc held-out", disable=not progress):
        x = ids[i * seg: (i + 1) * seg]
        y = ids[i * seg + 1: (i + 1) * seg + 1]
        x = x[: y.numel()]
        out = model(x[None], past_key_values=cache)  # chunks start from zeros (reuse is for one-token steps)
        cache = out.past_key_values
        nll += float(F.cross_entropy(out.logits[0].float(), y, reduction="sum"))
        count += y.numel()
        nfes.append(int(out.deq_stats.nfe))
    return nll, count, nfes


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """Held-out perplexity and mean NFE (limit = number of held-out chunks; None = all).

    Example:
        >>> import deqzoo  # doctest: +SKIP
        >>> model = deqzoo.from_pretrained("deqzoo/deq-transformer-tiny-pydoc")  # doctest: +SKIP
        >>> evaluate(model, limit=4, progress=False)  # doctest: +SKIP
        {'perplexity': ..., 'mean_nfe': ...}
    """
    tok = load_tokenizer(model)
    nll, count, nfes = stream_nll(model, token_stream(tok, "held_out"), limit=limit, progress=progress)
    return {"perplexity": round(math.exp(nll / count), 4), "mean_nfe": round(sum(nfes) / len(nfes), 4)}


# Documented limit of `deqzoo predict` for the language model (a few pages of text).
MAX_PROMPT_CHARS = 20_000


def _generate(model, text: str, max_new_tokens: int = 24, decoding: dict | None = None,
              seed: int = DECODING_SEED, scores: bool = False):
    """`generate()` with the recommended decoding (or `decoding`), sampling from a private seeded generator
    state so the text is reproducible and the caller's RNG is left as it was."""
    tok = load_tokenizer(model)
    ids = tok(text, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise ValueError("the prompt is empty after tokenization")
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = model.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                             pad_token_id=pad, output_logits=scores,
                             **(DECODING if decoding is None else decoding))
    new = out.sequences[0, ids.shape[1]:]
    text_out = tok.decode(new, skip_special_tokens=True)
    if not scores:
        return text_out, out.past_key_values
    # the model's own distribution (before temperature / top-k / repetition penalty) at each sampled token
    probs = torch.stack([F.softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, new.tolist())])
    return text_out, out.past_key_values, probs


def demo(model) -> tuple[str, SolverStats]:
    """Continuation of a fixed prompt with the recommended decoding (`DECODING`, seed `DECODING_SEED`):
    (prompt + continuation on one line, the prompt's stats)."""
    tok = load_tokenizer(model)
    model.eval()
    with torch.no_grad():
        stats = model(tok(DEMO_PROMPT, return_tensors="pt")["input_ids"]).deq_stats
    text, _ = _generate(model, DEMO_PROMPT)
    words = " ".join(text.split())
    metric = f'"...{words[:30]}..."' if len(words) > 30 else f'"...{words}"'  # no score: a sample of it
    return DemoSummary((DEMO_PROMPT + text).replace("\n", " "), metric), stats


def predict(model, input: str, decoding: dict | None = None) -> str:
    """Continuation (24 tokens, recommended decoding, seeded) of `input` (a text or a text file's path), then
    the model's own probability of each sampled token (geometric mean and minimum), on the next line.

    Prompts are limited to MAX_PROMPT_CHARS characters, checked before anything is read or tokenized."""
    path = Path(input)
    if len(input) < 4096 and path.is_file():
        size = path.stat().st_size
        if size > 4 * MAX_PROMPT_CHARS:  # at most 4 bytes per character in UTF-8
            raise ValueError(f"{path}: {size:,} bytes; predict takes a prompt of at most "
                             f"{MAX_PROMPT_CHARS:,} characters (MAX_PROMPT_CHARS)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    else:
        text = input
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(text):,} characters; predict takes at most "
                         f"{MAX_PROMPT_CHARS:,} (MAX_PROMPT_CHARS)")
    if not text.strip():
        raise ValueError("the prompt is empty")
    continuation, _, probs = _generate(model, text, decoding=decoding, scores=True)
    if probs.numel() == 0:
        return continuation
    return (f"{continuation}\n[{probs.numel()} tokens; model probability per token: geometric mean "
            f"{float(probs.log().mean().exp()):.4f}, min {float(probs.min()):.4f}]")
