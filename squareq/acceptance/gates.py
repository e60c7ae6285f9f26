"""What a gate reports: its status, what it measured, the limit it compared against, and why."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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


def skipped(name: str, why: str) -> GateResult:
    """A gate that cannot run for this model: SKIP with the reason."""
    return GateResult(name, SKIP, "not measured", "", why)
