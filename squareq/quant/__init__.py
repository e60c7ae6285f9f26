"""Pure tensor math for SquareQ weight formats: specs, packing, RTN, GPTQ, clip search, smoothing, metrics.

Nothing here imports the rest of the project.
"""
from . import formats  # noqa: F401 (each format module registers itself)
from .gptq import GPTQFactor, GPTQInfo, gptq_factor, gptq_quantize, gptq_quantize_with_info, input_hessian
from .hadamard import hadamard
from .metrics import output_rel_mse, rel_mse, sqnr_db, weighted_sq_error
from .packing import pack, packed_row_bytes, unpack
from .refine import refine_rounding, stored_hessian
from .registry import FORMATS, Format
from .rtn import (
    QuantizedWeight,
    dequantize,
    fake_quantize,
    group_scales,
    num_groups,
    quantize,
    row_chunks,
    scale_rows,
    tensor_layout,
)
from .search import ClipSearchResult, search_clip_ratio
from .smooth import smoothing_scale
from .spec import QuantSpec, SpecError

__all__ = [
    "FORMATS",
    "ClipSearchResult",
    "Format",
    "GPTQFactor",
    "GPTQInfo",
    "QuantSpec",
    "QuantizedWeight",
    "SpecError",
    "dequantize",
    "fake_quantize",
    "group_scales",
    "gptq_factor",
    "gptq_quantize",
    "hadamard",
    "gptq_quantize_with_info",
    "input_hessian",
    "num_groups",
    "output_rel_mse",
    "pack",
    "packed_row_bytes",
    "quantize",
    "refine_rounding",
    "row_chunks",
    "rel_mse",
    "scale_rows",
    "search_clip_ratio",
    "smoothing_scale",
    "sqnr_db",
    "stored_hessian",
    "tensor_layout",
    "unpack",
    "weighted_sq_error",
]
