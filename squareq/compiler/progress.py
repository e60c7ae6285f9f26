"""How a compile says how far it is: its messages, a line each, and each pass over the blocks as a tqdm bar with an
ETA on a terminal (as `squareq train` shows its steps), or as a line per block in a log."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

from tqdm import tqdm

Progress = Callable[[str], None]  # compile_slab's ``progress``: gets each message, one line at a time


class CompileProgress:
    """A compile's messages, each handed to ``echo``, and its passes over the blocks (the calibration pass, the output
    correction's). With ``bar`` (a terminal) a pass is a tqdm bar whose text names the block and what it does now (a
    phase, a layer), and each message is printed above it. Without, each block's first line carries the pass's ETA,
    and what a block does now is not printed: a line per layer would bury a log."""

    def __init__(self, echo: Progress = lambda line: None, bar: bool = False) -> None:
        self.echo, self.shown = echo, bar
        self.bar: tqdm | None = None

    def __call__(self, line: str) -> None:
        if self.bar is not None and self.shown:
            with self.bar.external_write_mode():
                self.echo(line)
        else:
            self.echo(line)

    @contextlib.contextmanager
    def blocks(self, total: int, desc: str) -> Iterator[CompileProgress]:
        """One pass over ``total`` blocks. Without ``bar`` its tqdm is never drawn (``delay``): it keeps the count and
        the rate that the lines' ETA reads."""
        self.bar = tqdm(total=total, unit="block", dynamic_ncols=True, desc=desc, delay=0 if self.shown else math.inf)
        try:
            yield self
        finally:
            self.bar.close()
            self.bar = None

    def begin(self, text: str) -> None:
        """A block starts: ``text`` on the bar, or as a line with the pass's ETA."""
        if self.shown:
            self.bar.set_postfix_str(text)
        else:
            self.echo(f"{text} (ETA {tqdm.format_meter(**{**self.bar.format_dict, 'bar_format': '{remaining}'})})")

    def now(self, text: str) -> None:
        """What the block does now (a layer, a group of layers): on the bar only."""
        if self.shown:
            self.bar.set_postfix_str(text)

    def done(self, line: str | None = None) -> None:
        """A block is done: its line, if any, and the pass one block further."""
        if line is not None:
            self(line)
        self.bar.update()
