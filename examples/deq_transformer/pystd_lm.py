"""Language modelling on Python's own text: the pydoc help topics plus the standard library's source.

Corpus (deterministic; everything ships with CPython, so it is always offline): every help topic of
``pydoc_data.topics`` (named by its topic name) and every ``.py`` file under
``sysconfig.get_paths()["stdlib"]`` (named by its path relative to that folder, "/"-separated), except
files under a folder named ``test`` or ``tests``, ``idlelib/``, ``site-packages/``, ``pydoc_data/`` (the
topics again) and ``encodings/`` (generated codec tables), and files that are not UTF-8. The split is
`pydoc_lm.is_held_out` applied to the name (first
byte of sha256(name) below 26, about 10%): whole topics and whole files are held out. The stdlib differs
between Python versions, so `corpus_fingerprint` (the sha256 of the held-out text) names the data a number
was measured on.

Each split is its documents in sha256(name) order (a fixed shuffle, so a partial epoch sees every part of the
library), each document's text stripped and followed by a newline and the end-of-text token.

Evaluation (`evaluate`): perplexity over a window of `EVAL_WINDOW` tokens from the middle of each held-out
document (each window scored from empty memory, chunk by chunk with memory as `pydoc_lm.stream_nll`), mean
NFE per chunk, and the compile share of `compile_prompts` completions (`compile_share`).

Example:
    >>> from examples.deq_transformer import pystd_lm
    >>> train, held_out = pystd_lm.split_names()
    >>> len(held_out) > 0 and not set(train) & set(held_out)
    True
"""

from __future__ import annotations

import ast
import hashlib
import math
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from tqdm.auto import tqdm

from deqzoo.core import SolverStats
from deqzoo.predict import generate_text
from examples.demo import DemoSummary
from examples.deq_transformer import pydoc_lm

EOS = "<|endoftext|>"
EVAL_WINDOW = 128  # tokens per held-out document scored for perplexity
PROMPT_LINES = 4  # a prompt is the first lines of a held-out top-level function (def line first)
MIN_FUNCTION_LINES = 8  # functions shorter than this give no prompt
PROMPTS_PER_FILE = 2
NUM_PROMPTS = 32
NEW_TOKENS = 48
# The card's decoding, shipped in its generation_config.json (what `deqzoo predict` uses): sampling without a
# repetition penalty (code repeats tokens)
DECODING = {"do_sample": True, "temperature": 0.7, "top_k": 20}
DECODING_SEED = 0
# Prompts end without their last newline: byte-level BPE merges a newline with the next line's indentation
# ("\n    " is one token), so a prompt ending in a bare "\n" token would tell the model "column 0 follows".
DEMO_PROMPT = 'def is_even(n):\n    """Return True if n is even."""'
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "pydoc_data", "encodings", "__pycache__"}


def _stdlib_files() -> dict[str, Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if not _SKIP_DIRS.isdisjoint(rel.split("/")[:-1]):
            continue
        files[rel] = path
    return dict(sorted(files.items()))


@lru_cache(maxsize=1)
def documents() -> dict[str, str]:
    """name -> text of every document of the corpus (topics first, then files, each sorted by name)."""
    docs = {name: text.strip() for name, text in sorted(pydoc_lm._topics().items())}
    for rel, path in _stdlib_files().items():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            docs[rel] = text.strip()
    return docs


def _order(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def split_names() -> tuple[list[str], list[str]]:
    """(train document names, held-out document names), each in sha256(name) order."""
    names = sorted(documents(), key=_order)
    return ([n for n in names if not pydoc_lm.is_held_out(n)], [n for n in names if pydoc_lm.is_held_out(n)])


def split_text(split: str) -> str:
    """The concatenated text of one split ("train" or "held_out")."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    names = split_names()[split == "held_out"]
    docs = documents()
    return "".join(docs[n] + "\n" + EOS for n in names)


def corpus_fingerprint() -> str:
    """First 12 hex digits of sha256 of the held-out text (differs between Python versions)."""
    return hashlib.sha256(split_text("held_out").encode("utf-8")).hexdigest()[:12]


def token_stream(tokenizer, split: str) -> torch.Tensor:
    """All token ids of one split as a 1-D LongTensor."""
    docs = documents()
    ids = tokenizer([docs[n] + "\n" + EOS for n in split_names()[split == "held_out"]])["input_ids"]
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def eval_windows(tokenizer, limit: int | None = None) -> list[torch.Tensor]:
    """The perplexity windows: `EVAL_WINDOW` tokens from the middle of each held-out document (all of a
    shorter one), in held-out order; `limit` keeps the first windows."""
    docs = documents()
    names = split_names()[1][:limit]
    out = []
    for ids in tokenizer([docs[n] + "\n" + EOS for n in names])["input_ids"]:
        start = max(0, (len(ids) - EVAL_WINDOW) // 2)
        out.append(torch.tensor(ids[start:start + EVAL_WINDOW], dtype=torch.long))
    return out


def compile_prompts(limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt, real continuation) pairs: held-out stdlib files in held-out order, their top-level functions
    of at least `MIN_FUNCTION_LINES` lines in source order, at most `PROMPTS_PER_FILE` per file, first
    `NUM_PROMPTS` (or `limit`); prompt = the function's first `PROMPT_LINES` lines (from the def line,
    decorators excluded) without its last newline, continuation = the rest of the file from that newline."""
    docs = documents()
    pairs = []
    for name in split_names()[1]:
        if not name.endswith(".py"):
            continue
        text = docs[name] + "\n"
        lines = text.splitlines(keepends=True)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.end_lineno - n.lineno + 1 >= MIN_FUNCTION_LINES]
        for node in funcs[:PROMPTS_PER_FILE]:
            cut = node.lineno - 1 + PROMPT_LINES
            prompt = "".join(lines[node.lineno - 1:cut])
            pairs.append((prompt[:-1], "\n" + "".join(lines[cut:])))
    return pairs[:NUM_PROMPTS if limit is None else min(limit, NUM_PROMPTS)]


def truncate_completion(completion: str) -> str:
    """The protocol's cut: drop the last (unfinished) line, then everything from the first non-blank line
    that starts at column 0 (the function ended: a new top-level statement). '' when no complete line
    remains."""
    lines = completion.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]
    kept = []
    for line in lines:
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return "".join(kept)


