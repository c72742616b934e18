"""mkdocs hooks (mkdocs.yml `hooks:`): every code block of every page runs in the build, as a reader runs it.

markdown-exec executes the blocks marked ``exec="on"``; these hooks make that the rule and give the blocks
the environment a reader following the pages has:

- `on_page_markdown` fails the build (naming the page and line) on a Python block that is not executed, and
  on a shell block that is neither executed nor preceded by ``<!-- not executed: REASON -->`` (installs,
  servers, minutes-long runs, pushes: what a build must not do). Blocks without a language or in a data
  language (a folder tree, YAML) are text, not code.
- `on_config` runs the build offline with a Hugging Face cache of its own (``HF_HOME`` a temporary folder,
  ``HF_HUB_OFFLINE=1``, set before any block imports huggingface_hub), so the hub page's
  ``python -m deqzoo.hub.hf_cache`` and the stock-library block after it run as written without reading or
  writing the user's cache; `on_post_build` removes it. The interpreter's own ``bin/`` goes first on
  ``PATH``, so shell blocks find the ``python`` and ``deqzoo`` of the environment building the site.

Example (the check on one page's Markdown):
    >>> undeclared("```python\\nprint(1)\\n```\\n", "p.md")
    ['p.md:1: a python block that the build does not execute (add exec="on")']
    >>> undeclared('<!-- not executed: installs packages -->\\n```bash\\npip install x\\n```\\n', "p.md")
    []
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

PYTHON = {"python", "py", "pycon"}
SHELL = {"bash", "sh", "shell", "console", "zsh"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_REASON = re.compile(r"<!--\s*not executed:\s*\S.*-->\s*$")

_hf_home: str | None = None


def undeclared(markdown: str, page: str) -> list[str]:
    """The code blocks of `markdown` the build would not run and that do not say why (one message each)."""
    problems: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        language = info.split()[0].strip("{}.").lower() if info else ""
        executed = re.search(r'\bexec="(on|true|yes|1)"', info) is not None
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        where = f"{page}:{i + 1}: a {language} block that the build does not execute"
        if language in PYTHON and not executed:
            problems.append(f'{where} (add exec="on")')
        elif language in SHELL and not executed and not _REASON.search(before):
            problems.append(f'{where}: add exec="on" or a line <!-- not executed: REASON --> before it')
        # the block ends at the next fence of the same kind, at least as long (CommonMark)
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            i += 1
        i += 1
    return problems


def on_config(config):
    """An offline build with its own Hugging Face cache, and this interpreter's tools first on PATH."""
    global _hf_home
    _hf_home = tempfile.mkdtemp(prefix="deqzoo-docs-hf-")
    os.environ.update(HF_HOME=_hf_home, HF_HUB_CACHE=str(Path(_hf_home) / "hub"), HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return config


def on_page_markdown(markdown, page, config, files):
    problems = undeclared(markdown, page.file.src_uri)
    if problems:
        from mkdocs.exceptions import PluginError

        raise PluginError("docs blocks not executed:\n  " + "\n  ".join(problems))
    return markdown


def on_post_build(config):
    global _hf_home
    if _hf_home is not None:
        shutil.rmtree(_hf_home, ignore_errors=True)
        _hf_home = None
