"""Write a slab from quantized weights: :class:`SlabBuilder` takes one block at a time and assembles the directory.

A block's byte layout depends only on shapes and specs, so the manifest's size can be planned before any weight is
read (:meth:`SlabBuilder.metadata_bytes`). Each block's blob goes to a temporary file as it comes (host memory holds
one blob); :meth:`SlabBuilder.finish` writes the slab directory atomically. Choosing the quantized weights is the
caller's: the compiler (squareq/compiler/driver.py), plain rounding for tests and baselines
(squareq/compiler/plain.py), the acceptance suite's bf16 reference.
"""
from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import quant
from ..quant import QuantizedWeight
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
    resident_layout_digest,
    resident_tensor_name,
)
from .safetensors_file import safetensors_header
from .signature import jsonable_config, model_signature


@dataclass
class WriteOptions:
    """What a slab records besides its blocks: how other tensors are stored, where it came from, and whether it may
    replace an existing directory."""

    param_dtype: torch.dtype = torch.bfloat16  # storage dtype of floating non-quantized tensors
    family: str = "generic"
    source: str = ""
    encoders: dict[str, str] | None = None  # the encoders calibration used, when not the source's own
    source_identity: dict[str, str] | None = None  # local path -> identity of what the compile read (ModelRecord)
    thresholds: dict | None = None
    calibration: dict | None = None
    overwrite: bool = False


@dataclass
class BlockContent:
    """One streamed block as the writer takes it: its module (every tensor but its linears' weights is stored raw),
    its linears' quantized weights by canonical name, and what the manifest says about each layer. With
    ``measure=False`` the caller's ``metrics`` already hold every layer's weight metrics and the linears' weights are
    not read (they may be on the meta device). ``annotations``: more LayerRecord fields by layer name (the
    compiler's ``history`` and ``rungs``)."""

    index: int
    prefix: str
    module: nn.Module
    quantized: Mapping[str, QuantizedWeight]
    metrics: Mapping[str, dict] | None = None
    reasons: Mapping[str, list] | None = None
    annotations: Mapping[str, dict] | None = None
    measure: bool = True


@dataclass
class _EncodedBlock:
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


