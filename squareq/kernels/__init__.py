"""GPU kernels (Triton) with exact torch references; dispatch picks one per device."""
from .backend import backend_for, dequantize, dequantize_into, prepare_dequantize
from .gptq import gptq_sweep

__all__ = ["backend_for", "dequantize", "dequantize_into", "gptq_sweep", "prepare_dequantize"]
