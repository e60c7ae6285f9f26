"""``TrainError``: what stops ``squareq train`` with one sentence; here so that every stage of a run can raise it."""
from __future__ import annotations


class TrainError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class TrainInterrupted(TrainError):
    """Ctrl-C stopped the run after a finished step; what it wrote and how to resume are in the message. The CLI
    exits with :attr:`exit_code` (130, a shell's code for SIGINT) and prints the message without ``error:``."""

    exit_code = 130
