"""The slab manifest: versioned dataclasses and their JSON form (docs/slab-format.md documents every field)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..quant import QuantSpec, SpecError
from .errors import SlabError, brief

FORMAT_NAME = "squareq-slab"
FORMAT_VERSION = 2  # 2: blocks carry layout_sha256
ALIGNMENT = 256
MAX_ALIGNMENT = 1 << 20
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
    rung: str | None = None  # the format it is stored in, by name: W4, NF4, bf16... (the writer sets it from the spec)
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
    layout_sha256: str = ""  # layout_digest: where each tensor of the blob is and how it is stored


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
    # where the VAE and text encoders came from when not the source's own pipeline: {"where": pipeline folder or Hub
    # ID, "clip_l"/"clip_g"/"t5"/"vae": single files}; empty otherwise (squareq.sources.encoder_source)
    encoders: dict[str, str] = field(default_factory=dict)
    # each local folder or file named above (source, encoders) -> its identity when compiled (sources/local_files.py),
    # so a command that picks one by default can tell it changed; empty for built-ins, Hub IDs and older slabs
    source_identity: dict[str, str] = field(default_factory=dict)


def _json_sha256(payload: Any) -> str:
    """sha256 of ``payload``'s compact, key-sorted JSON text (the form docs/slab-format.md specifies)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def layout_digest(block: BlockRecord, layers: list[LayerRecord]) -> str:
    """sha256 of everything that says how a block's bytes are read (its tensors' names, dtypes, shapes, offsets,
    sizes and the layers' formats), so an edited offset or format is refused like an edited byte."""
    return _json_sha256({
        "block": [block.index, block.name, block.tensor, block.nbytes, block.layers],
        "params": [asdict(p) for p in block.params],
        "layers": [[rec.name, rec.block, rec.shape, rec.spec.to_dict(),
                    {role: asdict(t) for role, t in rec.tensors.items()}] for rec in layers],
    })


def resident_layout_digest(resident: list[ResidentRecord]) -> str:
    """sha256 of every resident record (name, data-file key, dtype, shape, sha256 of its bytes) in manifest order:
    two names swapped between tensors of one shape would otherwise load each into the other's place."""
    return _json_sha256([asdict(r) for r in resident])


def layer_to_dict(rec: LayerRecord) -> dict:
    return {**asdict(rec), "spec": rec.spec.to_dict()}


def rung_name(rung):
    """A rung by name; slabs written before rungs had names recorded the bit width of the int format (16: bf16)."""
    if isinstance(rung, bool) or not isinstance(rung, (int, str)) or not str(rung).isdigit():
        return rung
    return "bf16" if int(rung) == 16 else f"W{int(rung)}"


def layer_from_dict(d: dict) -> LayerRecord:
    """Parse a layer record; raises KeyError/TypeError/SpecError on malformed input."""
    named = {}
    if "rung" in d:
        named["rung"] = rung_name(d["rung"])
    if isinstance(d.get("history"), list):
        named["history"] = [{**h, "rung": rung_name(h["rung"])} if isinstance(h, dict) and "rung" in h else h
                            for h in d["history"]]
    if isinstance(d.get("rungs"), dict):
        named["rungs"] = {rung_name(k): v for k, v in d["rungs"].items()}
    return LayerRecord(**{**d, **named, "spec": QuantSpec.from_dict(d["spec"]),
                          "tensors": {k: TensorRecord(**v) for k, v in d["tensors"].items()}})


def block_from_dict(d: dict) -> BlockRecord:
    return BlockRecord(**{**d, "params": [TensorRecord(**p) for p in d["params"]]})


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a parsed JSON value has the type a record field is annotated with (ints are not bools)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def check_record_types(record: Any, where: str) -> None:
    """Every field of ``record`` (and of the records inside it) has its annotated type; :class:`SlabError` names
    the first that does not."""
    for name, hint in _field_types(type(record)):
        value = getattr(record, name)
        items = value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value]
        nested = [v for v in items if dataclasses.is_dataclass(v) and type(v).__module__ == __name__]
        if nested:
            for v in nested:
                check_record_types(v, where)
            continue
        if not _conforms(value, hint):
            owner = getattr(record, "name", type(record).__name__)
            raise SlabError(f"{where}: field {name!r} of {owner!r} is {type(value).__name__} {str(value)[:40]!r}, "
                            f"not {getattr(hint, '__name__', str(hint))}; the manifest is damaged, recompile the slab.")


@dataclass
class Manifest:
    model: ModelRecord
    blocks: list[BlockRecord]
    layers: list[LayerRecord]
    resident: list[ResidentRecord]
    # resident_layout_digest of ``resident``; "" in slabs written before it existed, which still open (format 2 with
    # or without it, so each SquareQ reads the other's slabs) with their resident layout unhashed (`inspect --verify`)
    resident_layout_sha256: str = ""
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
        for key in ("encoders", "source_identity"):  # written only when they say something, so older readers
            if not d["model"][key]:  # still read the slab
                del d["model"][key]
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse a manifest; ``where`` names the file in every error message."""
        try:
            d = json.loads(text)
        except RecursionError:
            raise SlabError(f"{where} nests JSON too deeply to be a slab manifest; the slab is damaged, "
                            "recompile it.") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SlabError(f"{where} is not valid JSON ({brief(exc)}); the slab is damaged, recompile it.") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise SlabError(f"{where} is not a SquareQ slab manifest (no \"format\": \"{FORMAT_NAME}\").")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise SlabError(
                f"{where} has slab format version {version!r}, but this SquareQ reads version {FORMAT_VERSION}; "
                "recompile the slab with this version or install the SquareQ that wrote it."
            )
        try:
            manifest = cls(
                model=ModelRecord(**d["model"]),
                blocks=[block_from_dict(b) for b in d["blocks"]],
                layers=[layer_from_dict(rec) for rec in d["layers"]],
                resident=[ResidentRecord(**r) for r in d["resident"]],
                resident_layout_sha256=d.get("resident_layout_sha256", ""),
                alignment=d["alignment"],
                thresholds=d.get("thresholds"),
                calibration=d.get("calibration"),
                totals=d.get("totals"),
                created_by=d.get("created_by", ""),
                format=d["format"],
                format_version=version,
            )
        except (KeyError, TypeError, AttributeError, SpecError) as exc:
            raise SlabError(f"{where} is missing or has malformed fields ({brief(exc)}); recompile the slab.") from None
        check_record_types(manifest, where)
        a = manifest.alignment
        if not 16 <= a <= MAX_ALIGNMENT or a & (a - 1):
            raise SlabError(f"{where}: alignment {a} is not a power of two from 16 to {MAX_ALIGNMENT}; the manifest "
                            "is damaged, recompile the slab.")
        return manifest
