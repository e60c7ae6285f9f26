"""How a compile says how far it is: its messages, a line each, and each pass over the blocks as the shared bar with
an ETA on a terminal (squareq/progress.py, as `squareq train` shows its steps), or as a line per block in a log."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ..progress import Progress as Bar

Progress = Callable[[str], None]  # compile_slab's ``progress``: gets each message, one line at a time


class CompileProgress:
    """A compile's messages, each handed to ``echo``, and its passes over the blocks (the calibration pass, the output
    correction's). With ``bar`` (a terminal) a pass is a bar whose text names the block and what it does now (a
    phase, a layer), and each message is printed above it. Without, each block's first line carries the pass's ETA,
    and what a block does now is not printed: a line per layer would bury a log."""

    def __init__(self, echo: Progress = lambda line: None, bar: bool = False) -> None:
        self.echo, self.draw_bar = echo, bar
        self.bar: Bar | None = None

    def __call__(self, line: str) -> None:
        (self.echo if self.bar is None else self.bar.above(self.echo))(line)

    @contextlib.contextmanager
    def blocks(self, total: int, desc: str) -> Iterator[CompileProgress]:
        """One pass over ``total`` blocks. Without ``bar`` nothing is drawn: the pass keeps the count that the lines'
        ETA reads."""
        self.bar = Bar(total, desc, "block", shown=self.draw_bar)
        try:
            yield self
        finally:
            self.bar.close()
            self.bar = None

    def begin(self, text: str) -> None:
        """A block starts: ``text`` on the bar, or as a line with the pass's ETA."""
        if self.bar.shown:
            self.bar.status(text)
        else:
            self.echo(f"{text} (ETA {self.bar.eta()})")

    def now(self, text: str) -> None:
        """What the block does now (a layer, a group of layers): on the bar only."""
        self.bar.status(text)

    def done(self, line: str | None = None) -> None:
        """A block is done: its line, if any, and the pass one block further."""
        if line is not None:
            self(line)
        self.bar.advance()
