"""Write a slab: quantize each streamed block's linear layers (RTN + clip search) into one blob per block.

The byte layout depends only on shapes and specs, so it is planned first; blocks are then quantized
and written one at a time (host memory holds one blob), and the directory appears only when complete.
"""
from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..quant import QuantizedWeight, QuantSpec
from .atomic import atomic_directory, atomic_write_bytes, fsync_file
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
    layout_digest,
    resident_tensor_name,
)
from .safetensors_file import safetensors_header
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
class EncodedBlock:
    """A block turned into its blob: the records for the manifest and the file holding the bytes."""

    record: BlockRecord
    layers: list[LayerRecord]
    blob_path: Path


def stored_tensor(t: torch.Tensor, param_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A non-quantized tensor as a slab stores it: floating ones in ``param_dtype``, others unchanged."""
    return t.detach().to(param_dtype) if t.is_floating_point() else t.detach()


class _Packer:
    """Places tensors at 256-byte-aligned offsets inside one blob."""

    def __init__(self) -> None:
        self.size = 0
        self.items: list[tuple[TensorRecord, torch.Tensor]] = []

    def add(self, name: str, t: torch.Tensor) -> TensorRecord:
        nbytes = t.numel() * t.element_size()
        rec = TensorRecord(name, dtype_name(t.dtype), [int(d) for d in t.shape], self.size, nbytes)
        self.items.append((rec, t))
        self.size = align_up(self.size + nbytes)
        return rec

    def blob(self) -> torch.Tensor:
        blob = torch.zeros(align_up(max(self.size, 1)), dtype=torch.uint8)
        for rec, t in self.items:
            blob[rec.offset : rec.offset + rec.nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        return blob


def _resolve_spec(name: str, plan: Mapping[str, QuantSpec], opts: WriteOptions) -> QuantSpec:
    spec = plan.get(name, opts.default_spec)
    if spec is None:
        raise SlabError(f"layer {name} has no QuantSpec in the plan and no default spec was given.")
    return spec


def block_linears(prefix: str, block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(canonical name, module) of every ``nn.Linear`` in a block, in module order."""
    return [(f"{prefix}.{rel}", mod) for rel, mod in block.named_modules() if isinstance(mod, nn.Linear)]


def weight_metrics(w: torch.Tensor, qw: QuantizedWeight) -> dict[str, float]:
    approx = quant.dequantize(qw).float()
    w = w.detach().float()
    return {"weight_rel_mse": float(quant.rel_mse(w, approx)), "weight_sqnr_db": quant.sqnr_db(w, approx)}


# Longest JSON text of a float, used where a metric is not known yet (manifest size planning).
PLACEHOLDER_FLOAT = -1.2345678901234567e-123


def layout_block(index: int, prefix: str, block: nn.Module, quantized: Mapping[str, QuantizedWeight],
                 param_dtype: torch.dtype = torch.bfloat16, metrics: Mapping[str, dict] | None = None,
                 reasons: Mapping[str, list] | None = None, measure: bool = True,
                 annotations: Mapping[str, dict] | None = None) -> tuple[BlockRecord, list, _Packer]:
    """Records and tensor placement of one block (its linears from ``quantized``, every other tensor raw).
    ``annotations``: more LayerRecord fields by layer name (the compiler's ``history`` and ``rungs``).

    With ``measure=False`` the block may be on the meta device: weight metrics get placeholder values
    of maximal JSON length, so the manifest's size can be planned before any weight is read.
    """
    packer, layers, taken = _Packer(), [], set()
    for name, mod in block_linears(prefix, block):
        qw = quantized.get(name)
        if qw is None:
            raise SlabError(f"layer {name} was not quantized; every linear of block {prefix} needs a QuantizedWeight.")
        expected = quant.tensor_layout(qw.spec, (mod.out_features, mod.in_features))
        stored = {r: (t.dtype, tuple(t.shape)) for r, t in qw.tensors.items()}
        if stored != expected or qw.shape != (mod.out_features, mod.in_features):
            raise SlabError(f"layer {name}: stored tensors do not match {qw.spec.label()} for shape {list(qw.shape)}.")
        rel = name[len(prefix) + 1 :]
        tensors = {role: packer.add(f"{rel}.{role}", t) for role, t in qw.tensors.items()}
        measured = (weight_metrics(mod.weight, qw) if measure
                    else {"weight_rel_mse": PLACEHOLDER_FLOAT, "weight_sqnr_db": PLACEHOLDER_FLOAT})
        layers.append(LayerRecord(name, index, [mod.out_features, mod.in_features], qw.spec, tensors,
                                  metrics={**measured, **(metrics or {}).get(name, {})}, rung=qw.spec.short_label,
                                  reason=list((reasons or {}).get(name, [])), **(annotations or {}).get(name, {})))
        taken.add(f"{rel}.weight")
    params = [packer.add(rel, stored_tensor(t, param_dtype))
              for rel, t in block.state_dict().items() if rel not in taken]
    record = BlockRecord(index, prefix, block_tensor_name(index), align_up(max(packer.size, 1)), "0" * 64,
                         [rec.name for rec in layers], params)
    record.layout_sha256 = layout_digest(record, layers)
    return record, layers, packer


def encode_block(index: int, prefix: str, block: nn.Module, quantized: Mapping[str, QuantizedWeight],
                 blob_path: Path, param_dtype: torch.dtype = torch.bfloat16,
                 metrics: Mapping[str, dict] | None = None, reasons: Mapping[str, list] | None = None,
                 measure: bool = True, annotations: Mapping[str, dict] | None = None) -> EncodedBlock:
    """Lay out one block and write its blob to ``blob_path`` (temporary name, then rename). ``measure=False``: the
    caller's ``metrics`` already hold every layer's weight metrics, and the block's linear weights are not read
    (they may be on the meta device)."""
    record, layers, packer = layout_block(index, prefix, block, quantized, param_dtype, metrics, reasons, measure,
                                          annotations)
    blob = packer.blob()
    record.sha256 = hashlib.sha256(blob.numpy().data).hexdigest()
    atomic_write_bytes(Path(blob_path), blob.numpy().data)
    return EncodedBlock(record, layers, Path(blob_path))


def rtn_quantize(name: str, w: torch.Tensor, spec: QuantSpec, opts: WriteOptions) -> QuantizedWeight:
    """Round-to-nearest with the writer's optional clip search (the compiler has its own searches)."""
    w = w.detach().float()
    smooth = opts.smoothing.get(name)
    if spec.smooth and smooth is None:
        raise SlabError(f"layer {name} asks for smoothing but no smoothing scale was provided.")
    if opts.clip_search and not spec.is_passthrough:
        found = quant.search_clip_ratio(w, spec, opts.act_second_moments.get(name), smooth)
        spec = spec.with_clip(found.clip_ratio)
    return quant.quantize(w, spec, smooth)


def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """safetensors header for (name, dtype, shape, nbytes) in file order, padded so data starts aligned."""
    return safetensors_header(entries, {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}, ALIGNMENT)


def _copy_file_into(fh, path: Path, nbytes: int, chunk: int = 64 << 20) -> None:
    with open(path, "rb") as src:
        copied = 0
        while block := src.read(chunk):
            fh.write(block)
            copied += len(block)
    if copied != nbytes:
        raise SlabError(f"{path} holds {copied} bytes but its block record says {nbytes}; recompute that block.")


def build_manifest(skeleton: nn.Module, blocks: list[BlockRecord], layers: list[LayerRecord],
                   resident: list[ResidentRecord], options: WriteOptions) -> Manifest:
    """The manifest object for a slab of ``skeleton`` (only its class, config and shapes are used)."""
    return Manifest(
        model=ModelRecord(options.family, type(skeleton).__name__, jsonable_config(getattr(skeleton, "config", {})),
                          model_signature(skeleton), options.source,
                          list(dict.fromkeys(b.name.rsplit(".", 1)[0] for b in blocks))),
        blocks=blocks,
        layers=layers,
        resident=resident,
        alignment=ALIGNMENT,
        thresholds=options.thresholds,
        calibration=options.calibration,
        totals=_totals(blocks, layers, resident),
        created_by=_created_by(),
    )


def _totals(blocks: list[BlockRecord], layers: list[LayerRecord], resident: list[ResidentRecord]) -> dict:
    weights = sum(rec.shape[0] * rec.shape[1] for rec in layers)
    layer_bytes = sum(t.nbytes for rec in layers for t in rec.tensors.values())
    formats: dict[str, int] = {}
    for rec in layers:
        formats[rec.spec.label()] = formats.get(rec.spec.label(), 0) + 1
    return {
        "blocks": len(blocks),
        "layers": len(layers),
        "streamed_bytes": sum(b.nbytes for b in blocks),
        "largest_block_bytes": max((b.nbytes for b in blocks), default=0),
        "resident_tensors": len(resident),
        "layer_weights": weights,
        "layer_bytes": layer_bytes,
        "bits_per_layer_weight": round(8 * layer_bytes / weights, 4) if weights else 0.0,
        "formats": dict(sorted(formats.items())),
    }


def _entries(blocks: list[BlockRecord], stored: Mapping[str, torch.Tensor]) -> list[tuple[str, str, list[int], int]]:
    """(name, dtype, shape, nbytes) of every tensor in the data file, in file order."""
    entries = [(b.tensor, "U8", [b.nbytes], b.nbytes) for b in blocks]
    entries += [(resident_tensor_name(n), dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
                for n, t in stored.items()]
    return entries


def header_bytes(blocks: list[BlockRecord], residents: Mapping[str, torch.Tensor], param_dtype=torch.bfloat16) -> int:
    """Length of the safetensors header for these blobs and resident tensors."""
    return len(_header(_entries(blocks, {n: stored_tensor(t, param_dtype) for n, t in residents.items()})))


def assemble_slab(out: str | Path, skeleton: nn.Module, blocks: Sequence[EncodedBlock],
                  residents: Mapping[str, torch.Tensor], options: WriteOptions,
                  max_bytes: int | None = None) -> Manifest:
    """Write the slab directory from encoded blocks (blobs on disk) and resident tensors, atomically.

    ``skeleton`` may live on the meta device: only its class, config and shapes are used. The header
    and manifest are built first, so with ``max_bytes`` a slab that would be larger is refused
    (:class:`SlabError` stating the exact size) before anything is written.
    """
    stored = {n: stored_tensor(t, options.param_dtype) for n, t in residents.items()}
    raws = {n: t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data for n, t in stored.items()}
    entries = _entries([b.record for b in blocks], stored)
    header = _header(entries)
    manifest = build_manifest(skeleton, [b.record for b in blocks], [rec for b in blocks for rec in b.layers],
                              [ResidentRecord(n, resident_tensor_name(n), dtype_name(t.dtype), list(t.shape),
                                              hashlib.sha256(raws[n]).hexdigest()) for n, t in stored.items()], options)
    text = manifest.to_json()
    total = len(header) + sum(e[3] for e in entries) + len(text.encode())
    if max_bytes is not None and total > max_bytes:
        raise SlabError(f"the slab for {out} would be {total:,} bytes with its header and manifest, over the "
                        f"{max_bytes:,}-byte budget; raise --budget to at least {total:,}. Nothing was written.")
    with atomic_directory(Path(out), overwrite=options.overwrite) as tmp:
        data_path = tmp / DATA_FILE
        with open(data_path, "wb") as fh:
            fh.write(header)
            for b in blocks:
                _copy_file_into(fh, b.blob_path, b.record.nbytes)
            for raw in raws.values():
                fh.write(raw)
        fsync_file(data_path)
        (tmp / MANIFEST_FILE).write_text(text)
        fsync_file(tmp / MANIFEST_FILE)
    return manifest


def _module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise SlabError(f"the model has no block module {path!r}; check the block list.") from None


def write_slab(model: nn.Module, blocks: Sequence[str], plan: Mapping[str, QuantSpec], out: str | Path,
               options: WriteOptions | None = None) -> Manifest:
    """Quantize ``model``'s streamed ``blocks`` (module paths) by ``plan`` and write the slab directory ``out``.

    Every ``nn.Linear`` inside a block is stored under its spec (16 = bf16), round to nearest with
    clip search; every other tensor of a block is stored raw inside that block's blob; tensors
    outside the blocks are stored as resident.
    """
    opts = options or WriteOptions()
    out = Path(out)
    if out.exists() and not opts.overwrite:
        raise SlabError(f"{out} already exists; choose another output path or pass overwrite (--force).")
    modules = [_module(model, p) for p in blocks]
    specs = {name: _resolve_spec(name, plan, opts) for p, m in zip(blocks, modules) for name, _ in block_linears(p, m)}
    prefixes = tuple(f"{p}." for p in blocks)
    residents = {n: t for n, t in model.state_dict().items() if not n.startswith(prefixes)}
    parent = out.parent if out.parent.exists() else None
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.blocks-", dir=parent) as work:
        encoded = []
        for i, (prefix, block) in enumerate(zip(blocks, modules)):
            quantized = {name: rtn_quantize(name, mod.weight, specs[name], opts)
                         for name, mod in block_linears(prefix, block)}
            encoded.append(encode_block(i, prefix, block, quantized, Path(work) / f"block.{i}.bin", opts.param_dtype,
                                        opts.metrics, opts.reasons))
        return assemble_slab(out, model, encoded, residents, opts)


def _created_by() -> str:
    from .. import __version__

    return f"squareq {__version__}"
