"""``torch.compile`` for the streamed blocks (``LoadOptions(compile_blocks=True)``, ``squareq train --compile``).

What a compiled resident FLUX.1 gains over the eager one is the work between the matmuls: layer norms, modulation,
the query/key norms and rotary embedding, GELU, gates and residual adds, which inductor fuses into a few kernels
(issue 41: 1.000 s → 0.644 s per LoRA step at 1024² on an H100). SquareQ's blocks get the same here:

* One compiled graph per block class and grad mode (double, single; the checkpointed forward without autograd, the
  recompute with it), shared by every block of that class and every slot: the block module is an argument of the
  compiled function, and its tensors (slot views, LoRA factors) are inputs, so a block in another slot, or another
  block of the same class, reuses the graphs (tests count them).
* The quantized layers are traced into the graph, each as one custom operator (runtime/linear_op.py) that runs the
  layer's own eager code: dequantize + matmul, FP8 with its kept row maxima, the fused small-M kernels, and the input
  gradient. Its LoRA products, their adds and everything between the layers are inductor's to fuse. With
  :data:`WHOLE_BLOCKS` off the layers run eagerly between compiled pieces instead (benchmarks compare both).
* The graphs specialise on shapes (``dynamic=False``): a new resolution or batch compiles again, once, and the
  recompile limit is raised to :data:`RECOMPILE_LIMIT` for that. A block's tensor inputs are made dense first, so a
  slice (FLUX.1's single blocks pass their streams on as slices of one tensor) does not compile a graph of its own.
* Inductor's and AOT autograd's on-disk caches (torch's defaults) let a second run with the same shapes start
  without compiling again; only Dynamo's tracing is repeated. For that the backward is compiled with its forward
  (:func:`_call_compiled`).
* Under CUDA graphs (``cuda_graphs=True``) the compiled forward is what a block's graph captures: compiling happens
  in the eager warm-up runs before the capture (runtime/block_graphs.py).

``auto`` (:func:`resolve_compile`) is on for training FLUX.1 on CUDA devices of compute capability 9.0 and up
(Hopper, Blackwell), where benchmarks/train_step.py measured it faster (docs/benchmarks.md), and off elsewhere:
unmeasured there (other families, other GPUs), and the first steps pay the compile. For sampling it is off: a 28-step
run does not earn its compile back.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import linear_op

log = logging.getLogger("squareq.runtime")

MODES = ("auto", "on", "off")
BACKEND = "inductor"  # tests on a CPU use "aot_eager": the same graphs without inductor's C++ builds
RECOMPILE_LIMIT = 64  # per code object: grad modes × input signatures × resolutions of a run
AUTO_CAPABILITY = (9, 0)  # where the streamed blocks measured faster compiled (docs/benchmarks.md)
AUTO_FAMILIES = ("flux",)  # the families whose blocks were measured (FLUX.1)
# Trace the quantized layers into the block's graph as custom operators (one graph per block class and grad mode);
# off: each runs eagerly between compiled pieces, as before issue 41's whole-block graphs (benchmarks compare both)
WHOLE_BLOCKS = True


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
        trace_quantized_layers(block)
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, backend=BACKEND, dynamic=False)
        forward = functools.partial(_call_compiled, compiled[cls], block)
        runner = runners[i] if runners is not None else None
        if runner is not None:
            runner.forward = forward
        else:
            block.forward = forward
    return len(compiled)


def _call_compiled(compiled, block: nn.Module, *args, **kwargs):
    """``compiled(block, ...)`` with every tensor argument in a dense layout, its backward compiled with it. Why
    dense: Dynamo guards on strides, and a block's inputs are sometimes slices of a larger tensor (FLUX.1's single
    blocks return their two streams as slices of one), sometimes not (the first single block's come from a double
    block), which would compile each graph twice; a copy of a block's inputs costs far less than its matmuls. Why the
    backward with its forward, not on its first call: torch 2.11's AOT autograd cache saves a training graph only
    then (pytorch#141790), and without the saved entry a second run traces each block's joint graph again (7 s of its
    15 s compile, on the device). Patched per call, so a user's other compiled code keeps torch's default."""
    args, kwargs = tree_map_only(torch.Tensor, _dense, (args, kwargs))
    with _backward_with_forward():
        return compiled(block, *args, **kwargs)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a fresh tensor of its shape (a copy where they differ). Not ``t.contiguous()``: that
    keeps a slice whose size-1 dimension has another stride (a batch of one), which Dynamo's guards still see."""
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)


def _backward_with_forward():
    flag = "force_non_lazy_backward_lowering"
    if hasattr(torch._functorch.config, flag):
        return torch._functorch.config.patch(**{flag: True})
    return contextlib.nullcontext()


def trace_quantized_layers(module: nn.Module) -> None:
    """Have ``module``'s quantized layers traced into its compiled graphs: each gets the handle through which its
    block's graph calls it as one custom operator (runtime/linear_op.py), unless :data:`WHOLE_BLOCKS` is off; then,
    and for PEFT's wrappers in any case, :func:`keep_quantized_layers_eager`."""
    from .qlinear import QuantLinear

    if not WHOLE_BLOCKS:
        keep_quantized_layers_eager(module)
        return
    for layer in module.modules():
        if isinstance(layer, QuantLinear) and layer.handle is None:
            layer.handle = linear_op.register(layer)
    keep_quantized_layers_eager(module, plain=False)


def keep_quantized_layers_eager(module: nn.Module, plain: bool = True) -> None:
    """Each quantized layer's whole call in ``module`` (base product and its LoRA; for a layer PEFT wraps, the
    wrapper's call, DoRA included) runs as eager code between compiled pieces of its block; ``plain=False``: PEFT's
    wrappers only. Why the whole call: a graph break inside a layer's forward would have Dynamo compile that forward as
    a frame of its own, specialised on every layer shape it meets (dozens per block, each a recompile). Layers already
    kept eager are left as they are."""
    from .qlinear import QuantLinear

    for layer in module.modules():
        wraps = isinstance(getattr(layer, "base_layer", None), QuantLinear)  # PEFT's LoRA layers
        if ((plain and isinstance(layer, QuantLinear)) or wraps) and "forward" not in vars(layer):
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


# Dynamo's metrics nest (a compile's total holds its parts); this is the outermost one, a forward frame's compile. It
# holds the backward's compile too, which the blocks have compiled with their forward (_call_compiled).
_TOTALS = ("_compile.compile_inner",)
