"""Gate: each block's effect on the model's final output, re-measured end to end on fresh inputs.

The compiler judges a block by its own output on its calibration batch. Here the source model runs whole, in full
precision, on the layer-MSE gate's fresh inputs (another seed, other noise and times): once as it is, then once per
sampled block with only that block's layers replaced by the slab's effective weights. The drift of block b is the
rel-MSE of the final output ``‖y_b − y‖² / ‖y‖²``: what quantizing b alone does to what the model returns. With more
than ``blocks`` blocks, an evenly spaced sample of them is measured (first and last included).

PASS when every measured block's drift is at most τ_DRIFT.
"""
from __future__ import annotations

import time

import torch

from ..compiler.effect import main_output
from ..progress import Echo
from ..slab import Slab
from ..slab.writer import block_linears
from ..sources import Source
from .gates import FAIL, PASS, GateResult, advance, gate_bar
from .layer_mse import fresh_inputs

NAME = "block drift"


def sampled_blocks(count: int, wanted: int) -> list[int]:
    """``wanted`` block indices spread evenly over ``count`` blocks, the first and the last included."""
    if wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})


@torch.no_grad()
def block_drift_gate(source: Source, slab: Slab, tau: float, samples: int = 2, blocks: int = 8,
                     device="cpu", progress: bool | None = False, echo: Echo = lambda line: None) -> GateResult:
    """Model-output rel-MSE with only one block quantized, for up to ``blocks`` blocks; the model's passes (the
    reference's, one per block) counted on a bar (``progress``) or in lines for ``echo`` (:func:`gate_bar`)."""
    started = time.perf_counter()
    kwargs, description = fresh_inputs(source, slab, samples, device)
    layers = {layer.name for layer in slab.manifest.layers}
    quantized_block = None

    def run_block(index: int, path: str, args, kw):
        block = source.load_block(path, device, torch.float32)
        if index == quantized_block:
            for name, module in block_linears(path, block):
                if name in layers:
                    module.weight.data = slab.dequantized_weight(name).to(device, torch.float32)
        return block(*args, **kw)

    shell = source.shell(run_block, device)
    chosen = sampled_blocks(len(source.block_paths), blocks)
    with gate_bar(NAME, 1 + len(chosen), "forward", progress, echo) as bar:
        reference = main_output(shell(**kwargs)).float()
        advance(bar)
        norm = float(reference.square().sum().clamp_min(1e-30))
        drift = {}
        for b in chosen:
            quantized_block = b
            output = main_output(shell(**kwargs)).float()
            drift[source.block_paths[b]] = float((output - reference).square().sum()) / norm
            advance(bar)
    worst = max(drift, key=drift.get)
    over = [p for p, v in drift.items() if v > tau]
    note = f"worst {worst}" + (f"; {len(over)} of {len(drift)} blocks over τ_DRIFT" if over else "")
    return GateResult(NAME, FAIL if over else PASS, f"max {drift[worst]:.3g} over {len(drift)} of "
                      f"{len(source.block_paths)} blocks", f"τ_DRIFT {tau:g}", note, time.perf_counter() - started,
                      {"tau": tau, "drift": drift, "over": over, "inputs": description})
