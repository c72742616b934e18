"""`python -m deqzoo.hub.catalog`: regenerate deqzoo/hub/catalog.json from model_cards/*/."""

from . import main

raise SystemExit(main())
