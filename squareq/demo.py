"""`squareq demo`: the whole pipeline on the built-in tiny model, as far as it exists in this version.

Today that is: build tiny-flux → write a uniform-format slab (RTN + clip search) → reopen it with
every hash verified → rebuild the model from the slab and measure its output error. Every number
it prints is measured in the run. Calibrated compile, training and the acceptance gate join as
their commands land.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .models import load_builtin, tiny_flux_inputs
from .quant import QuantSpec, rel_mse, sqnr_db
from .slab import WriteOptions, open_slab, write_slab
from .slab.summary import summarize


@dataclass
class DemoResult:
    slab_path: Path
    write_seconds: float
    bits_per_weight: float
    slab_bytes: int
    bf16_bytes: int
    output_rel_mse: float
    output_sqnr_db: float


def run_demo(out: Path, spec: QuantSpec, overwrite: bool, echo: Callable[[str], None] = print) -> DemoResult:
    """Write, verify and measure a slab of the tiny model; ``echo`` receives progress lines."""
    model, adapter = load_builtin("tiny-flux")
    params = sum(p.numel() for p in model.parameters())
    echo(f"[1/4] built tiny-flux: {type(model).__name__}, {params:,} parameters, "
         f"{len(adapter.blocks(model))} blocks")

    start = time.perf_counter()
    write_slab(model, adapter.blocks(model), {}, out,
               WriteOptions(default_spec=spec, family=adapter.family, source="tiny-flux", overwrite=overwrite))
    seconds = time.perf_counter() - start
    echo(f"[2/4] wrote {out} in {seconds:.2f} s: every block linear at {spec.label()}, RTN with clip search "
         "(uncalibrated; calibrated per-layer bit choice comes with `squareq compile`)")

    with open_slab(out, verify="eager") as slab:
        totals = summarize(slab)["totals"]
        bf16 = sum(2 * p.numel() for p in model.parameters())
        echo(f"[3/4] reopened with every sha256 verified: {totals['bits_per_weight']:.3f} bits per layer weight, "
             f"{totals['file_bytes']:,} bytes on disk vs {bf16:,} bytes of bf16 parameters")
        rebuilt, _ = load_builtin("tiny-flux")
        rebuilt.load_state_dict({k: v.float() for k, v in slab.dequantized_state_dict().items()})

    inputs = tiny_flux_inputs(seed=1234)
    with torch.no_grad():
        ref = model(**inputs).sample
        got = rebuilt(**inputs).sample
    err, sqnr = float(rel_mse(ref, got)), sqnr_db(ref, got)
    echo(f"[4/4] model rebuilt from the slab vs the original on seeded inputs: output rel-MSE {err:.3e}, "
         f"SQNR {sqnr:.1f} dB")
    return DemoResult(out, seconds, totals["bits_per_weight"], totals["file_bytes"], bf16, err, sqnr)
