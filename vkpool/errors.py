"""Exceptions that both the in-process API and the daemon's client raise, so that one mistake
raises one class whichever way a model runs. Kept free of heavy imports: the client loads it."""
from __future__ import annotations


class InvalidInput(ValueError):
    """The inputs given to ``run`` do not match the model's inputs (names, dtypes, shapes)."""
