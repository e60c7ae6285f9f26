"""The acceptance report three ways: a table for people, JSON for tools, JUnit XML for CI systems.

All three are rendered from the same :class:`AcceptReport`, so they cannot disagree.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..slab.atomic import atomic_write_bytes
from .gates import FAIL, INCONCLUSIVE, SKIP, GateResult


@dataclass
class AcceptReport:
    slab: str
    model: str
    gates: list[GateResult]
    context: dict[str, Any] = field(default_factory=dict)  # device, date, version, thresholds, inputs

    @property
    def passed(self) -> bool:
        """True when no gate failed or was inconclusive (a SKIP is not a failure unless the caller required the
        gate)."""
        return self.verdict == "PASSED"

    @property
    def verdict(self) -> str:
        """FAILED when a gate failed, else INCONCLUSIVE when a gate could not decide, else PASSED."""
        if any(g.failed for g in self.gates):
            return "FAILED"
        return "INCONCLUSIVE" if any(g.status == INCONCLUSIVE for g in self.gates) else "PASSED"

    def to_dict(self) -> dict:
        return {"slab": self.slab, "model": self.model, "passed": self.passed, "verdict": self.verdict,
                **self.context, "gates": [g.to_dict() for g in self.gates]}

    def table(self) -> str:
        """The gates as a markdown table, then the verdict."""
        rows = [["gate", "status", "measured", "limit", "note"], ["---"] * 5]
        rows += [[g.name, g.status, g.measured, g.limit, g.note] for g in self.gates]
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        for g in self.gates:  # the layer-MSE gate's worst layers, measured next to what the manifest claims
            worst = g.details.get("worst") if isinstance(g.details, dict) else None
            if worst:
                lines.append(f"\nworst layers ({g.name}; measured here, manifest's own number in brackets):")
                lines += [f"  {w['layer']}: {w['rel_mse']:.3g}"
                          + (f" [{w['manifest_rel_mse']:.3g}]" if w.get("manifest_rel_mse") is not None else "")
                          for w in worst]
        named = {"FAILED": FAIL, "INCONCLUSIVE": INCONCLUSIVE}.get(self.verdict)
        verdict = self.verdict + (": " + ", ".join(g.name for g in self.gates if g.status == named) if named else "")
        return "\n".join(lines) + f"\n\nsquareq accept {self.slab}: {verdict}"

    def write_json(self, path: str | Path) -> None:
        atomic_write_bytes(Path(path), (json.dumps(self.to_dict(), indent=2, default=str) + "\n").encode())

    def write_junit(self, path: str | Path) -> None:
        """One testcase per gate: ``<failure>`` for FAIL, ``<skipped>`` for SKIP, ``<error>`` for INCONCLUSIVE."""
        suites = ET.Element("testsuites")
        suite = ET.SubElement(suites, "testsuite", name="squareq accept", tests=str(len(self.gates)),
                              failures=str(sum(g.status == FAIL for g in self.gates)),
                              skipped=str(sum(g.status == SKIP for g in self.gates)),
                              errors=str(sum(g.status == INCONCLUSIVE for g in self.gates)),
                              time=f"{sum(g.seconds for g in self.gates):.3f}")
        props = ET.SubElement(suite, "properties")
        for key in ("slab", "model"):
            ET.SubElement(props, "property", name=key, value=getattr(self, key))
        for g in self.gates:
            case = ET.SubElement(suite, "testcase", classname="squareq.accept", name=g.name, time=f"{g.seconds:.3f}")
            text = f"measured {g.measured}; limit {g.limit}; {g.note}"
            if g.status == FAIL:
                ET.SubElement(case, "failure", message=g.note or "gate failed").text = text
            elif g.status == SKIP:
                ET.SubElement(case, "skipped", message=g.note)
            elif g.status == INCONCLUSIVE:  # the gate ran but could not decide: an error, not a pass
                ET.SubElement(case, "error", message="INCONCLUSIVE: " + g.note, type="inconclusive").text = text
            ET.SubElement(case, "system-out").text = text
        atomic_write_bytes(Path(path), ET.tostring(suites, encoding="utf-8", xml_declaration=True))
