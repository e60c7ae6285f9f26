"""`squareq compile --from PREV.slab`: a slab built before, as the starting point of a rebuild.

Each layer starts at its rung in PREV. When PREV was measured on the same inputs (same source files, calibration
data and search options: its manifest's ``measurement_key``), its per-rung measurements (bytes, effect on the
model's output, layer metrics) are reused instead of measured again, and a layer that stays on its rung keeps PREV's
stored tensors; only a layer that moves to a rung PREV does not hold is searched again.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..quant import QuantizedWeight
from ..slab import SlabError, open_slab
from ..slab.manifest import LayerRecord, align_up
from ..slab.signature import model_signature
from .plan import LayerOptions


@dataclass
class Previous:
    """What a rebuild takes from PREV: its rungs, its layers' records and, when measured alike, its measurements."""

    path: Path
    slab: object
    records: dict[str, LayerRecord]
    build: int
    key: str | None
    effect_info: dict | None

    @property
    def rungs(self) -> dict[str, str]:
        """Each layer's rung in PREV, by name."""
        return {name: rec.spec.short_label for name, rec in self.records.items()}

    def layer_bytes(self, name: str) -> int:
        """Bytes the layer's stored tensors take in PREV's block blob."""
        return sum(align_up(t.nbytes) for t in self.records[name].tensors.values())

    def layer_options(self) -> list[LayerOptions]:
        """Each layer's bytes and measured effect per rung, as PREV recorded them."""
        return [LayerOptions(name, rec.block, {r: m["bytes"] for r, m in rec.rungs.items()},
                             {r: float(m["metrics"].get("effect", 0.0)) for r, m in rec.rungs.items()},
                             rec.spec.short_label)
                for name, rec in self.records.items()]

    def fixed_bytes(self) -> dict[int, int]:
        """Bytes of each block's tensors besides its linear layers, as PREV stores them."""
        return {b.index: sum(align_up(p.nbytes) for p in b.params) for b in self.slab.manifest.blocks}

    def quantized_weight(self, name: str) -> QuantizedWeight:
        """PREV's stored tensors of one layer, copied out of its file."""
        qw = self.slab.quantized_weight(name)
        return QuantizedWeight(qw.spec, qw.shape, {k: v.clone() for k, v in qw.tensors.items()})


def read_previous(path, source, skeleton) -> Previous:
    """Open ``--from PATH`` and check that it was compiled from this model; one sentence when it cannot be used."""
    path = Path(path)
    try:
        slab = open_slab(path, verify="eager")
    except SlabError as exc:
        raise SlabError(f"--from {path}: {exc}") from None
    m = slab.manifest
    if m.model.signature != model_signature(skeleton):
        slab.close()
        raise SlabError(f"--from {path} was compiled from another model ({m.model.class_name}, {m.model.source}) than "
                        f"{source.description}; pass a slab of this model, or leave --from out to build from scratch.")
    cal = m.calibration or {}
    complete = all(rec.rungs for rec in m.layers)
    return Previous(path, slab, {rec.name: rec for rec in m.layers}, int(cal.get("build", 1)),
                    cal.get("measurement_key") if complete else None, cal.get("effect"))
