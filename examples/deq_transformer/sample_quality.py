"""Sample quality of a language-model checkpoint: what its shipped decoding (`generation_config.json`) writes,
beside greedy decoding, on fixed prompts with a fixed seed.

    python examples/deq_transformer/sample_quality.py deqzoo/deq-transformer-tiny-pydoc
    python examples/deq_transformer/sample_quality.py deqzoo/deq-transformer-small-pystd --json out.json
    python examples/deq_transformer/sample_quality.py deqzoo/deq-transformer-small-pystd \
        --decoding '{"do_sample": true, "temperature": 0.7, "top_k": 20}'   # try another decoding

Measures, over the new tokens of every prompt (48 each, `torch.manual_seed(seed)` before each prompt):
- distinct-1 / distinct-2: distinct words / word bigrams over all words / bigrams (1.0: no word repeats;
  greedy decoding of a small model that loops scores far lower);
- repeated 4-grams: share of word 4-grams that already occurred earlier in the same sample (a loop);
- for the Python-source checkpoints, the share of complete generated lines that parse on their own
  (`ast.parse` of the stripped line; a line ending in ':' is completed with ' pass'; blank and comment-only
  lines and the last, unfinished line are not counted).
These say whether a reader can follow the text, not whether it is right: a line that parses can be nonsense.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import torch

PROSE_PROMPTS = [
    "The for statement is used to",
    "A class definition defines",
    "The return statement",
    "When an exception is raised,",
    "The import statement",
    "A function definition is",
    "The with statement is used to",
    "Lists are mutable sequences",
]
PYTHON_PROMPTS = [
    'def is_even(n):\n    """Return True if n is even."""',
    "class Stack:\n    def push(self, item):",
    "import os\n\n\ndef read_file(path):",
    "def main():\n    args = parse_args()",
    "    def __init__(self, name):",
    "try:\n    import json\nexcept ImportError:",
    "def _check(value):\n    if not isinstance(value, int):",
    "with open(path) as f:",
]
NEW_TOKENS = 48


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct(samples: list[str], n: int) -> float:
    """Distinct word n-grams over all word n-grams, pooled over samples.

    Example:
        >>> distinct(["in the in the"], 2)
        0.6666666666666666
    """
    grams = [g for s in samples for g in _ngrams(s.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repeated_4grams(samples: list[str]) -> float:
    """Share of word 4-grams already seen earlier in the same sample.

    Example:
        >>> repeated_4grams(["a b c d a b c d"])
        0.2
    """
    seen_total, repeats = 0, 0
    for sample in samples:
        seen: set = set()
        for gram in _ngrams(sample.split(), 4):
            repeats += gram in seen
            seen.add(gram)
            seen_total += 1
    return repeats / seen_total if seen_total else 0.0


def line_parses(line: str) -> bool:
    """A generated line parses on its own (a block opener is completed with ' pass').

    Example:
        >>> line_parses("    if x > 0:"), line_parses("return n % 2 == 0"), line_parses("x = (1, ")
        (True, True, False)
    """
    code = line.strip()
    try:
        ast.parse(code + " pass" if code.endswith(":") else code)
        return True
    except SyntaxError:
        return False


def parse_share(samples: list[str]) -> tuple[float, int]:
    """(share of complete, non-blank, non-comment generated lines that parse, number of such lines)."""
    lines = []
    for sample in samples:
        complete = sample.split("\n")[:-1]  # the last line is unfinished
        lines += [line for line in complete if line.strip() and not line.strip().startswith("#")]
    return (sum(map(line_parses, lines)) / len(lines) if lines else 0.0), len(lines)


def generate_samples(model, tok, prompts: list[str], decoding: dict | None, seed: int) -> list[str]:
    out = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        torch.manual_seed(seed)
        # greedy: every processor of the shipped config switched off, not only sampling
        greedy = {"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
        kwargs = greedy if decoding == "greedy" else (decoding or {})
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=pad,
                                 **kwargs)
        out.append(tok.decode(seq[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def measure(samples: list[str], python: bool) -> dict[str, float]:
    result = {"distinct_1": round(distinct(samples, 1), 4), "distinct_2": round(distinct(samples, 2), 4),
              "repeated_4grams": round(repeated_4grams(samples), 4)}
    if python:
        share, n = parse_share(samples)
        result["lines_parse"] = round(share, 4)
        result["lines_counted"] = n
    return result


def card_section(report: dict, verdict: str) -> str:
    """The card's "Sample quality" section from this script's --json report, with the reader's `verdict`."""
    results = report["results"]
    python = "lines_parse" in next(iter(results.values()))
    rows = []
    for name, r in results.items():
        parse = f" {r['lines_parse']:.2f} of {r['lines_counted']} |" if python else ""
        rows.append(f"| {name}: `{json.dumps(r['decoding'])}` | {r['distinct_1']:.2f} | "
                    f"{r['distinct_2']:.2f} | {r['repeated_4grams']:.2f} |{parse}")
    head = "| Decoding | distinct-1 | distinct-2 | repeated 4-grams |"
    head += " lines that parse |" if python else ""
    rule = "|---|---|---|---|" + ("---|" if python else "")
    first = results["shipped generation_config.json"]["samples"][0]
    intro = (
        "`generation_config.json` holds the decoding `generate()` and `pipeline(\"text-generation\")` use "
        f"by default. Measured by `python examples/deq_transformer/sample_quality.py {report['model']}` "
        f"({len(report['prompts'])} fixed prompts, {report['new_tokens']} new tokens each, "
        f"`torch.manual_seed({report['seed']})` before each; distinct-n: distinct word n-grams over all; "
        "repeated 4-grams: share already seen in the same sample"
        + ("; lines that parse: complete generated lines `ast.parse` accepts on their own" if python else "")
        + "):"
    )
    return "\n".join(["## Sample quality", "", intro, "", head, rule, *rows, "",
                      f"First prompt, shipped decoding: `{report['prompts'][0]!r}` -> `{first!r}`", "",
                      verdict, ""])


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    import deqzoo
    from deqzoo.hub import resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint id or directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decoding", type=json.loads, default=None,
                   help="a decoding (JSON generate() keywords) to measure instead of the shipped one")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--show", type=int, default=3, help="print this many samples per decoding")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path = Path(args.model) if Path(args.model).is_dir() else resolve(args.model)
    deqzoo.register()
    tok = AutoTokenizer.from_pretrained(path)
    model = deqzoo.from_pretrained(str(path)).eval()
    python = "pystd" in Path(path).name  # the Python-source checkpoints (the pydoc one is prose)
    prompts = PYTHON_PROMPTS if python else PROSE_PROMPTS
    shipped = {k: v for k, v in model.generation_config.to_diff_dict().items()
               if k in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                        "no_repeat_ngram_size")}
    runs = {"greedy": "greedy", "shipped generation_config.json": args.decoding or shipped}
    if args.decoding:
        runs = {"greedy": "greedy", "--decoding": args.decoding}
    results = {}
    for name, decoding in runs.items():
        samples = generate_samples(model, tok, prompts, decoding, args.seed)
        results[name] = {"decoding": decoding, **measure(samples, python), "samples": samples}
        print(f"## {name}: {decoding}")
        print(json.dumps({k: v for k, v in results[name].items() if k not in ("samples", "decoding")}))
        for prompt, sample in list(zip(prompts, samples))[: args.show]:
            print(f"--- {prompt!r}\n{prompt}{sample}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "seed": args.seed, "new_tokens": NEW_TOKENS,
                                         "prompts": prompts, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
