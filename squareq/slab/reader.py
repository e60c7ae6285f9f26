"""Open a slab safely: memory-map it, check every offset against the file before use, verify hashes.

A slab may come from a stranger. Nothing is unpickled; the data file must be plain safetensors whose
tensors are exactly the ones the manifest names, and each refusal is one sentence naming the file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import struct
from pathlib import Path

import torch

from .. import quant
from ..quant import QuantizedWeight
from .errors import SlabError
from .file_head import PICKLE, ZIP, pickled_format
from .manifest import (
    DATA_FILE,
    DTYPES,
    MANIFEST_FILE,
    LayerRecord,
    Manifest,
    TensorRecord,
    dtype_name,
    itemsize,
    layout_digest,
    resident_layout_digest,
    resident_tensor_name,
)
from .signature import signature_from_shapes

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 20
VERIFY_MODES = ("eager", "lazy", "off")


def _not_safetensors(path: Path, head: bytes) -> SlabError:
    kind = {PICKLE: "a Python pickle", ZIP: "a zip archive (torch.save output)"}.get(
        pickled_format(head), "not a safetensors file")
    return SlabError(
        f"{path} is {kind}, not a safetensors file; SquareQ never unpickles files, so recompile the slab "
        "with `squareq compile`."
    )


def _parse_header(path: Path, size: int, mm) -> tuple[dict, int]:
    if size < 8:
        raise _not_safetensors(path, bytes(mm[:size]))
    (hlen,) = struct.unpack("<Q", mm[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise _not_safetensors(path, bytes(mm[:8]))
    try:
        header = json.loads(bytes(mm[8 : 8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise SlabError(f"{path} has a damaged safetensors header; recompile the slab.") from None
    if not isinstance(header, dict):
        raise SlabError(f"{path} has a damaged safetensors header; recompile the slab.")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + hlen, size - 8 - hlen
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = dtype in DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise SlabError(f"{path}: tensor {name!r} has a malformed header entry; recompile the slab.")
        if end > data_len:
            raise SlabError(
                f"{path} is truncated or damaged: tensor {name!r} ends at data byte {end} but the file holds "
                f"only {data_len}; copy the slab again or recompile it."
            )
        if end - begin != math.prod(shape) * itemsize(dtype):
            raise SlabError(f"{path}: tensor {name!r} has {end - begin} bytes, which does not match its shape.")
    return header, data_start


def _check_tensor_record(path: Path, where: str, rec: TensorRecord, blob_bytes: int, alignment: int) -> None:
    ok = rec.dtype in DTYPES and rec.offset >= 0 and all(d >= 0 for d in rec.shape)
    ok = ok and rec.offset % alignment == 0 and rec.nbytes == math.prod(rec.shape) * itemsize(rec.dtype)
    if not ok:
        raise SlabError(f"{path}: {where} tensor {rec.name!r} has an inconsistent offset, size or dtype.")
    if rec.offset + rec.nbytes > blob_bytes:
        raise SlabError(
            f"{path}: {where} tensor {rec.name!r} ends at byte {rec.offset + rec.nbytes}, past its block's "
            f"{blob_bytes} bytes; the manifest is damaged, recompile the slab."
        )


def _manifest_shapes(m: Manifest):
    for layer in m.layers:
        yield f"{layer.name}.weight", layer.shape
    for block in m.blocks:
        for p in block.params:
            yield f"{block.name}.{p.name}", p.shape
    for r in m.resident:
        yield r.name, r.shape


class Slab:
    """A read-only, memory-mapped slab. Use :func:`open_slab` to get one."""

    def __init__(self, path: Path, manifest: Manifest, mm: mmap.mmap, header: dict, data_start: int,
                 verify: str) -> None:
        self.path = path
        self.manifest = manifest
        self._mm = mm
        self._header = header
        self._data_start = data_start
        self._verify = verify
        self._verified: set[int] = set()
        self._layers = {rec.name: rec for rec in manifest.layers}

    @property
    def data_path(self) -> Path:
        return self.path / DATA_FILE

    def _raw(self, key: str) -> torch.Tensor:
        begin, end = self._header[key]["data_offsets"]
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)

    def verify_block(self, index: int) -> None:
        """Hash block ``index`` and check its scales are finite; raise :class:`SlabError` if not."""
        rec = self.manifest.blocks[index]
        raw = self._raw(rec.tensor)
        if hashlib.sha256(raw.numpy().data).hexdigest() != rec.sha256:
            raise SlabError(
                f"{self.data_path}: block {index} ({rec.name}) fails its sha256 check, so the file is corrupted; "
                "copy the slab again or recompile it."
            )
        for name in rec.layers:
            layer = self._layers[name]
            for role in ("scales", "inv_smooth"):
                if role in layer.tensors and not torch.isfinite(self._typed(raw, layer.tensors[role]).float()).all():
                    raise SlabError(
                        f"{self.data_path}: layer {name} has NaN or Inf {role}; the slab is corrupted, recompile it."
                    )
        self._verified.add(index)

    def verify_resident(self) -> None:
        for r in self.manifest.resident:
            if hashlib.sha256(self._raw(r.tensor).numpy().data).hexdigest() != r.sha256:
                raise SlabError(
                    f"{self.data_path}: resident tensor {r.name} fails its sha256 check, so the file is corrupted; "
                    "copy the slab again or recompile it."
                )

    def verify(self) -> None:
        """Check every block and resident tensor against its recorded sha256."""
        for i in range(len(self.manifest.blocks)):
            self.verify_block(i)
        self.verify_resident()

    def blob_file_range(self, index: int) -> tuple[int, int]:
        """(byte offset in slab.safetensors, length) of block ``index``'s blob, for direct file reads."""
        begin, end = self._header[self.manifest.blocks[index].tensor]["data_offsets"]
        return self._data_start + begin, end - begin

    def block_bytes(self, index: int) -> torch.Tensor:
        """The raw blob of block ``index`` (uint8, zero-copy view of the file), verified as configured."""
        if not 0 <= index < len(self.manifest.blocks):
            raise IndexError(f"{self.path} has {len(self.manifest.blocks)} blocks; there is no block {index}.")
        if self._verify == "lazy" and index not in self._verified:
            self.verify_block(index)
        return self._raw(self.manifest.blocks[index].tensor)

    @staticmethod
    def _typed(blob: torch.Tensor, rec: TensorRecord) -> torch.Tensor:
        return blob[rec.offset : rec.offset + rec.nbytes].view(DTYPES[rec.dtype]).reshape(rec.shape)

    def layer(self, name: str) -> LayerRecord:
        try:
            return self._layers[name]
        except KeyError:
            raise KeyError(f"{self.path} has no layer {name!r}.") from None

    def quantized_weight(self, name: str, blob: torch.Tensor | None = None) -> QuantizedWeight:
        """A layer's stored tensors as views into its block blob (or into ``blob``, e.g. a GPU slot)."""
        rec = self.layer(name)
        blob = self.block_bytes(rec.block) if blob is None else blob
        tensors = {role: self._typed(blob, t) for role, t in rec.tensors.items()}
        return QuantizedWeight(rec.spec, (rec.shape[0], rec.shape[1]), tensors)

    def block_params(self, index: int, blob: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Non-quantized tensors of block ``index`` by their name relative to the block."""
        blob = self.block_bytes(index) if blob is None else blob
        return {p.name: self._typed(blob, p) for p in self.manifest.blocks[index].params}

    def resident_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for r in self.manifest.resident:
            out[r.name] = self._raw(r.tensor).view(DTYPES[r.dtype]).reshape(r.shape)
        return out

    def dequantized_weight(self, name: str) -> torch.Tensor:
        """The layer's effective bf16 weight through the exact torch reference."""
        return quant.dequantize(self.quantized_weight(name))

    def dequantized_state_dict(self) -> dict[str, torch.Tensor]:
        """A full state dict for the model class, with every layer's effective bf16 weight (reference math)."""
        out = dict(self.resident_tensors())
        for b in self.manifest.blocks:
            out.update({f"{b.name}.{k}": v for k, v in self.block_params(b.index).items()})
            out.update({f"{name}.weight": self.dequantized_weight(name) for name in b.layers})
        return out

    def file_bytes(self) -> int:
        return self.data_path.stat().st_size + (self.path / MANIFEST_FILE).stat().st_size

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # tensors still view the map; it is released when they are

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_no_overlap(path: Path, block, layers: list[LayerRecord]) -> None:
    """No two tensors of a block share a byte: otherwise one layer would read another's codes as its own."""
    spans = sorted([(t.offset, t.offset + t.nbytes, f"{layer.name}.{role}") for layer in layers
                    for role, t in layer.tensors.items()] + [(p.offset, p.offset + p.nbytes, p.name)
                                                             for p in block.params])
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise SlabError(f"{path}: in block {block.index}, {second} overlaps {first}; the manifest is damaged, "
                            "recompile the slab.")


def _check_layout(path: Path, m: Manifest, header: dict, data_start: int) -> None:
    expected = {b.tensor for b in m.blocks} | {r.tensor for r in m.resident}
    missing, extra = sorted(expected - set(header)), sorted(set(header) - expected)
    if missing:
        raise SlabError(f"{path} is missing tensors the manifest names ({', '.join(map(repr, missing[:5]))}); "
                        "recompile the slab.")
    if extra:
        raise SlabError(f"{path} holds tensors the manifest does not name ({', '.join(map(repr, extra[:5]))}); it was "
                        "altered after writing, so recompile the slab.")
    if [b.index for b in m.blocks] != list(range(len(m.blocks))):
        raise SlabError(f"{path}: the manifest's blocks are not numbered 0..{len(m.blocks) - 1}; recompile the slab.")
    by_name = {rec.name: rec for rec in m.layers}
    for b in m.blocks:
        h = header[b.tensor]
        if h["dtype"] != "U8" or h["shape"] != [b.nbytes]:
            raise SlabError(f"{path}: block {b.index} is {h['dtype']}{h['shape']}, not U8[{b.nbytes}] as the manifest "
                            "says.")
        if (data_start + h["data_offsets"][0]) % m.alignment:
            raise SlabError(f"{path}: block {b.index} does not start at a {m.alignment}-byte boundary.")
        for p in b.params:
            _check_tensor_record(path, f"block {b.index}", p, b.nbytes, m.alignment)
        if b.layout_sha256 != layout_digest(b, [by_name[n] for n in b.layers if n in by_name]):
            raise SlabError(f"{path}: block {b.index} ({b.name}) fails its layout check (the manifest's offsets, "
                            "shapes or formats were altered or damaged); recompile the slab.")
        for name in b.layers:
            layer = by_name.get(name)
            if layer is None or layer.block != b.index:
                raise SlabError(f"{path}: block {b.index} lists layer {name!r} that the manifest does not place there.")
            if len(layer.shape) != 2 or min(layer.shape) < 1:
                raise SlabError(f"{path}: layer {name} has shape {layer.shape}, not [out_features, in_features]; the "
                                "manifest is damaged, recompile the slab.")
            if layer.spec.rotate and layer.shape[1] % layer.spec.group_size:
                raise SlabError(f"{path}: layer {name} is rotated in groups of {layer.spec.group_size} input channels, "
                                f"which its {layer.shape[1]} are not; the manifest is damaged, recompile the slab.")
            layout = quant.tensor_layout(layer.spec, tuple(layer.shape))
            if set(layout) != set(layer.tensors):
                raise SlabError(f"{path}: layer {name} stores {sorted(layer.tensors)}, but its spec needs "
                                f"{sorted(layout)}.")
            for role, rec in layer.tensors.items():
                _check_tensor_record(path, f"layer {name}", rec, b.nbytes, m.alignment)
                dtype, shape = layout[role]
                if rec.dtype != dtype_name(dtype) or list(rec.shape) != list(shape):
                    raise SlabError(f"{path}: layer {name} {role} is {rec.dtype}{rec.shape}, its spec needs "
                                    f"{dtype_name(dtype)}{list(shape)}.")
        _check_no_overlap(path, b, [by_name[n] for n in b.layers])
    placed = {name for b in m.blocks for name in b.layers}
    if placed != set(by_name):
        raise SlabError(f"{path}: some manifest layers belong to no block; recompile the slab.")
    _check_resident(path, m, header)


def _check_resident(path: Path, m: Manifest, header: dict) -> None:
    """Resident records match their digest (when the slab has one), their data-file keys and the header: each
    tensor's bytes are hashed under its record, so a record pointing at another tensor would pass the sha256."""
    manifest = path.with_name(MANIFEST_FILE)
    if m.resident_layout_sha256 and m.resident_layout_sha256 != resident_layout_digest(m.resident):
        raise SlabError(f"{manifest}: the resident tensors' records fail their layout check (a name, dtype, shape or "
                        "key was altered or damaged, so a tensor would load in another's place); restore the slab's "
                        "original manifest.json or recompile the slab.")
    for r in m.resident:
        if r.tensor != resident_tensor_name(r.name):  # the writer's only naming: holds slabs without a digest too
            raise SlabError(f"{manifest}: resident tensor {r.name} is stored under {r.tensor!r}, not "
                            f"{resident_tensor_name(r.name)!r}, so the manifest was altered; restore the slab's "
                            "original manifest.json or recompile the slab.")
        h = header[r.tensor]
        if h["dtype"] != r.dtype or h["shape"] != r.shape:
            raise SlabError(f"{path}: resident tensor {r.name} does not match the manifest's dtype or shape; copy the "
                            "slab again or recompile it.")


def _say_if_linked_outside(folder: Path, file: Path) -> None:
    """A slab file that is a link to somewhere else is used (its data is still verified), but never silently: the
    folder one inspects is then not what is read."""
    target = file.resolve()
    if target.parent != folder.resolve():
        log.warning("%s is a link to %s, outside the slab folder; that file is what is read (its blocks are still "
                    "checked against their sha256).", file, target)


def verify_mode(verify: str | bool) -> str:
    """``verify`` as one of :data:`VERIFY_MODES` (True is "eager", False "off"), or ValueError in a sentence."""
    mode = {True: "eager", False: "off"}.get(verify, verify)
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} must be one of {VERIFY_MODES} or a bool.")
    return mode


