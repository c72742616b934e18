"""Language modelling on Python's ``pydoc_data.topics`` (shipped with CPython, so it is always offline).

Data split (deterministic, documented on the card): the help topics are sorted by name; a topic is held out
when the first byte of sha256(name) is below 26 (about 10% of topics), everything else is training text. Each
split is the concatenation of its topics in name order, each topic's text followed by a blank line.

Evaluation follows Transformer-XL/DEQ: the held-out token stream is cut into consecutive chunks of
``config.tgt_len`` tokens, processed in order with the memory of past equilibria carried from chunk to chunk;
perplexity = exp(mean next-token NLL over every predicted token), mean NFE = mean forward-solve f evaluations
per chunk (explicit models report their layer count).

Example:
    >>> from examples.deq_transformer import pydoc_lm
    >>> train, held_out = pydoc_lm.split_topics()
    >>> len(held_out) > 0 and not set(train) & set(held_out)
    True
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deqzoo.core import SolverStats
from deqzoo.predict import generate_text, load_tokenizer
from examples.demo import DemoSummary

DEMO_PROMPT = "The for statement is used to"
# The card's decoding, shipped in its generation_config.json (what `deqzoo predict` and generate() use):
# greedy decoding of a model this small loops ("the in the in ..."); top-20 sampling at temperature 0.7 with a
# repetition penalty reads like text. Seeded: reproducible.
DECODING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.2}
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


def demo(model) -> tuple[str, SolverStats]:
    """Continuation of a fixed prompt with the recommended decoding (`DECODING`, seed `DECODING_SEED`):
    (prompt + continuation on one line, the prompt's stats)."""
    tok = load_tokenizer(model)
    model.eval()
    with torch.no_grad():
        stats = model(tok(DEMO_PROMPT, return_tensors="pt")["input_ids"]).deq_stats
    text, _ = generate_text(model, DEMO_PROMPT)
    words = " ".join(text.split())
    metric = f'"...{words[:30]}..."' if len(words) > 30 else f'"...{words}"'  # no score: a sample of it
    return DemoSummary((DEMO_PROMPT + text).replace("\n", " "), metric), stats


