"""The runtime: a slab attached to the family's own model class, blocks streamed through a ring of device
slots, LoRA on chosen layers, and per-step telemetry. Entry point: :func:`load`."""
from .blocks import NEEDS_CHECKPOINTING
from .loader import HOSTS, Runtime, load, runtime_of
from .lora import DEFAULT_TARGETS, add_lora, lora_parameters, lora_state_dict
from .plan import MemoryPlan, PlanError, plan
from .qlinear import DequantScratch, QuantLinear
from .streamer import Streamer, StreamError
from .telemetry import StepStats, Telemetry

__all__ = [
           "DEFAULT_TARGETS",
           "HOSTS",
           "NEEDS_CHECKPOINTING",
           "DequantScratch",
           "MemoryPlan",
           "PlanError",
           "QuantLinear",
           "Runtime",
           "StepStats",
           "StreamError",
           "Streamer",
           "Telemetry",
           "add_lora",
           "load",
           "lora_parameters",
           "lora_state_dict",
           "plan",
           "runtime_of",
]
