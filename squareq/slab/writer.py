"""Write a slab: quantize each streamed block's linear layers (RTN + clip search) into one blob per block.

The byte layout depends only on shapes and specs, so it is planned first; blocks are then quantized
and written one at a time (host memory holds one blob), and the directory appears only when complete.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from .. import quant
from ..quant import QuantSpec, QuantizedWeight
from .atomic import atomic_directory, fsync_file
from .errors import SlabError
from .manifest import (
    ALIGNMENT,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    BlockRecord,
    LayerRecord,
    Manifest,
    ModelRecord,
    ResidentRecord,
    TensorRecord,
    align_up,
    block_tensor_name,
    dtype_name,
    resident_tensor_name,
)
from .signature import jsonable_config, model_signature


@dataclass
class WriteOptions:
    """Knobs of :func:`write_slab` beyond the plan itself."""

    default_spec: QuantSpec | None = None  # for block linears the plan does not name
    clip_search: bool = True  # search the clip ratio per layer (else use the spec's)
    smoothing: Mapping[str, torch.Tensor] = field(default_factory=dict)  # layer -> s, for smooth specs
    act_second_moments: Mapping[str, torch.Tensor] = field(default_factory=dict)  # layer -> E[x²] per channel
    metrics: Mapping[str, dict] = field(default_factory=dict)  # extra measured metrics per layer
    reasons: Mapping[str, list] = field(default_factory=dict)  # ladder reasons per layer
    param_dtype: torch.dtype = torch.bfloat16  # storage dtype of floating non-quantized tensors
    family: str = "generic"
    source: str = ""
    thresholds: dict | None = None
    calibration: dict | None = None
    overwrite: bool = False


@dataclass
class _Block:
    record: BlockRecord
    linears: list[tuple[LayerRecord, nn.Linear]]
    params: list[tuple[TensorRecord, torch.Tensor]]


def _stored(t: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(param_dtype) if t.is_floating_point() else t.detach()


class _Packer:
    """Hands out 256-byte-aligned offsets inside one blob."""

    def __init__(self) -> None:
        self.size = 0

    def add(self, name: str, dtype: torch.dtype, shape) -> TensorRecord:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        rec = TensorRecord(name, dtype_name(dtype), [int(d) for d in shape], self.size, nbytes)
        self.size = align_up(self.size + nbytes)
        return rec


def _resolve_spec(name: str, plan: Mapping[str, QuantSpec], opts: WriteOptions) -> QuantSpec:
    spec = plan.get(name, opts.default_spec)
    if spec is None:
        raise SlabError(f"layer {name} has no QuantSpec in the plan and no default spec was given.")
    return spec


def _plan_block(index: int, prefix: str, block: nn.Module, plan, opts: WriteOptions) -> _Block:
    packer = _Packer()
    linears, layer_records, taken = [], [], set()
    for rel, mod in block.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        name = f"{prefix}.{rel}"
        spec = _resolve_spec(name, plan, opts)
        shape = (mod.out_features, mod.in_features)
        tensors = {
            role: packer.add(f"{rel}.{role}", dtype, shp)
            for role, (dtype, shp) in quant.tensor_layout(spec, shape).items()
        }
        rec = LayerRecord(name, index, list(shape), spec, tensors, rung=spec.bits,
                          reason=list(opts.reasons.get(name, [])))
        linears.append((rec, mod))
        layer_records.append(name)
        taken.add(f"{rel}.weight")
    params = []
    for rel, t in block.state_dict(keep_vars=True).items():
        if rel in taken:
            continue
        stored = _stored(t, opts.param_dtype)
        params.append((packer.add(rel, stored.dtype, stored.shape), t))
    record = BlockRecord(index, prefix, block_tensor_name(index), align_up(max(packer.size, 1)), "",
                         layer_records, [p for p, _ in params])
    return _Block(record, linears, params)


def _quantize_layer(rec: LayerRecord, mod: nn.Linear, opts: WriteOptions) -> QuantizedWeight:
    w = mod.weight.detach().float()
    spec = rec.spec
    smooth = opts.smoothing.get(rec.name)
    if spec.smooth and smooth is None:
        raise SlabError(f"layer {rec.name} asks for smoothing but no smoothing scale was provided.")
    if opts.clip_search and not spec.is_passthrough:
        found = quant.search_clip_ratio(w, spec, opts.act_second_moments.get(rec.name), smooth)
        spec = spec.with_clip(found.clip_ratio)
    qw = quant.quantize(w, spec, smooth)
    approx = quant.dequantize(qw).float()
    rec.spec = spec
    rec.metrics = {
        "weight_rel_mse": float(quant.rel_mse(w, approx)),
        "weight_sqnr_db": quant.sqnr_db(w, approx),
        **opts.metrics.get(rec.name, {}),
    }
    return qw


def _fill(blob: torch.Tensor, rec: TensorRecord, t: torch.Tensor) -> None:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() != rec.nbytes:
        raise SlabError(f"internal layout error: {rec.name} has {data.numel()} bytes, planned {rec.nbytes}.")
    blob[rec.offset : rec.offset + rec.nbytes] = data.cpu()


def _block_blob(block: _Block, opts: WriteOptions) -> torch.Tensor:
    blob = torch.zeros(block.record.nbytes, dtype=torch.uint8)
    for rec, mod in block.linears:
        qw = _quantize_layer(rec, mod, opts)
        for role, trec in rec.tensors.items():
            _fill(blob, trec, qw.tensors[role])
    for trec, t in block.params:
        _fill(blob, trec, _stored(t, opts.param_dtype))
    return blob


def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """safetensors header for (name, dtype, shape, nbytes) in file order, padded so data starts aligned."""
    header, pos = {"__metadata__": {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}}, 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (align_up(8 + len(raw)) - 8 - len(raw))
    return struct.pack("<Q", len(raw)) + raw


def _module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise SlabError(f"the model has no block module {path!r}; check the block list.") from None


def write_slab(model: nn.Module, blocks: Sequence[str], plan: Mapping[str, QuantSpec], out: str | Path,
               options: WriteOptions | None = None) -> Manifest:
    """Quantize ``model``'s streamed ``blocks`` (module paths) by ``plan`` and write the slab directory ``out``.

    Every ``nn.Linear`` inside a block is stored under its spec (16 = bf16); every other tensor of a
    block is stored raw inside that block's blob; tensors outside the blocks are stored as resident.
    """
    opts = options or WriteOptions()
    out = Path(out)
    planned = [_plan_block(i, p, _module(model, p), plan, opts) for i, p in enumerate(blocks)]
    prefixes = tuple(f"{p}." for p in blocks)
    residents = [(n, _stored(t, opts.param_dtype)) for n, t in model.state_dict().items()
                 if not n.startswith(prefixes)]
    block_lists = list(dict.fromkeys(p.rsplit(".", 1)[0] for p in blocks))
    entries = [(b.record.tensor, "U8", [b.record.nbytes], b.record.nbytes) for b in planned]
    entries += [(resident_tensor_name(n), dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                for n, t in residents]
    resident_records = []
    with atomic_directory(out, overwrite=opts.overwrite) as tmp:
        data_path = tmp / DATA_FILE
        with open(data_path, "wb") as fh:
            fh.write(_header(entries))
            for block in planned:
                blob = _block_blob(block, opts)
                block.record.sha256 = hashlib.sha256(blob.numpy().data).hexdigest()
                fh.write(blob.numpy().data)
            for name, t in residents:
                raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data
                fh.write(raw)
                resident_records.append(ResidentRecord(name, resident_tensor_name(name), dtype_name(t.dtype),
                                                       list(t.shape), hashlib.sha256(raw).hexdigest()))
        fsync_file(data_path)
        manifest = Manifest(
            model=ModelRecord(opts.family, type(model).__name__, jsonable_config(getattr(model, "config", {})),
                              model_signature(model), opts.source, block_lists),
            blocks=[b.record for b in planned],
            layers=[rec for b in planned for rec, _ in b.linears],
            resident=resident_records,
            alignment=ALIGNMENT,
            thresholds=opts.thresholds,
            calibration=opts.calibration,
            created_by=_created_by(),
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        fsync_file(tmp / MANIFEST_FILE)
    return manifest


def _created_by() -> str:
    from .. import __version__

    return f"squareq {__version__}"