def compiles(prompt: str, completion: str) -> bool:
    """True when the completion ends the prompt's last line and some prefix of the lines after it, cut by
    `truncate_completion`, longest first, holds a line of code (not blank, not only a comment) and
    `compile(head + prefix, "<sample>", "exec")` accepts it (head: the prompt's lines, its last one as the
    completion ends it): the completion cut at its last syntactic boundary is valid Python."""
    n = prompt.count("\n") + 1
    all_lines = (prompt + completion).splitlines(keepends=True)
    head = "".join(all_lines[:n])
    if not head.endswith("\n"):
        return False
    lines = truncate_completion("".join(all_lines[n:])).splitlines(keepends=True)
    for k in range(len(lines), 0, -1):
        if not any(line.strip() and not line.lstrip().startswith("#") for line in lines[:k]):
            return False
        try:
            compile(head + "".join(lines[:k]), "<sample>", "exec")
        except (SyntaxError, ValueError):  # ValueError: NUL bytes in a sampled string
            continue
        return True
    return False


def complete(model, prompt: str, *, decoding: dict | None = None, new_tokens: int = NEW_TOKENS,
             seed: int = DECODING_SEED) -> str:
    """Exactly `new_tokens` tokens after `prompt` (end-of-text suppressed until then) with the card's
    decoding, sampled as `pydoc_lm`'s seeded generation does."""
    decoding = {**(DECODING if decoding is None else decoding), "min_new_tokens": new_tokens}
    return generate_text(model, prompt, max_new_tokens=new_tokens, decoding=decoding, seed=seed)[0]


def real_completion(tokenizer, continuation: str, new_tokens: int = NEW_TOKENS) -> str:
    """The ceiling's completion: the real continuation cut to the same number of tokens."""
    return tokenizer.decode(tokenizer(continuation)["input_ids"][:new_tokens])


def compile_share(completions: list[str], prompts: list[tuple[str, str]]) -> float:
    """Share of (prompt, completion) that `compiles`."""
    ok = sum(compiles(p, c) for (p, _), c in zip(prompts, completions, strict=True))
    return round(ok / len(prompts), 4)


def evaluate(model, *, limit: int | None = None, progress: bool = True) -> dict:
    """Held-out perplexity (EVAL_WINDOW-token windows), mean NFE per chunk, compile share of sampled function
    completions; `limit` = number of windows and of prompts."""
    tok = pydoc_lm.load_tokenizer(model)
    nll, count, nfes = 0.0, 0, []
    for window in tqdm(eval_windows(tok, limit), desc="pystd held-out", disable=not progress):
        s, n, f = pydoc_lm.stream_nll(model, window, progress=False)
        nll, count, nfes = nll + s, count + n, nfes + f
    prompts = compile_prompts(limit)
    samples = [complete(model, p) for p, _ in tqdm(prompts, desc="compile share", disable=not progress)]
    return {"perplexity": round(math.exp(nll / count), 4), "mean_nfe": round(sum(nfes) / len(nfes), 4),
            "compile_share": compile_share(samples, prompts)}


def demo(model) -> tuple[str, SolverStats]:
    """The card's decoding after a fixed function header: (prompt + completion on one line, the prompt's
    stats; `SolverStats.no_solve()` for the explicit twin, which solves nothing)."""
    tok = pydoc_lm.load_tokenizer(model)
    model.eval()
    with torch.no_grad():
        stats = model(tok(DEMO_PROMPT, return_tensors="pt")["input_ids"]).deq_stats
    if model.config.explicit_layers > 0:
        stats = SolverStats.no_solve()
    text = truncate_completion(complete(model, DEMO_PROMPT))
    text = text if text.strip() else " (no complete line)"
    words = " ".join(text.split())
    metric = f'"...{words[:30]}..."' if len(words) > 30 else f'"...{words}"'
    return DemoSummary(" ".join((DEMO_PROMPT + text).split()), metric), stats


