"""The slab manifest: versioned dataclasses and their JSON form (docs/slab-format.md documents every field)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..quant import QuantSpec, SpecError
from .errors import SlabError

FORMAT_NAME = "squareq-slab"
FORMAT_VERSION = 1
ALIGNMENT = 256
MANIFEST_FILE = "manifest.json"
DATA_FILE = "slab.safetensors"

# safetensors dtype names a slab may contain; anything else is refused.
DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "BOOL": torch.bool,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise SlabError(f"tensors of dtype {dtype} cannot be stored in a slab.") from None


def itemsize(name: str) -> int:
    return torch.empty(0, dtype=DTYPES[name]).element_size()


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def block_tensor_name(index: int) -> str:
    """Name of a streamed block's blob inside slab.safetensors."""
    return f"block.{index}"


def resident_tensor_name(name: str) -> str:
    return f"resident.{name}"


@dataclass
class TensorRecord:
    """One tensor stored inside a block blob, at ``offset`` bytes from the blob's start."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class LayerRecord:
    """A linear layer of a streamed block and how its weight is stored."""

    name: str  # canonical module name, e.g. "transformer_blocks.0.attn.to_q"
    block: int
    shape: list[int]  # [out_features, in_features]
    spec: QuantSpec
    tensors: dict[str, TensorRecord]  # role (qweight/scales/zeros/inv_smooth/weight) -> record
    metrics: dict[str, float] = field(default_factory=dict)
    rung: int | None = None  # bits the layer is stored at (the writer sets it from the spec)
    reason: list[str] = field(default_factory=list)  # why the layer moved in the build that wrote the slab
    history: list[dict] = field(default_factory=list)  # per build: {"build", "rung", "moves"}
    rungs: dict[str, dict] = field(default_factory=dict)  # per measured rung: {"spec", "bytes", "metrics"}


@dataclass
class BlockRecord:
    """A streamed block: one contiguous blob, copied to the GPU in one transfer."""

    index: int
    name: str  # module path, e.g. "transformer_blocks.0"
    tensor: str  # safetensors key of the blob
    nbytes: int
    sha256: str
    layers: list[str]  # LayerRecord names, in module order
    params: list[TensorRecord]  # non-quantized parameters and buffers, names relative to the block


@dataclass
class ResidentRecord:
    """A parameter or buffer outside the streamed blocks, kept on the GPU for the whole run."""

    name: str
    tensor: str
    dtype: str
    shape: list[int]
    sha256: str


@dataclass
class ModelRecord:
    family: str
    class_name: str
    config: dict[str, Any]
    signature: str
    source: str
    block_lists: list[str]


def layer_to_dict(rec: LayerRecord) -> dict:
    return {**asdict(rec), "spec": rec.spec.to_dict()}


def layer_from_dict(d: dict) -> LayerRecord:
    """Parse a layer record; raises KeyError/TypeError/SpecError on malformed input."""
    return LayerRecord(**{**d, "spec": QuantSpec.from_dict(d["spec"]),
                          "tensors": {k: TensorRecord(**v) for k, v in d["tensors"].items()}})


def block_from_dict(d: dict) -> BlockRecord:
    return BlockRecord(**{**d, "params": [TensorRecord(**p) for p in d["params"]]})


@dataclass
class Manifest:
    model: ModelRecord
    blocks: list[BlockRecord]
    layers: list[LayerRecord]
    resident: list[ResidentRecord]
    alignment: int = ALIGNMENT
    thresholds: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    totals: dict[str, Any] | None = None
    created_by: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def layer(self, name: str) -> LayerRecord:
        for rec in self.layers:
            if rec.name == name:
                return rec
        raise KeyError(name)

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"] = [layer_to_dict(rec) for rec in self.layers]
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        """Parse a manifest; ``where`` names the file in every error message."""
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SlabError(f"{where} is not valid JSON ({exc}); the slab is damaged, recompile it.") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise SlabError(f"{where} is not a SquareQ slab manifest (no \"format\": \"{FORMAT_NAME}\").")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise SlabError(
                f"{where} has slab format version {version!r}, but this SquareQ reads version {FORMAT_VERSION}; "
                "recompile the slab with this version or install the SquareQ that wrote it."
            )
        try:
            return cls(
                model=ModelRecord(**d["model"]),
                blocks=[block_from_dict(b) for b in d["blocks"]],
                layers=[layer_from_dict(rec) for rec in d["layers"]],
                resident=[ResidentRecord(**r) for r in d["resident"]],
                alignment=d["alignment"],
                thresholds=d.get("thresholds"),
                calibration=d.get("calibration"),
                totals=d.get("totals"),
                created_by=d.get("created_by", ""),
                format=d["format"],
                format_version=version,
            )
        except (KeyError, TypeError, SpecError) as exc:
            raise SlabError(f"{where} is missing or has malformed fields ({exc}); recompile the slab.") from None
