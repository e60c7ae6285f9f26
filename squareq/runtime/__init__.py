"""The runtime: a slab attached to the family's own model class, blocks streamed through a ring of device
slots, LoRA on chosen layers, and per-step telemetry. Entry point: :func:`load`, its options a :class:`LoadOptions`;
docs/runtime.md explains both.
:func:`stream_module` streams an in-memory module's blocks the same way, for inference (large text encoders)."""
from .activation_offload import ActivationOffload
from .blocks import disable_cudnn_attention, retry_without_cudnn
from .load_options import LoadOptions
from .loader import Runtime, autocast_dtype, load, runtime_of
from .lora import DEFAULT_TARGETS, add_lora, lora_parameters, lora_state_dict
from .memory_plan import MemoryPlan, PlanError, plan
from .module_stream import release_module, stream_module
from .peft_lora import LoraVariant, PeftMissing, require_peft
from .qlinear import QuantLinear
from .streamer import StreamError
from .telemetry import StepStats

__all__ = [
    "ActivationOffload",
    "DEFAULT_TARGETS",
    "LoadOptions",
    "LoraVariant",
    "PeftMissing",
    "MemoryPlan",
    "PlanError",
    "QuantLinear",
    "Runtime",
    "StepStats",
    "StreamError",
    "add_lora",
    "autocast_dtype",
    "disable_cudnn_attention",
    "load",
    "lora_parameters",
    "lora_state_dict",
    "plan",
    "release_module",
    "require_peft",
    "retry_without_cudnn",
    "runtime_of",
    "stream_module",
]
