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
    """Recompute every block's layout digest: an edit made consistently, so the checks behind it must catch it."""
    from squareq.slab.manifest import block_from_dict, layer_from_dict, layout_digest

    layers = {d["name"]: layer_from_dict(d) for d in m["layers"]}
    for b in m["blocks"]:
        record = block_from_dict(b)
        b["layout_sha256"] = layout_digest(record, [layers[n] for n in record.layers])


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
