"""Return a model card's body as Markdown for a docs page (a block executed by markdown-exec prints it:
markdown-exec captures the block's own `print`, not this module's).

The YAML header is dropped, headings go one level down, and links and images relative to the card's folder
become plain text naming the file, since the site does not carry model_cards/."""

from __future__ import annotations

import re
from pathlib import Path


def card(name: str) -> str:
    text = Path("model_cards", name, "README.md").read_text(encoding="utf-8")
    if text.startswith("---"):
        text = text.split("\n---", 2)[-1].split("\n", 1)[-1]
    text = re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.M)
    text = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", rf"(figure `model_cards/{name}/\2`: \1)", text)
    text = re.sub(r"\[([^\]]+)\]\((?!https?://|#)([^)]+)\)", rf"\1 (`model_cards/{name}/\2`)", text)
    return text