def open_slab(path: str | Path, verify: str | bool = "lazy", expected_signature: str | None = None) -> Slab:
    """Open the slab directory ``path``.

    verify: "eager" (or True) hashes every block now; "lazy" hashes each block on first access;
    "off" (or False) never hashes. ``expected_signature`` is the signature of the model skeleton the
    caller will attach the slab to; a mismatch is refused.
    """
    mode = verify_mode(verify)
    path = Path(path)
    mpath, dpath = path / MANIFEST_FILE, path / DATA_FILE
    if not path.is_dir():
        raise SlabError(f"{path} is not a slab directory (expected {MANIFEST_FILE} and {DATA_FILE} inside it).")
    for p in (mpath, dpath):
        if not p.is_file():
            raise SlabError(f"{path} has no {p.name}; it is not a complete slab, so recompile it.")
    for p in (mpath, dpath):
        _say_if_linked_outside(path, p)
    manifest = Manifest.from_json(mpath.read_text(errors="replace"), str(mpath))
    recomputed = signature_from_shapes(manifest.model.class_name, manifest.model.config, _manifest_shapes(manifest))
    if recomputed != manifest.model.signature:
        raise SlabError(f"{mpath}: the model signature does not match the manifest's own contents; the manifest "
                        "was altered, so recompile the slab.")
    if expected_signature is not None and expected_signature != manifest.model.signature:
        raise SlabError(f"{path} was compiled for a different model ({manifest.model.class_name}, signature "
                        f"{manifest.model.signature[:12]}) than the one given (signature {expected_signature[:12]}); "
                        "compile a slab from this model.")
    size = os.path.getsize(dpath)
    with open(dpath, "rb") as fh:
        if size == 0:
            raise _not_safetensors(dpath, b"")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        header, data_start = _parse_header(dpath, size, mm)
        _check_layout(dpath, manifest, header, data_start)
        slab = Slab(path, manifest, mm, header, data_start, mode)
        if mode == "eager":
            slab.verify()
    except BaseException:
        mm.close()
        raise
    return slab
