"""Gate 3: the slab's bytes on disk and the peak GPU memory of its training steps, against their budgets.

The gate has two parts. Size is always measurable (the limit is ``--budget``, else the budget the
compile recorded); peak VRAM needs the training steps to have run on CUDA and a ``--vram-budget``. A
part that cannot be measured is skipped with its reason (``--require-gpu`` makes a missing GPU
measurement a failure). The gate fails when a measured part exceeds its limit, and is SKIP when a part
that was asked for (``--vram-budget``) could not be measured.
"""
from __future__ import annotations

from ..sizes import format_size
from ..slab import Slab
from .gates import FAIL, PASS, SKIP, GateResult

NAME = "peak VRAM and size"


def _size(slab: Slab, budget: int | None) -> dict:
    size = slab.file_bytes()
    where = "--budget"
    if budget is None:
        budget, where = (slab.manifest.calibration or {}).get("budget_bytes"), "compile budget"
    if not budget:
        return {"status": SKIP, "measured": f"slab {format_size(size)}", "limit": "",
                "note": "size not gated: no --budget and none recorded by the compile", "bytes": size}
    return {"status": PASS if size <= budget else FAIL, "measured": f"slab {format_size(size)}",
            "limit": f"{format_size(budget)} ({where})", "note": f"slab at {100 * size / budget:.1f}% of its budget",
            "bytes": size, "budget_bytes": budget}


def _vram(records: list[dict], budget: int | None, require_gpu: bool) -> dict:
    peaks = [r["peak_reserved_GB"] for r in records if "peak_reserved_GB" in r]
    if not peaks:
        why = "VRAM not measured: the training steps ran without CUDA"
        return {"status": FAIL if require_gpu else SKIP, "measured": "VRAM not measured", "limit": "",
                "note": why + ("; --require-gpu needs it" if require_gpu else "")}
    peak = int(max(peaks) * 1e9)
    measured = f"peak reserved {format_size(peak)}"
    if budget is None:
        return {"status": SKIP, "measured": measured, "limit": "", "peak_reserved_bytes": peak,
                "note": "VRAM measured but not gated: give --vram-budget"}
    return {"status": PASS if peak <= budget else FAIL, "measured": measured, "limit": f"VRAM {format_size(budget)}",
            "note": f"peak reserved over {len(peaks)} training steps", "peak_reserved_bytes": peak,
            "budget_bytes": budget}


def resources_gate(slab: Slab, budget: int | None, records: list[dict], vram_budget: int | None,
                   require_gpu: bool) -> GateResult:
    """Size and peak VRAM (from the quantized run's per-step metrics ``records``) as one gate."""
    parts = {"size": _size(slab, budget), "vram": _vram(records, vram_budget, require_gpu)}
    statuses = [p["status"] for p in parts.values()]
    # a part asked for (a VRAM budget, or a GPU required) that could not be measured makes the gate SKIP, not PASS
    asked = [parts["size"]] + ([parts["vram"]] if vram_budget is not None or require_gpu else [])
    status = FAIL if FAIL in statuses else SKIP if any(p["status"] == SKIP for p in asked) else \
        PASS if PASS in statuses else SKIP
    join = lambda key: "; ".join(p[key] for p in parts.values() if p[key])  # noqa: E731
    return GateResult(NAME, status, join("measured"), join("limit"), join("note"), 0.0, parts)
