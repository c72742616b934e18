"""Converters from original DEQ releases to deqzoo checkpoints (one module per upstream format).

`deqzoo convert FORMAT SRC OUT` discovers the `FORMATS` dict of each module here; see the modules' docstrings.
"""
