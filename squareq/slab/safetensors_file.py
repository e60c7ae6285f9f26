"""SquareQ's one safetensors writer: files written byte for byte the same from the same tensors and metadata.

Kept beside the library because safetensors 0.8's ``save`` writes ``__metadata__`` in a different order from call
to call (measured: 13 distinct byte strings in 20 calls with the same tensors and metadata), so its files would not
be byte-identical. Here metadata keys are sorted and tensors laid out by name. Every safetensors file SquareQ writes
(LoRA files, checkpoints, cache entries, the compiler's block state, the slab's header) comes from here; reading
stays with the library (``safe_open``, ``load_file``).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping

import torch

# safetensors' dtype names for the dtypes SquareQ writes outside slabs (LoRA factors, optimizer state, RNG states)
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def safetensors_header(entries: Iterable[tuple[str, str, list[int], int]], metadata: Mapping[str, str] | None,
                       alignment: int = 8) -> bytes:
    """The length prefix and JSON header for tensors (name, dtype name, shape, nbytes) stored back to back in the
    given order, padded with spaces so the data starts at a multiple of ``alignment``."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % alignment)
    return struct.pack("<Q", len(raw)) + raw


def _raw(t: torch.Tensor):
    """The tensor's bytes as a buffer (a view of a CPU tensor's memory, not a copy)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> list:
    """A complete safetensors file as buffers to write one after another: its header, then each tensor's bytes.
    Equal tensors and metadata give equal bytes, whatever the dict order."""
    names = sorted(tensors)
    for name in names:
        if tensors[name].dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name} has dtype {tensors[name].dtype}, which safetensors cannot store.")
    data = [_raw(tensors[name]) for name in names]
    entries = [(name, DTYPE_NAMES[tensors[name].dtype], list(tensors[name].shape), raw.nbytes)
               for name, raw in zip(names, data)]
    return [safetensors_header(entries, metadata), *data]


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """:func:`safetensors_parts` joined: the whole file in memory."""
    return b"".join(safetensors_parts(tensors, metadata))
