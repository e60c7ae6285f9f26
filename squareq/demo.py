"""`squareq demo`: the whole pipeline on the built-in tiny model, as far as it exists in this version.

Today that is: build tiny-flux → compile it under a size budget (calibration, smoothing and clip
search, GPTQ rounding, the W4→W6→W8 ladder) → reopen the slab with every hash verified → rebuild
the model from the slab and measure its output error on inputs the compile never saw. Every number
it prints is measured in the run. Training and the acceptance gate join as their commands land.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .compiler import CompileOptions, compile_slab, open_source
from .models import load_builtin, tiny_flux_inputs
from .quant import rel_mse, sqnr_db
from .slab import open_slab
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


def run_demo(out: Path, budget: int, overwrite: bool, echo: Callable[[str], None] = print) -> DemoResult:
    """Compile, verify and measure a slab of the tiny model; ``echo`` receives progress lines."""
    model, adapter = load_builtin("tiny-flux")
    params = sum(p.numel() for p in model.parameters())
    echo(f"[1/4] built tiny-flux: {type(model).__name__}, {params:,} parameters, "
         f"{len(adapter.blocks(model))} blocks")

    start = time.perf_counter()
    manifest = compile_slab(open_source("tiny-flux"), out, CompileOptions(budget=budget, overwrite=overwrite))
    seconds = time.perf_counter() - start
    rungs: dict[str, int] = {}
    for layer in manifest.layers:
        rungs[layer.spec.label().split()[0]] = rungs.get(layer.spec.label().split()[0], 0) + 1
    echo(f"[2/4] compiled {out} in {seconds:.1f} s under a {budget:,}-byte budget: "
         + ", ".join(f"{k} x{v}" for k, v in sorted(rungs.items()))
         + f" ({manifest.calibration['kind']} calibration, {manifest.calibration['samples']} samples)")
    for layer in manifest.layers:
        if layer.reason:
            echo(f"      {layer.name} -> {layer.spec.label().split()[0]}: {'; '.join(layer.reason)}")

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
