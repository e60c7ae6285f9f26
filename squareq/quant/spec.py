"""`QuantSpec`: the complete, frozen description of one layer's weight format."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from .registry import FORMATS

SUPPORTED_BITS = (4, 6, 8, 16)

SCALE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


class SpecError(ValueError):
    """A QuantSpec field has a value SquareQ cannot store or compute with."""


@dataclass(frozen=True)
class QuantSpec:
    """How one linear layer's weight is stored.

    format: the registered format (squareq/quant/formats/): ``int`` (integer codes, the default), ``nf4``, ...
    bits: the code width the format takes: 4, 6 or 8 for ``int``; 16 is bf16 passthrough (format ``int``).
    group_size: input channels (K) sharing one scale; a power of two >= 8.
    symmetric: codes are centred on zero; otherwise (the default) each group also stores an int8
        zero point, which lowers W4 error by about a quarter on Gaussian weights (docs/formats.md).
    scale_dtype: "float16", "bfloat16" or "float32".
    clip_ratio: fraction of the group's range that maps onto the code range (1.0 = no clipping).
    smooth: the stored weight is W·diag(s) and the slab keeps 1/s per input channel.
    rotate: the stored weight is W·H, a normalized Walsh–Hadamard rotation within each group of ``group_size``
        input channels (squareq/quant/hadamard.py); dequantization rotates back (H is symmetric and orthonormal).
        Rotation is the outermost transform: smoothing's s applies to the rotated channels, and the dequantized
        weight is (the format's decoding, times 1/s) · H. The layer's K must be a whole number of groups.
    """

    bits: int = 4
    group_size: int = 64
    symmetric: bool = False
    scale_dtype: str = "float16"
    clip_ratio: float = 1.0
    smooth: bool = False
    format: str = "int"
    rotate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise SpecError(f"format={self.format!r} is not a SquareQ format; use one of {', '.join(sorted(FORMATS))}.")
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise SpecError(f"bits={self.bits} is not supported; use one of {SUPPORTED_BITS}.")
        if self.bits == 16 and self.format != "int":
            raise SpecError(f"bits=16 is bf16 passthrough, which has no format {self.format!r}; drop the format.")
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 8 or g & (g - 1):
            raise SpecError(f"group_size={g!r} must be a power of two of at least 8 (e.g. 64 or 128).")
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in SCALE_DTYPES:
            raise SpecError(f"scale_dtype={self.scale_dtype!r} must be one of {sorted(SCALE_DTYPES)}.")
        if not isinstance(self.clip_ratio, (int, float)) or not (0.0 < float(self.clip_ratio) <= 1.0):
            raise SpecError(f"clip_ratio={self.clip_ratio!r} must be a number in (0, 1].")
        for flag in ("symmetric", "smooth", "rotate"):
            if not isinstance(getattr(self, flag), bool):
                raise SpecError(f"{flag}={getattr(self, flag)!r} must be true or false.")
        problem = None if self.bits == 16 else FORMATS[self.format].check(self)
        if self.rotate and not problem:
            problem = _rotation_problem(self)
        if problem:
            raise SpecError(problem + ".")

    @property
    def packing(self) -> str:
        """Packing id recorded in the manifest (``int``: u4x2, u6x4, i8; bf16; other formats their own)."""
        return "bf16" if self.bits == 16 else FORMATS[self.format].packing(self)

    @property
    def is_passthrough(self) -> bool:
        return self.bits == 16

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def with_clip(self, clip_ratio: float) -> QuantSpec:
        return replace(self, clip_ratio=float(clip_ratio))

    def label(self) -> str:
        """Short human label, e.g. ``W4 g64 sym`` or ``bf16``."""
        if self.is_passthrough:
            return "bf16"
        return FORMATS[self.format].label(self) + (" H" if self.rotate else "")

    @property
    def short_label(self) -> str:
        """The format's name at this width (``W4``, ``NF4``, ``FP8``, ``bf16``): the compiler's rung names."""
        return "bf16" if self.is_passthrough else FORMATS[self.format].short_label(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.format == "int":
            del d["format"]  # manifests written before formats had names read the same
        if not self.rotate:
            del d["rotate"]  # nor do those written before rotation
        d["packing"] = self.packing
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        if not isinstance(d, dict):
            raise SpecError(f"a QuantSpec is a JSON object of fields, not {type(d).__name__}.")
        known = {"bits", "group_size", "symmetric", "scale_dtype", "clip_ratio", "smooth", "format", "rotate"}
        unknown = set(d) - known - {"packing"}
        if unknown:
            raise SpecError(f"unknown QuantSpec fields {sorted(unknown)}.")
        spec = cls(**{k: d[k] for k in known if k in d})
        if "packing" in d and d["packing"] != spec.packing:
            raise SpecError(f"packing {d['packing']!r} does not match bits={spec.bits} ({spec.packing!r}).")
        return spec


def _rotation_problem(spec: QuantSpec) -> str | None:
    """Why ``spec`` cannot rotate (one sentence without the full stop), or None."""
    if spec.bits == 16:
        return "bits=16 is bf16 passthrough, which stores the weight itself: it cannot be rotated (rotate=False)"
    if not FORMATS[spec.format].rotate:
        return (f"format {spec.format!r} cannot be rotated: its kernel does not apply the Hadamard rotation, and "
                "rotation's measured gain came with GPTQ, which rounds onto the int grid; rotate an int spec")
    return None
