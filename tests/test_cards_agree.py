"""Every embedded checkpoint, run as `deqzoo demo` runs it at its card's settings, gives what its card says:
the demo's metric and converged flag are the card's `deqzoo_demo` entry, a solve that does not converge says
why in the card, no non-convergence warning comes from a checkpoint at its own settings, and the catalog's
metrics are the card's.

The demos are the work (`examples.demo.card_demo`, the function `deqzoo demo` calls): the light ones run in
the default suite, the three that render or sample large outputs (~20-30 s each on one core) under
`extended`. Re-record a card's entry after changing its checkpoint, config or demo:
``PYTHONPATH=. python tests/test_cards_agree.py NAME ...`` prints the entries to paste.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from deqzoo.hub.catalog import load_catalog

HEAVY = {"deqzoo/ddim-digits-16", "deqzoo/implicit2-isiren-camera", "deqzoo/implicit2-igabor-mfn-camera"}
NAMES = sorted(load_catalog())


def observed(name: str, output_dir: Path) -> tuple[dict, dict, str]:
    """(what the demo gives as a card entry, the card's metadata, the card's body) for one checkpoint, with
    any non-convergence warning turned into an error."""
    from deqzoo.hub.cards import read_model_card
    from deqzoo.modeling_utils import DEQNonConvergenceWarning
    from examples.demo import card_demo

    with warnings.catch_warnings():
        warnings.simplefilter("error", DEQNonConvergenceWarning)
        row, _, _, meta, directory = card_demo(name, output_dir)
    _, body = read_model_card(directory)
    return {"metric": row["metric"], "converged": row["converged"]}, meta, body


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in HEAVY else n
                                  for n in NAMES])
def test_demo_at_card_settings_is_what_the_card_says(name, tmp_path):
    from deqzoo.hub.cards import card_metrics

    got, meta, body = observed(name, tmp_path)
    card = meta.get("deqzoo_demo")
    assert isinstance(card, dict), f"{name}: the card has no deqzoo_demo entry; record it: {got}"
    assert got["metric"] == card.get("metric"), f"{name}: demo metric {got['metric']!r}, card {card}"
    assert got["converged"] == card.get("converged"), f"{name}: demo converged {got['converged']!r}, {card}"
    if got["converged"] not in (None, "yes"):  # a solve that stops above its tolerance: the card says why
        why = str(card.get("why") or "")
        assert len(why) > 40, f"{name}: the demo's solve does not converge; deqzoo_demo.why is empty"
    assert load_catalog()[name]["metrics"] == card_metrics(meta), f"{name}: catalog out of date"


if __name__ == "__main__":  # print the deqzoo_demo entries of the named checkpoints (all by default)
    import tempfile

    import yaml

    for name in sys.argv[1:] or NAMES:
        with tempfile.TemporaryDirectory() as scratch:
            entry, _, _ = observed(name, Path(scratch))
        print(f"# {name}\n" + yaml.safe_dump({"deqzoo_demo": entry}, sort_keys=False, allow_unicode=True))
