"""What is in a slab, as plain data (for ``--json``) and as text tables (for people)."""
from __future__ import annotations

import math

from .manifest import itemsize
from .reader import Slab


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def summarize(slab: Slab) -> dict:
    """Per-layer rows, per-block sizes and totals computed from the manifest and file sizes."""
    m = slab.manifest
    layers, quant_weights, quant_bytes = [], 0, 0
    for rec in m.layers:
        nbytes = sum(t.nbytes for t in rec.tensors.values())
        weights = rec.shape[0] * rec.shape[1]
        quant_weights += weights
        quant_bytes += nbytes
        layers.append({
            "layer": rec.name,
            "block": rec.block,
            "shape": rec.shape,
            "format": rec.spec.label(),
            "bits": rec.spec.bits,
            "group_size": None if rec.spec.is_passthrough else rec.spec.group_size,
            "clip_ratio": rec.spec.clip_ratio,
            "smooth": rec.spec.smooth,
            "rotate": rec.spec.rotate,
            "bytes": nbytes,
            "bits_per_weight": 8 * nbytes / weights,
            "metrics": rec.metrics,
            "rung": rec.rung or rec.spec.short_label,
            "reason": rec.reason,
            "history": rec.history,
        })
    blocks = [{"block": b.index, "name": b.name, "bytes": b.nbytes, "layers": len(b.layers)} for b in m.blocks]
    streamed = sum(b.nbytes for b in m.blocks)
    resident = sum(math.prod(r.shape) * itemsize(r.dtype) for r in m.resident)
    sizes = [b.nbytes for b in m.blocks]
    return {
        "path": str(slab.path),
        "format_version": m.format_version,
        "model": {"family": m.model.family, "class": m.model.class_name, "source": m.model.source,
                  "signature": m.model.signature},
        "calibration": m.calibration,
        "layers": layers,
        "blocks": blocks,
        "totals": {
            "file_bytes": slab.file_bytes(),
            "streamed_bytes": streamed,
            "resident_bytes": resident,
            "quantized_layers": len(layers),
            "layer_weights": quant_weights,
            "layer_bytes": quant_bytes,
            "bits_per_weight": 8 * quant_bytes / quant_weights if quant_weights else 0.0,
            "largest_block_bytes": max(sizes, default=0),
            "smallest_block_bytes": min(sizes, default=0),
            "mean_block_bytes": sum(sizes) / len(sizes) if sizes else 0.0,
            "bits_histogram": _histogram(layers),
        },
    }


def _histogram(layers: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in layers:
        out[row["format"]] = out.get(row["format"], 0) + 1
    return dict(sorted(out.items()))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


# The table shows these metrics when present (all of them are in --json): the layer's measured effect on the model's
# output at its rung, its own output error on held-out calibration rows, plain rounding's on the same rows, and the
# transforms kept (α 0: no smoothing, clip 1: none, rot 1: the Hadamard rotation, ref 1: learned rounding).
TABLE_METRICS = {"effect": "effect", "heldout_rel_mse": "heldout", "heldout_rtn_rel_mse": "rtn_heldout",
                 "weight_rel_mse": "w_mse", "alpha": "alpha", "clip_ratio": "clip", "gptq": "gptq", "rotate": "rot",
                 "refined": "ref"}
OLD_METRICS = {"output_rel_mse": "out_mse"}  # slabs compiled before held-out selection


def _metric_text(metrics: dict) -> str:
    names = TABLE_METRICS if "heldout_rel_mse" in metrics else {**OLD_METRICS, **TABLE_METRICS}
    shown = [f"{short}={metrics[k]:.3g}" for k, short in names.items() if k in metrics]
    return " ".join(shown) if shown else "-"


def _calibration_text(cal: dict | None) -> str:
    """One line on what the compile calibrated on (the manifest's calibration record)."""
    if not cal:
        return "calibration: not recorded"
    what = cal.get("source") or cal.get("why") or cal.get("kind")
    held = f", {cal['heldout_samples']} held out" if cal.get("heldout_samples") else ""
    line = f"calibration: {cal.get('kind')}, {cal.get('samples')} samples of {what}{held}"
    if "measured_output_rel_mse" in cal:
        line += (f"\nbuild {cal.get('build')}" + (f" from {cal['from']}" if cal.get("from") else "")
                 + f" ({cal.get('measurements')}): model-output rel-MSE on the held-out samples "
                 f"{cal['measured_output_rel_mse']:.3g} measured, {cal['predicted_output_rel_mse']:.3g} predicted "
                 f"(sum of the layers' effects); τ_OUT {cal.get('tau_out')}")
    return line


def _history_text(r: dict) -> list[str]:
    """'  layer: build 1 W8 (up W4→W8: ...); build 2 NF4 (down W8→NF4: ...)' for a layer that ever moved."""
    hist = r.get("history") or []
    if not any(h.get("moves") for h in hist):
        return []
    steps = [f"build {h['build']} {h['rung']}" + (f" ({'; '.join(h['moves'])})" if h.get("moves") else "")
             for h in hist]
    return [f"  {r['layer']}: " + "; ".join(steps)]


def _diagnostics_text(r: dict) -> list[str]:
    last = (r.get("history") or [{}])[-1]
    return [f"  {r['layer']}: " + "; ".join(last["diagnostics"])] if last.get("diagnostics") else []


def format_summary(s: dict) -> str:
    """The inspect report: layer table, block table, totals."""
    t = s["totals"]
    layer_rows = [
        [r["layer"], str(r["block"]), r["rung"], str(r["group_size"] or "-"), human_bytes(r["bytes"]),
         f"{r['bits_per_weight']:.2f}", _metric_text(r["metrics"])]
        for r in s["layers"]
    ]
    block_rows = [[str(b["block"]), b["name"], str(b["layers"]), human_bytes(b["bytes"])] for b in s["blocks"]]
    m = s["model"]
    why = [f"  {r['layer']} ({r['rung']}): " + "; ".join(r["reason"]) for r in s["layers"]
           if r["reason"] and not r.get("history")]
    history = [line for r in s["layers"] for line in _history_text(r)]
    flagged = [line for r in s["layers"] for line in _diagnostics_text(r)]
    lines = [
        f"slab {s['path']}  (format v{s['format_version']}, {m['class']} family={m['family']} source={m['source']})",
        _calibration_text(s.get("calibration")),
        "",
        _table(["layer", "block", "format", "group", "size", "bits/w", "metrics"], layer_rows),
        "",
        _table(["block", "name", "layers", "size"], block_rows),
        "",
        *(["why these layers left the lower rungs:", *why, ""] if why else []),
        *(["history (the rung at each build, and why it moved):", *history, ""] if history else []),
        *(["diagnostics (proxy limits exceeded; they move no layer, docs/compiler.md):", *flagged, ""]
          if flagged else []),
        f"layers: {t['quantized_layers']}  formats: "
        + ", ".join(f"{k} x{v}" for k, v in t["bits_histogram"].items()),
        f"layer weights: {t['layer_weights']:,} in {human_bytes(t['layer_bytes'])} "
        f"= {t['bits_per_weight']:.3f} bits per weight (scales and zero points included)",
        f"streamed blocks: {human_bytes(t['streamed_bytes'])} (largest {human_bytes(t['largest_block_bytes'])}, "
        f"smallest {human_bytes(t['smallest_block_bytes'])}, mean {human_bytes(t['mean_block_bytes'])})",
        f"resident tensors: {human_bytes(t['resident_bytes'])}",
        f"on disk: {human_bytes(t['file_bytes'])}",
    ]
    return "\n".join(lines)
