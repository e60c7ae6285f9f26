"""A slab by plain rounding on a fixed plan: no calibration, no ladder. For tests, benchmarks and baselines (RTN at
a given format), never what ``squareq compile`` writes.

Every ``nn.Linear`` inside a streamed block is rounded to nearest under its spec (a clip-ratio search per layer
unless ``clip_search=False``); every other tensor of a block is stored raw inside that block's blob; tensors outside
the blocks are stored as resident.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..quant import QuantizedWeight, QuantSpec
from ..slab import SlabError
from ..slab.manifest import Manifest
from ..slab.writer import BlockContent, SlabBuilder, WriteOptions, block_linears


@dataclass
class PlainOptions(WriteOptions):
    """The slab's :class:`WriteOptions` and plain rounding's own."""

    default_spec: QuantSpec | None = None  # for block linears the plan does not name
    clip_search: bool = True  # search the clip ratio per layer (else use the spec's)
    smoothing: Mapping[str, torch.Tensor] = field(default_factory=dict)  # layer -> s, for smooth specs
    act_second_moments: Mapping[str, torch.Tensor] = field(default_factory=dict)  # layer -> E[x²] per channel
    metrics: Mapping[str, dict] = field(default_factory=dict)  # extra measured metrics per layer
    reasons: Mapping[str, list] = field(default_factory=dict)  # reasons recorded per layer


def rtn_quantize(name: str, w: torch.Tensor, spec: QuantSpec, opts: PlainOptions) -> QuantizedWeight:
    """Round-to-nearest with the optional clip search."""
    w = w.detach().float()
    smooth = opts.smoothing.get(name)
    if spec.smooth and smooth is None:
        raise SlabError(f"layer {name} asks for smoothing but no smoothing scale was provided.")
    if opts.clip_search and not spec.is_passthrough:
        found = quant.search_clip_ratio(w, spec, opts.act_second_moments.get(name), smooth)
        spec = spec.with_clip(found.clip_ratio)
    return quant.quantize(w, spec, smooth)


def write_rtn_slab(model: nn.Module, blocks: Sequence[str], plan: Mapping[str, QuantSpec], out: str | Path,
                   options: PlainOptions | None = None) -> Manifest:
    """Round ``model``'s streamed ``blocks`` (module paths) by ``plan`` (spec by layer name, else
    ``options.default_spec``) and write the slab directory ``out``."""
    opts = options or PlainOptions()
    modules = [_module(model, p) for p in blocks]
    specs = {}
    for p, m in zip(blocks, modules):
        for name, _ in block_linears(p, m):
            specs[name] = plan.get(name, opts.default_spec)
            if specs[name] is None:
                raise SlabError(f"layer {name} has no QuantSpec in the plan and no default spec was given.")
    prefixes = tuple(f"{p}." for p in blocks)
    residents = {n: t for n, t in model.state_dict().items() if not n.startswith(prefixes)}
    with SlabBuilder(out, model, opts) as slab:
        for i, (prefix, block) in enumerate(zip(blocks, modules)):
            quantized = {name: rtn_quantize(name, mod.weight, specs[name], opts)
                         for name, mod in block_linears(prefix, block)}
            slab.add_block(BlockContent(i, prefix, block, quantized, opts.metrics, opts.reasons))
        return slab.finish(residents)


def _module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise SlabError(f"the model has no block module {path!r}; check the block list.") from None
