"""What a gate reports: its status, what it measured, the limit it compared against, and why; and how a gate shows
how far it is (:func:`gate_bar`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..progress import Echo, Progress

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# measured, but the measurement cannot decide (a convergence run that did not learn): never a PASS
INCONCLUSIVE = "INCONCLUSIVE"


@dataclass
class GateResult:
    """One gate's outcome. ``measured`` and ``limit`` are what the table shows; ``details`` what the JSON adds."""

    name: str
    status: str
    measured: str
    limit: str
    note: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict:
        return asdict(self)


def gate_bar(name: str, total: int, unit: str, progress: bool | None = False,
             echo: Echo = lambda line: None) -> Progress:
    """A gate's bar over its ``total`` ``unit``s, titled with the gate's ``name``, with its ETA: drawn when
    ``progress`` (None: on a terminal) and gone when the gate is done (its result line says the rest); else a plain
    line for ``echo`` at each quarter (:meth:`Progress.plain`, e.g. ``"layer MSE: 2/4 blocks, ETA 00:01"``)."""
    return Progress(total, name, unit, shown=progress, echo=echo, every=max(1, total // 4), leave=False)


def advance(bar: Progress) -> None:
    """One unit of a :func:`gate_bar` further, with its plain line when due."""
    bar.advance(line=bar.plain)


def skipped(name: str, why: str) -> GateResult:
    """A gate that cannot run for this model: SKIP with the reason."""
    return GateResult(name, SKIP, "not measured", "", why)
