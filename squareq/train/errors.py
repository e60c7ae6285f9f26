"""``TrainError``: what stops ``squareq train`` with one sentence; here so that every stage of a run can raise it."""
from __future__ import annotations


class TrainError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""
