"""`squareq compile --from PREV.slab`: a slab built before, as the starting point of a rebuild.

Each layer starts at its rung in PREV. When PREV was measured on the same inputs (same source files, calibration
data and search options: its manifest's ``measurement_key``), its per-rung measurements (bytes, effect on the
model's output, layer metrics) are reused instead of measured again, and a layer that stays on its rung keeps PREV's
stored tensors; only a layer that moves to a rung PREV does not hold is searched again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import QuantizedWeight, QuantSpec, SpecError
from ..slab import SlabError, open_slab
from ..slab.manifest import MANIFEST_FILE, LayerRecord, align_up
from ..slab.signature import model_signature
from .plan import LayerOptions

log = logging.getLogger("squareq.compiler")
# the metrics ladder.diagnostics reads of a reused quantized rung
_DIAGNOSED = ("output_rel_mse", "act_outlier_score", "scale_ratio")


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

    def corrected(self, name: str) -> bool:
        """Whether PREV stores the layer with an output correction (compiler/correction.py): its stored scales and
        its bias then belong together."""
        return bool(self.records[name].metrics.get("corrected"))

    def bias(self, name: str, path: str) -> torch.Tensor | None:
        """PREV's stored bias of layer ``name`` of block ``path`` (float32), or None when it has none."""
        rec = self.records[name]
        found = self.slab.block_params(rec.block).get(f"{name[len(path) + 1:]}.bias")
        return None if found is None else found.float().clone()


def check_previous(path, source) -> None:
    """:func:`read_previous`'s refusals that need no hashing (another model, a damaged ``calibration.build``), for
    the CLI to make before the encoders run; nothing without ``--from`` (``path`` None)."""
    if path is not None:
        _open(Path(path), source, source.skeleton(), "off")[0].close()


def _open(path: Path, source, skeleton, verify: str):
    """(the opened slab, its build number), or :class:`SlabError` naming ``--from``, the file and the key."""
    try:
        slab = open_slab(path, verify=verify)
    except SlabError as exc:
        raise SlabError(f"--from {path}: {exc}") from None
    m = slab.manifest
    if m.model.signature != model_signature(skeleton):
        slab.close()
        raise SlabError(f"--from {path} was compiled from another model ({m.model.class_name}, {m.model.source}) than "
                        f"{source.description}; pass a slab of this model, or leave --from out to build from scratch.")
    build = (m.calibration or {}).get("build", 1)
    if type(build) is not int or build < 1:  # a bool or "2" is not a count: the new slab's build is this plus one
        slab.close()
        raise SlabError(f"--from {path}: {path / MANIFEST_FILE}'s calibration.build is {str(build)[:40]!r}, not a "
                        "whole number of at least 1 (how many builds made that slab); write the number there, or "
                        "leave --from out to build from scratch.")
    return slab, build


def read_previous(path, source, skeleton) -> Previous:
    """Open ``--from PATH`` and check that it was compiled from this model; one sentence when it cannot be used."""
    path = Path(path)
    slab, build = _open(path, source, skeleton, "eager")
    m = slab.manifest
    cal = m.calibration or {}
    key = cal.get("measurement_key") if all(rec.rungs for rec in m.layers) else None
    info = cal.get("effect")  # the effects pass's record (None from SquareQs before it), copied on reuse
    sound = info is None or isinstance(info, dict) and not any(type(v) is float and not math.isfinite(v)
                                                               for v in info.values())
    damaged = None if key is None else _unusable_measurement(m.layers) or (
        None if sound else f"calibration.effect is {str(info)[:40]!r}, not the effects pass's record")
    if damaged is not None:
        # the planner would copy a NaN effect into the new manifest and plan on it; measure afresh instead
        log.warning("--from %s: %s's %s; measuring this compile's effects again instead of reusing that slab's.",
                    path, path / MANIFEST_FILE, damaged)
        key = None
    return Previous(path, slab, {rec.name: rec for rec in m.layers}, build, key, info)


def _unusable_measurement(layers: list[LayerRecord]) -> str | None:
    """What in the layers' per-rung records cannot be reused (a rebuild plans on them and copies them into its
    manifest), or None: each rung needs a spec, a positive byte count, numeric metrics that are not NaN (with those
    the diagnostics read) and a finite, non-negative effect."""
    for rec in layers:
        for rung, r in rec.rungs.items():
            where = f"layer {rec.name} at {rung}"
            if not isinstance(r, dict) or not isinstance(r.get("metrics"), dict):
                return f"{where} has no metrics record"
            if type(r.get("bytes")) is not int or r["bytes"] < 1:
                return f"{where} records bytes {str(r.get('bytes'))[:40]!r}, not a positive whole number"
            try:
                spec = QuantSpec.from_dict(r.get("spec"))
            except (SpecError, TypeError, ValueError):
                return f"{where} records a spec that is not a format SquareQ knows"
            lacking = [k for k in _DIAGNOSED if k not in r["metrics"]] if not spec.is_passthrough else []
            if lacking:  # the new manifest's diagnostics read them
                return f"{where} records no {lacking[0]}"
            effect = r["metrics"].get("effect", 0.0)
            if type(effect) not in (int, float) or not math.isfinite(effect) or effect < 0:
                return f"{where} records effect {str(effect)[:40]}, not a finite number of at least 0"
            for name, value in r["metrics"].items():
                if type(value) not in (int, float) or math.isnan(value):
                    return f"{where} records {name} {str(value)[:40]}, not a number"
    return None
