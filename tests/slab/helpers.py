"""Craft damaged slabs for refusal tests."""
import json
import shutil
import struct
from pathlib import Path


def copy_slab(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * ((-(8 + len(text))) % 256)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def reseal_layouts(m: dict) -> None:
    """Recompute every layout digest (blocks' and residents'): an edit made consistently, so the checks behind it
    must catch it."""
    from squareq.slab.manifest import (
        ResidentRecord,
        block_from_dict,
        layer_from_dict,
        layout_digest,
        resident_layout_digest,
    )

    layers = {d["name"]: layer_from_dict(d) for d in m["layers"]}
    for b in m["blocks"]:
        record = block_from_dict(b)
        b["layout_sha256"] = layout_digest(record, [layers[n] for n in record.layers])
    m["resident_layout_sha256"] = resident_layout_digest([ResidentRecord(**r) for r in m["resident"]])


def reseal_signature(m: dict) -> None:
    """Recompute the model signature from the manifest's own names and shapes, as a consistent edit would."""
    from squareq.slab.signature import signature_from_shapes

    shapes = [(f"{d['name']}.weight", d["shape"]) for d in m["layers"]]
    shapes += [(f"{b['name']}.{p['name']}", p["shape"]) for b in m["blocks"] for p in b["params"]]
    shapes += [(r["name"], r["shape"]) for r in m["resident"]]
    m["model"]["signature"] = signature_from_shapes(m["model"]["class_name"], m["model"]["config"], shapes)


def edit_manifest(slab: Path, edit, reseal: bool = False) -> None:
    p = slab / "manifest.json"
    m = json.loads(p.read_text())
    edit(m)
    if reseal:
        reseal_layouts(m)
    p.write_text(json.dumps(m))


def flip_byte(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(raw))