def block_linears(prefix: str, block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(canonical name, module) of every ``nn.Linear`` in a block, in module order."""
    return [(f"{prefix}.{rel}", mod) for rel, mod in block.named_modules() if isinstance(mod, nn.Linear)]


def weight_metrics(w: torch.Tensor, qw: QuantizedWeight) -> dict[str, float]:
    approx = quant.dequantize(qw).float()
    w = w.detach().float()
    return {"weight_rel_mse": float(quant.rel_mse(w, approx)), "weight_sqnr_db": quant.sqnr_db(w, approx)}


# Longest JSON text of a float, used where a metric is not known yet (manifest size planning).
PLACEHOLDER_FLOAT = -1.2345678901234567e-123


def _layout_block(c: BlockContent, param_dtype: torch.dtype) -> tuple[BlockRecord, list, _Packer]:
    """Records and tensor placement of one block. With ``measure=False`` the block may be on the meta device: weight
    metrics not given get placeholder values of maximal JSON length."""
    index, prefix, block, quantized = c.index, c.prefix, c.module, c.quantized
    metrics, reasons, annotations = c.metrics, c.reasons, c.annotations
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
        measured = (weight_metrics(mod.weight, qw) if c.measure
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


def _build_manifest(skeleton: nn.Module, blocks: list[BlockRecord], layers: list[LayerRecord],
                   resident: list[ResidentRecord], options: WriteOptions) -> Manifest:
    """The manifest object for a slab of ``skeleton`` (only its class, config and shapes are used)."""
    return Manifest(
        model=ModelRecord(options.family, type(skeleton).__name__, jsonable_config(getattr(skeleton, "config", {})),
                          model_signature(skeleton), options.source,
                          list(dict.fromkeys(b.name.rsplit(".", 1)[0] for b in blocks)), dict(options.encoders or {}),
                          dict(options.source_identity or {})),
        blocks=blocks,
        layers=layers,
        resident=resident,
        resident_layout_sha256=resident_layout_digest(resident),
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


class SlabBuilder:
    """Write the slab directory ``out`` of ``skeleton`` one block at a time::

        with SlabBuilder(out, skeleton, options) as slab:
            for content in blocks:
                slab.add_block(content)
            manifest = slab.finish(residents, max_bytes=budget)

    ``skeleton`` may live on the meta device: only its class, config and shapes are used. Blocks wait as blobs in a
    temporary folder beside ``out`` (removed on exit, whatever happens); nothing appears at ``out`` before
    :meth:`finish` has written everything.
    """

    def __init__(self, out: str | Path, skeleton: nn.Module, options: WriteOptions | None = None) -> None:
        self.out, self.skeleton, self.options = Path(out), skeleton, options or WriteOptions()
        if self.out.exists() and not self.options.overwrite:
            raise SlabError(f"{self.out} already exists; choose another output path or pass overwrite (--force).")
        self._blocks: list[_EncodedBlock] = []
        self._work: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> SlabBuilder:
        parent = self.out.parent if self.out.parent.exists() else None
        self._work = tempfile.TemporaryDirectory(prefix=f".{self.out.name}.blocks-", dir=parent)
        return self

    def __exit__(self, *exc) -> None:
        if self._work is not None:
            self._work.cleanup()
            self._work = None

    def add_block(self, content: BlockContent) -> None:
        """Lay out one block and write its blob to the temporary folder (temporary name, then rename)."""
        if self._work is None:
            raise RuntimeError("SlabBuilder.add_block is called inside `with SlabBuilder(...) as slab:`.")
        record, layers, packer = _layout_block(content, self.options.param_dtype)
        blob = packer.blob()
        record.sha256 = hashlib.sha256(blob.numpy().data).hexdigest()
        path = Path(self._work.name) / f"block.{content.index}.bin"
        atomic_write_bytes(path, blob.numpy().data)
        self._blocks.append(_EncodedBlock(record, layers, path))

    def finish(self, residents: Mapping[str, torch.Tensor], max_bytes: int | None = None) -> Manifest:
        """Write the slab directory from the blocks added and the resident tensors, atomically. The header and
        manifest are built first, so with ``max_bytes`` a slab that would be larger is refused (:class:`SlabError`
        stating the exact size) before anything is written."""
        options, blocks = self.options, self._blocks
        stored = {n: stored_tensor(t, options.param_dtype) for n, t in residents.items()}
        raws = {n: t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data for n, t in stored.items()}
        entries = _entries([b.record for b in blocks], stored)
        header = _header(entries)
        resident = [ResidentRecord(n, resident_tensor_name(n), dtype_name(t.dtype), list(t.shape),
                                   hashlib.sha256(raws[n]).hexdigest()) for n, t in stored.items()]
        manifest = _build_manifest(self.skeleton, [b.record for b in blocks], [rec for b in blocks for rec in b.layers],
                                   resident, options)
        text = manifest.to_json()
        total = len(header) + sum(e[3] for e in entries) + len(text.encode())
        if max_bytes is not None and total > max_bytes:
            raise SlabError(f"the slab for {self.out} would be {total:,} bytes with its header and manifest, over the "
                            f"{max_bytes:,}-byte budget; raise --budget to at least {total:,}. Nothing was written.")
        with atomic_directory(self.out, overwrite=options.overwrite) as tmp:
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

    @staticmethod
    def metadata_bytes(skeleton: nn.Module, blocks: Sequence[BlockContent], residents: Mapping[str, torch.Tensor],
                       options: WriteOptions) -> int:
        """Bytes of everything but the blobs (header, resident tensors, manifest) of a slab of ``blocks``, planned
        without reading a weight: ``blocks`` may hold placeholder weights and meta-device modules (``measure=False``),
        whose unknown numbers count at their longest JSON form, so this is an upper bound."""
        records, layers = [], []
        for content in blocks:
            rec, block_layers, _ = _layout_block(content, options.param_dtype)
            records.append(rec)
            layers += block_layers
        stored = {n: stored_tensor(t, options.param_dtype) for n, t in residents.items()}
        resident = [ResidentRecord(n, resident_tensor_name(n), dtype_name(t.dtype), list(t.shape), "0" * 64)
                    for n, t in stored.items()]
        manifest = _build_manifest(skeleton, records, layers, resident, options)
        return (len(_header(_entries(records, stored))) + len(manifest.to_json().encode())
                + sum(t.numel() * t.element_size() for t in stored.values()))


def _created_by() -> str:
    from .. import __version__

    return f"squareq {__version__}"
