"""How a long command says how far it is, the same way in each: training, compiling, filling the cache, the demo.

On a terminal (or when asked) it is one tqdm bar on stderr, as wide as the terminal, with a description, a unit, the
rate and the ETA, and the command's messages printed above it. Elsewhere (a log file, a pipe) nothing is drawn:
the command prints its own plain progress lines, each ``every``-th step and the last, through the ``echo`` it gives.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

Echo = Callable[[str], None]


def wanted(asked: bool | None) -> bool:
    """Whether a bar is drawn: as ``asked``, else when stderr is a terminal."""
    return sys.stderr.isatty() if asked is None else asked


class Progress:
    """``total`` units of one task (steps, blocks, cache entries), counted from ``initial``.

    Shown, the units are a tqdm bar titled ``desc``; ``leave`` keeps the finished bar on the screen. Not shown, no
    tqdm is made at all: a hidden one would still push the bars drawn beside it a line down, and tqdm draws every bar
    it clears to print a message. It only counts, for :meth:`eta` and for the plain lines (``every``, ``echo``)."""

    def __init__(self, total: int, desc: str, unit: str, shown: bool | None = None, echo: Echo = lambda line: None,
                 every: int = 0, initial: int = 0, leave: bool = True) -> None:
        self.total, self.every, self.lines, self.desc, self.unit = total, every, echo, desc, unit
        self.n = self.initial = initial
        self.started = time.time()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr,
                        leave=leave) if wanted(shown) else None

    @property
    def shown(self) -> bool:
        return self.bar is not None

    def above(self, echo: Echo) -> Echo:
        """``echo`` that prints above the live bar instead of through it (``echo`` itself when none is drawn)."""
        if self.bar is None:
            return echo

        def write(text: str) -> None:
            with self.writing():
                echo(text)

        return write

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A stretch in which others print (a "wrote FILE" line): the bar is cleared before and drawn again after."""
        if self.bar is None:
            yield
        else:
            with self.bar.external_write_mode():
                yield

    def status(self, text: str) -> None:
        """What the task does now, as the bar's text; nothing without a bar (a line per change would bury a log)."""
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def advance(self, n: int = 1, status: str | None = None, line: str | Callable[[], str] | None = None) -> None:
        """``n`` units further: the bar, with ``status`` as its text; without one, ``line`` goes to ``echo`` when it is
        due (at each ``every``-th unit, and at the last). A callable ``line`` is made then, after the count (so that
        its :meth:`eta` counts this unit)."""
        before, self.n = self.n, self.n + n
        if self.bar is not None:
            if status is not None:
                self.bar.set_postfix_str(status, refresh=False)  # update draws it
            self.bar.update(n)
        elif line is not None and self.every and (self.n // self.every > before // self.every or
                                                  before < self.total <= self.n):
            self.lines(line() if callable(line) else line)

    def plain(self) -> str:
        """The plain line of where the task is, e.g. ``"layer MSE: 2/4 blocks, ETA 00:12"``."""
        return f"{self.desc}: {self.n}/{self.total} {self.unit}s, ETA {self.eta()}"

    def expect(self, more: int) -> None:
        """``more`` units than the total said (work found on the way)."""
        self.total += more
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def eta(self) -> str:
        """The time left at the average rate so far, as tqdm writes it (``?`` before the first unit is done)."""
        return tqdm.format_meter(self.n, self.total, time.time() - self.started, bar_format="{remaining}",
                                 initial=self.initial)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
