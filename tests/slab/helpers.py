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


def edit_manifest(slab: Path, edit) -> None:
    p = slab / "manifest.json"
    m = json.loads(p.read_text())
    edit(m)
    p.write_text(json.dumps(m))


def flip_byte(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(raw))
