"""``torch.compile`` for the streamed blocks (``runtime.load(compile_blocks=True)``, ``squareq train --compile``).

What a compiled resident FLUX.1 gains over the eager one is the work between the matmuls: layer norms, modulation,
the query/key norms and rotary embedding, GELU, gates and residual adds, which inductor fuses into a few kernels
(issue 41: 1.000 s → 0.644 s per LoRA step at 1024² on an H100). SquareQ's blocks get the same here:

* One compiled forward per block class (double, single), shared by every block of that class and every slot: the
  block module is an argument of the compiled function, and its tensors (slot views, LoRA factors) are inputs, so a
  block in another slot, or another block of the same class, reuses the graphs (a test checks it).
* The quantized layers are opaque to the compiler (each ``QuantLinear`` call runs eagerly between compiled pieces):
  they keep their own kernels (dequantize + matmul, FP8, the fused small-M kernels), their LoRA path and their own
  input gradient, and so the same values as eager. Each linear therefore splits the block's graph; the pieces between
  them are what inductor fuses.
* The graphs specialise on shapes (``dynamic=False``): a new resolution or batch compiles again, once, and the
  recompile limit is raised to :data:`RECOMPILE_LIMIT` for that. Inductor's on-disk caches (torch's defaults) make a
  second run with the same shapes start without compiling the kernels again.
* Under CUDA graphs (``cuda_graphs=True``) the compiled forward is what a block's graph captures: compiling happens
  in the eager warm-up runs before the capture (runtime/block_graphs.py).

``auto`` (:func:`resolve_compile`) is on for training FLUX.1 on CUDA devices of compute capability 9.0 and up
(Hopper, Blackwell), where benchmarks/train_step.py measured it faster (docs/benchmarks.md), and off elsewhere:
unmeasured there (other families, other GPUs), and the first steps pay the compile. For sampling it is off: a 28-step
run does not earn its compile back.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

log = logging.getLogger("squareq.runtime")

MODES = ("auto", "on", "off")
BACKEND = "inductor"  # tests on a CPU use "aot_eager": the same graphs without inductor's C++ builds
RECOMPILE_LIMIT = 64  # per code object: grad modes × input signatures × resolutions of a run
AUTO_CAPABILITY = (9, 0)  # where the streamed blocks measured faster compiled (docs/benchmarks.md)
AUTO_FAMILIES = ("flux",)  # the families whose blocks were measured (FLUX.1)


class CompileModeError(ValueError):
    """A ``--compile`` mode this device cannot run."""


def resolve_compile(mode: str, device: torch.device | str, training: bool = True,
                    family: str | None = None) -> tuple[bool, str]:
    """``(on, why)`` with ``auto`` settled for ``device``, for training or (``training=False``) a sampling run, and
    for the slab's model ``family``; refuses (:class:`CompileModeError`) an unknown mode."""
    if mode not in MODES:
        raise CompileModeError(f"compile={mode!r}: choose one of {', '.join(MODES)}.")
    device = torch.device(device)
    if mode != "auto":
        return mode == "on", "asked for"
    if not training:
        return False, ("a sampling run measured slower with it, its compile counted (FLUX.1 at 1024², 28 steps: "
                       "0.74 s against 0.23 s per step), and its steady steps level (docs/benchmarks.md)")
    if device.type != "cuda":
        return False, f"torch.compile of the blocks was measured on CUDA GPUs only, not on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    name = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    if capability < AUTO_CAPABILITY:
        least = f"{AUTO_CAPABILITY[0]}.{AUTO_CAPABILITY[1]}"
        return False, (f"torch.compile of the blocks was measured faster on compute capability {least} and up, not "
                       f"yet on the {name}; --compile on tries it")
    if family not in AUTO_FAMILIES:
        return False, (f"torch.compile of the blocks was measured on FLUX.1 only, not on {family or 'this'} models; "
                       "--compile on tries it")
    return True, f"the streamed blocks measured faster compiled on GPUs like the {name}"


def compile_block_forwards(blocks: list[nn.Module], runners: list | None = None) -> int:
    """Compile ``blocks``' forward, one compiled function per block class; ``runners`` (the streamed blocks'
    :class:`BlockRunner`, same order; None for blocks that are not streamed) run it in place of the eager forward.
    Returns the number of block classes."""
    _raise_recompile_limit()
    compiled: dict[type, object] = {}
    for i, block in enumerate(blocks):
        keep_quantized_layers_eager(block)
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, backend=BACKEND, dynamic=False)
        forward = functools.partial(compiled[cls], block)
        runner = runners[i] if runners is not None else None
        if runner is not None:
            runner.forward = forward
        else:
            block.forward = forward
    return len(compiled)


def keep_quantized_layers_eager(module: nn.Module) -> None:
    """Each quantized layer's whole call in ``module`` (base product and its LoRA; for a layer PEFT wraps, the
    wrapper's call, DoRA included) runs as eager code between compiled pieces of its block. Why the whole call: a
    graph break inside a layer's forward would have Dynamo compile that forward as a frame of its own, specialised on
    every layer shape it meets (dozens per block, each a recompile). Layers already kept eager are left as they are."""
    from .qlinear import QuantLinear

    for layer in module.modules():
        wraps = isinstance(getattr(layer, "base_layer", None), QuantLinear)  # PEFT's LoRA layers
        if (isinstance(layer, QuantLinear) or wraps) and "forward" not in vars(layer):
            layer.forward = torch.compiler.disable(layer.forward)


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < RECOMPILE_LIMIT:
        setattr(config, name, RECOMPILE_LIMIT)


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far (Dynamo's own count: tracing, AOT
    autograd and inductor, the backward graphs included)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(v) for k, v in compilation_time_metrics.items() if k in _TOTALS)


# Dynamo's metrics nest (a compile's total holds its parts); these are the outermost ones: a forward frame's compile,
# and the backward graph that AOT autograd compiles on the first backward.
_TOTALS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
