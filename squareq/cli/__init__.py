"""The `squareq` command line: a thin layer that parses flags, calls the library and prints. The group, its global
options and the list of commands are cli/group.py's; each command is its own module's, imported when it runs."""
from .group import main


def __getattr__(name: str):
    """``USER_ERRORS`` (cli/errors.py) on first use: its modules import torch, which `squareq --help` must not."""
    if name == "USER_ERRORS":
        from .errors import USER_ERRORS

        return USER_ERRORS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["USER_ERRORS", "main"]
