"""A transform is kept for a layer only when it beats plain rounding on held-out samples.

The negative control: calibration samples whose inputs span only 8 directions of the layer's 128 input channels (so
GPTQ-style rounding moves the rounding error into the directions they never take, and looks far better than plain
rounding there) and held-out samples that take every direction (where the moved error shows). The search must propose its transform, and the held-out rows must
reject it. The positive control: held-out samples like the calibration ones keep the transform.
"""
import dataclasses

import torch
from torch import nn

from squareq import quant
from squareq.compiler.layer_search import search_layer
from squareq.compiler.layer_statistics import StatsCollector
from squareq.quant import QuantSpec

K, N, TOKENS, SAMPLES = 128, 64, 64, 8
HELD = (1, 4)


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.proj(x)


def _collect(held_like_fit: bool):
    """Statistics of one linear over [SAMPLES, TOKENS, K] inputs: calibration samples span 8 directions; the held-out
    samples are either the same kind or span all K."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, TOKENS, 8, generator=g) @ torch.randn(8, K, generator=g) / 8**0.5
    if not held_like_fit:
        x[list(HELD)] = torch.randn(len(HELD), TOKENS, K, generator=g)
    torch.manual_seed(1)
    block = OneLinear()
    with torch.no_grad():
        block.proj.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    with StatsCollector("b", block, max_rows=4096, samples=SAMPLES, heldout_samples=HELD) as col:
        block(x)
    return block.proj.weight.detach(), col.stats["b.proj"], x


def test_a_transform_that_only_fits_the_calibration_samples_is_rejected():
    w, st, x = _collect(held_like_fit=False)
    # the held-out rows are exactly the held-out samples' rows, and nothing of them reached the fit
    assert torch.equal(st.heldout_rows, x[list(HELD)].reshape(-1, K))
    assert st.gram_count == (SAMPLES - len(HELD)) * TOKENS

    plain = quant.dequantize(quant.quantize(w, quant.QuantSpec(bits=4)))
    gptq = quant.dequantize(quant.gptq_quantize(w, quant.QuantSpec(bits=4), st.hessian))
    # on the calibration rows the transform wins by far; on the held-out rows it loses by far
    assert quant.output_rel_mse(w, gptq, st.rows) < 0.5 * quant.output_rel_mse(w, plain, st.rows)
    assert quant.output_rel_mse(w, gptq, st.heldout_rows) > 1.2 * quant.output_rel_mse(w, plain, st.heldout_rows)

    # judged on the calibration rows themselves, the search keeps its transform
    chosen_on_calibration = search_layer(w, dataclasses.replace(st, heldout_rows=None), QuantSpec(bits=4)).metrics
    assert chosen_on_calibration["gptq"] == 1.0
    assert chosen_on_calibration["calib_rel_mse"] < 0.5 * quant.output_rel_mse(w, plain, st.rows)

    c = search_layer(w, st, QuantSpec(bits=4))
    m = c.metrics
    assert m["gptq"] == 0.0 and m["alpha"] == 0.0 and m["clip_ratio"] == 1.0 and m["rotate"] == 0.0  # plain rounding
    assert m["heldout_rel_mse"] == m["heldout_rtn_rel_mse"] == m["output_rel_mse"]
    assert torch.equal(quant.dequantize(c.qweight), plain)


def test_a_transform_that_also_helps_the_held_out_samples_is_kept():
    w, st, _ = _collect(held_like_fit=True)
    c = search_layer(w, st, QuantSpec(bits=4))
    m = c.metrics
    assert m["gptq"] == 1.0 or m["alpha"] > 0 or m["clip_ratio"] < 1.0
    assert m["heldout_rel_mse"] < 0.5 * m["heldout_rtn_rel_mse"]
