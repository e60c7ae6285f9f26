"""``squareq.runtime.load``: a slab attached to the family's own model class, ready to run or train.

The model is built on the meta device from the class and config the slab records, its signature checked
against the manifest, its resident (non-block) tensors put on the device, and every linear inside a
streamed block replaced by a :class:`QuantLinear`. Blocks then either stream through a ring of device
slots (the default) or, with ``stream=False``, all stay on the device (the resident quantized model: the
reference the streamed one must equal, and the fastest choice when the whole slab fits).
"""
from __future__ import annotations

import logging
import os
import time
import weakref

import torch
from torch import nn

from .. import settings
from ..models.skeleton import place_tensor, skeleton_from_record
from ..slab import Slab, SlabError, open_slab
from ..slab.manifest import MANIFEST_FILE, Manifest
from ..slab.signature import model_signature
from .attention_choice import head_dim, preferring_cudnn, resolve_attention
from .block_compile import compile_block_forwards
from .block_graphs import BlockGraphs
from .blocks import BlockRunner
from .compute import DTYPES, resolve_compute, resolve_dtype
from .flux_attention import install_fused_attention
from .host.budget import choose_host
from .host.staging import DiskStaging, PinnedArena
from .load_options import LoadOptions, options_from_old_arguments
from .qlinear import DequantScratch, QuantLinear
from .streamer import Streamer
from .telemetry import StepStats, Telemetry

log = logging.getLogger("squareq.runtime")

RUNTIME_ATTR = "_squareq_runtime"


class Runtime:
    """The streaming state attached to a loaded model (``runtime_of(model)``)."""

    def __init__(self, model: nn.Module, manifest: Manifest, device: torch.device, streamer: Streamer | None,
                 telemetry: Telemetry, scratch: DequantScratch, device_blobs: list[torch.Tensor]) -> None:
        self.class_name = type(model).__name__
        self.manifest = manifest
        self.device = device
        self.streamer = streamer
        self.telemetry = telemetry
        self.scratch = scratch
        self.device_blobs = device_blobs  # stream=False: every block's blob on the device
        self.checkpointing = False
        self.activation_offload = None  # an ActivationOffload: the checkpointed inputs wait in host memory
        self.binder: _Binder | None = None
        self.resident_blocks: dict[int, torch.Tensor] = {}  # streamed model: blocks kept on the device, their blob
        self.block_timer = None  # a residency.BlockTimer while a step is measured
        self.graphs: BlockGraphs | None = None  # cuda_graphs=True: the streamed blocks' CUDA graphs
        self.host, self.host_reason = "pinned", ""  # where the blobs wait, and why (host="auto" says)
        self.compute, self.compute_reason = "bf16", ""  # the base layers' arithmetic, and why (compute="auto" says)
        self.dtype, self.dtype_reason = "bf16", ""  # the activations' and dequantized weights' 16-bit type, and why
        self.compiled = False  # compile_blocks=True: the blocks' forward runs under torch.compile
        self.prefer_cudnn = False  # attention: the blocks run with cuDNN attention first (runtime/attention_choice.py)
        self.attention_reason = ""

    def measure_copy_bandwidth(self, blocks: int = 3) -> float:
        """Host-to-device bytes per second of this model's block copies (the largest ``blocks`` blocks, each
        copied into a free ring slot once; the slot is left empty)."""
        streamer = self.streamer
        slot = next((s for s in streamer.slots if s.users == 0), None)
        if slot is None:
            raise RuntimeError("every ring slot is in use; measure the copy bandwidth between steps.")
        streamer.settle()  # pending prefetches must not share the link with the timed copies
        if slot.block is not None:
            self.binder.unbind(slot.block)
            slot.block = slot.ticket = None
        largest = sorted(streamer.order, key=lambda b: streamer.block_sizes[b], reverse=True)[:blocks]
        copied, seconds = 0, 0.0
        for b in largest:
            _sync(self.device)
            start = time.perf_counter()
            ticket = streamer.host.start_copy(b, slot.buffer, streamer.copy_stream, slot.ready, slot.free)
            ticket.wait_issued()
            _sync(self.device)
            seconds += time.perf_counter() - start
            copied += streamer.block_sizes[b]
        return copied / max(seconds, 1e-9)

    def apply_stream_plan(self, plan) -> None:
        """Grow the ring to ``plan.slots`` and keep ``plan.resident`` blocks on the device (a residency.StreamPlan).
        Only grows: blocks kept by an earlier plan stay on the device, and the ring never shrinks."""
        streamer = self.streamer
        new = [b for b in plan.resident if b not in self.resident_blocks]
        streamer.exclude(new)
        for b in new:
            blob = self.binder.slab.block_bytes(b).to(self.device, copy=True)
            self.resident_blocks[b] = blob
            self.binder.bind(b, -1, blob)
        streamer.add_slots(plan.slots - len(streamer.slots))

    def forget_slot(self, slot: int) -> None:
        """Slot ``slot``'s buffer is gone: drop the views into it and the CUDA graphs that read it."""
        self.binder.forget(slot)
        if self.graphs is not None:
            self.graphs.forget_slot(slot)

    @property
    def streamed(self) -> bool:
        return self.streamer is not None

    @property
    def ring_slots(self) -> int:
        """The device slots the streamed blocks go through now (0 when every block stays on the device)."""
        return len(self.streamer.slots) if self.streamer is not None else 0

    def step_stats(self) -> StepStats:
        """Copies, copy wait and peak memory since the previous call (call once per training step)."""
        stats = self.telemetry.step()
        if self.graphs is not None:
            self.graphs.end_step()
        return stats

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        if self.activation_offload is not None:  # its page-locked buffers go back to the system
            self.activation_offload.close()
        if self.telemetry.tracing:
            self.telemetry.write_trace()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runtime_of(model: nn.Module) -> Runtime:
    """The :class:`Runtime` of a model returned by :func:`load`."""
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None:
        raise ValueError(f"this {type(model).__name__} was not loaded by squareq.runtime.load.")
    return rt


def autocast_dtype(model: nn.Module) -> torch.dtype:
    """The type to autocast ``model``'s forward to: its runtime's ``dtype`` (bf16, or fp16 on GPUs without bf16);
    bf16 for a model :func:`load` did not build."""
    rt = getattr(model, RUNTIME_ATTR, None)
    return DTYPES[rt.dtype] if rt is not None else torch.bfloat16


class _Binder:
    """Points a block's modules at the bytes of the buffer that holds its blob (a slot or a device blob).

    The views for each (block, buffer) pair are built once and cached, so a rebind is a few attribute stores.
    """

    def __init__(self, model: nn.Module, slab: Slab) -> None:
        self.model = model
        self.slab = slab
        self.manifest = slab.manifest
        # Modules are found by name once, at load: a caller may later reorder a block list, and a block's
        # slab data must follow its module, not the name its position now has.
        self.modules = {name: model.get_submodule(name)
                        for b in self.manifest.blocks for name in (b.name, *b.layers)}
        self._cache: dict[tuple[int, int], list] = {}

    def _plan(self, block: int, buffer: torch.Tensor) -> list:
        rec = self.manifest.blocks[block]
        block_module = self.modules[rec.name]
        ops = []
        for name in rec.layers:
            qw = self.slab.quantized_weight(name, blob=buffer)  # views into the buffer, laid out as the manifest says
            module = self.modules[name]
            ops.append((module, "bind", (qw, *module.prepared(qw))))
        for pname, t in self.slab.block_params(block, blob=buffer).items():
            owner_path, _, attr = pname.rpartition(".")
            # a layer's bias goes to the layer found at load, even where PEFT has since wrapped it in a LoRA layer
            owner = self.modules.get(f"{rec.name}.{owner_path}") or (
                block_module.get_submodule(owner_path) if owner_path else block_module)
            if attr in owner._parameters:
                ops.append((owner._parameters, attr, nn.Parameter(t, requires_grad=False)))
            elif attr in owner._buffers:
                ops.append((owner._buffers, attr, t))
            else:
                raise SlabError(f"the slab stores {rec.name}.{pname}, which {type(self.model).__name__} does not "
                                "have; the slab does not match this model class, recompile it.")
        return ops

    def bind(self, block: int, key: int, buffer: torch.Tensor) -> None:
        ops = self._cache.get((block, key))
        if ops is None:
            # Normal tensors even when the first forward runs under torch.inference_mode(): the cached views
            # serve every later training step, and inference tensors cannot be saved for a backward.
            with torch.inference_mode(False):
                ops = self._cache[(block, key)] = self._plan(block, buffer)
        for target, attr, value in ops:
            if isinstance(target, dict):
                target[attr] = value
            else:
                target.bind(*value)

    def forget(self, key: int) -> None:
        """The buffer of slot ``key`` is gone: drop the views into it (they would keep it alive and be stale)."""
        for cached in [c for c in self._cache if c[1] == key]:
            del self._cache[cached]

    def unbind(self, block: int) -> None:
        """The block left its slot: its QuantLinear layers refuse to run (and to report a weight) until rebound."""
        for name in self.manifest.blocks[block].layers:
            self.modules[name].unbind()


def _install_quant_linears(model: nn.Module, manifest: Manifest, scratch: DequantScratch) -> None:
    for layer in manifest.layers:
        owner_path, _, attr = layer.name.rpartition(".")
        owner = model.get_submodule(owner_path)
        old = getattr(owner, attr)
        if not isinstance(old, nn.Linear) or [old.out_features, old.in_features] != list(layer.shape):
            raise SlabError(f"the slab's layer {layer.name} ({layer.shape}) is not a matching nn.Linear in "
                            f"{type(model).__name__}; recompile the slab for this model.")
        setattr(owner, attr, QuantLinear(old.in_features, old.out_features, scratch))


def _place_residents(model: nn.Module, slab: Slab, device: torch.device, dtype: torch.dtype) -> None:
    for name, t in slab.resident_tensors().items():
        if t.dtype == torch.bfloat16 and dtype != torch.bfloat16:  # an fp16 run: embedders and final layers in fp16
            t = t.to(dtype)
        place_tensor(model, name, t.to(device, copy=True))
    for module in model.modules():  # non-persistent buffers were built real on the host
        for attr, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[attr] = buf.to(device)


def _streamer(slab: Slab, rt: Runtime, host: str, prefetch: int, sizes: list[int]) -> Streamer:
    """The ring of ``prefetch`` device slots fed from ``host`` ("pinned", "shared" or "disk")."""
    device = rt.device
    source = DiskStaging(slab, device) if host == "disk" else PinnedArena.for_slab(slab, device,
                                                                                    shared=host == "shared")
    try:
        return Streamer(source, device, prefetch, max(sizes), sizes, rt.binder.bind, rt.binder.unbind, rt.telemetry,
                        rt.forget_slot)
    except BaseException:
        source.close()
        raise


def _call_through(function, *args, **kwargs):
    """The checkpoint function handed to the model class: streamed blocks checkpoint themselves (diffusers passes
    the block, transformers a partial of its ``__call__``); anything else keeps torch's checkpoint."""
    target = getattr(function, "func", function)
    module = getattr(target, "__self__", target)
    if isinstance(getattr(module, "forward", None), BlockRunner):
        return function(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _route_checkpointing(model: nn.Module, rt: Runtime) -> None:
    """``enable_gradient_checkpointing()`` (diffusers) and ``gradient_checkpointing_enable()`` (transformers)
    both end in ``_set_gradient_checkpointing``; route it to the streamed blocks' own checkpoint."""
    original = model._set_gradient_checkpointing
    if hasattr(model, "_supports_gradient_checkpointing"):
        # streamed blocks checkpoint themselves, so a diffusers class without its own switch (Würstchen's decoder)
        # can still turn it on
        model._supports_gradient_checkpointing = True

    def set_gradient_checkpointing(enable: bool = True, gradient_checkpointing_func=None, **kwargs):
        rt.checkpointing = bool(enable)
        if not any(hasattr(m, "gradient_checkpointing") for m in model.modules()):
            return None  # no checkpointing of its own (Würstchen's decoder): the streamed blocks' is enough
        if enable:
            return original(enable=True, gradient_checkpointing_func=_call_through, **kwargs)
        return original(enable=False, **kwargs)

    model._set_gradient_checkpointing = set_gradient_checkpointing


def load(slab: str | os.PathLike | Slab, device: str | torch.device = "cuda", *old_positional,
         options: LoadOptions | None = None, **old_keywords) -> nn.Module:
    """The family's own model class (e.g. diffusers ``FluxTransformer2DModel``) running from ``slab`` on ``device``,
    its blocks streamed or resident as ``options`` (:class:`LoadOptions`; default: ``LoadOptions()``) say.

    The arguments of earlier releases (``prefetch=2, host="pinned", ...``: LoadOptions' fields, by name or by position
    after ``device`` in their old order) still work for one release, with a ``FutureWarning``; ``runtime_of(model)``
    holds what ``auto`` fields chose.
    """
    if old_positional or old_keywords:
        options = options_from_old_arguments(options, old_positional, old_keywords)
    opts = options if options is not None else LoadOptions()
    device = _checked_device(device, opts.stream, opts.cuda_graphs)
    s, model = _skeleton(slab, opts.verify)
    m = s.manifest
    dtype, dtype_reason = resolve_dtype(opts.dtype, device)
    compute, compute_reason = resolve_compute(opts.compute, device, dtype)
    scratch = _scratch(m, compute, device, DTYPES[dtype])
    _install_quant_linears(model, m, scratch)
    if opts.fused_attention:
        install_fused_attention(model)
    _place_residents(model, s, device, DTYPES[dtype])
    binder = _Binder(model, s)
    telemetry = Telemetry(device, opts.trace if opts.trace is not None else settings.trace_path())
    host, reason = _resolve_host(opts.host, m)
    rt = Runtime(model, m, device, None, telemetry, scratch, [])
    rt.binder = binder
    rt.graphs = BlockGraphs(device) if opts.cuda_graphs else None
    if opts.stream:
        rt.streamer = _streamer(s, rt, host, opts.prefetch, [b.nbytes for b in m.blocks])
    else:
        _bind_all(s, rt)  # every block resident: no streamer
    model.requires_grad_(False)
    model.eval()
    rt.compute, rt.compute_reason = compute, compute_reason
    rt.dtype, rt.dtype_reason = dtype, dtype_reason
    log.info("compute: %s (%s); activations in %s (%s).", compute, compute_reason, dtype, dtype_reason)
    if not opts.stream:
        host, reason = "device", "stream=False keeps every block on the device"
    rt.host, rt.host_reason = host, reason
    object.__setattr__(model, RUNTIME_ATTR, rt)
    if rt.streamer is not None:
        _run_blocks_through(model, rt.streamer, rt)
    if opts.compile_blocks:
        blocks = [model.get_submodule(b.name) for b in m.blocks]
        kinds = compile_block_forwards(blocks, [b.forward if rt.streamer is not None else None for b in blocks])
        log.info("torch.compile: the forward of %d block classes is compiled on first use (the first steps take "
                 "longer while it compiles).", kinds)
    rt.compiled = opts.compile_blocks
    rt.prefer_cudnn, rt.attention_reason = resolve_attention(opts.attention, device, head_dim(model))
    log.info("attention: %s (%s).", "cuDNN's kernels first" if rt.prefer_cudnn else "torch's order",
             rt.attention_reason)
    if rt.streamer is None:  # streamed blocks get it from their BlockRunner
        for b in m.blocks:
            block = model.get_submodule(b.name)
            block.forward = preferring_cudnn(block.forward, rt)
    _route_checkpointing(model, rt)
    return model


def _checked_device(device: str | torch.device, stream: bool, cuda_graphs: bool) -> torch.device:
    """``load``'s device (a bare "cuda" pinned to the current GPU), after refusing options that cannot work on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if cuda_graphs and (device.type != "cuda" or not stream):
        raise ValueError(f"cuda_graphs=True needs streamed blocks on a CUDA device (here: {device}, stream={stream}); "
                         "load on a GPU with stream=True, or leave CUDA graphs off.")
    return device


def _skeleton(slab: str | os.PathLike | Slab, verify: str | bool) -> tuple[Slab, nn.Module]:
    """The opened (and, when asked, verified) slab and its model class built on the meta device, whose parameters
    must be the ones the slab was compiled for."""
    s = slab if isinstance(slab, Slab) else open_slab(slab, verify=verify)
    m = s.manifest
    if isinstance(slab, Slab) and verify in ("eager", True):
        s.verify()
    tensors = len(m.layers) + sum(len(b.params) for b in m.blocks) + len(m.resident)
    model = skeleton_from_record(m.model.class_name, m.model.config, tensors, str(s.path / MANIFEST_FILE))
    if model_signature(model) != m.model.signature:
        raise SlabError(f"{s.path}: {m.model.class_name} built from the recorded config does not have the parameters "
                        "the slab was compiled for (an incompatible diffusers/transformers version?); recompile the "
                        "slab with the installed libraries.")
    return s, model


def _scratch(m: Manifest, compute: str, device: torch.device, dtype: torch.dtype) -> DequantScratch:
    """The shared dequantization buffer, sized for the largest quantized layer (an fp16 run's converted weights: for
    the largest layer)."""
    largest = max((l.shape[0] * l.shape[1] for l in m.layers if not l.spec.is_passthrough), default=1)
    scratch = DequantScratch(largest, device, dtype, max((l.shape[0] * l.shape[1] for l in m.layers), default=1))
    if compute == "fp8":  # bf16 layers too are quantized to E4M3 rows for the FP8 matmul
        scratch.add_fp8(max((l.shape[0] * l.shape[1] for l in m.layers), default=1),
                        max((l.shape[0] for l in m.layers), default=1))
    return scratch


def _resolve_host(host: str, m: Manifest) -> tuple[str, str]:
    """(where the blobs wait, why): ``auto`` chooses by the blobs' size and the host memory available."""
    if host != "auto":
        return host, "asked for"
    host, reason = choose_host(sum(b.nbytes for b in m.blocks))
    # reading from disk is much slower: a user who did not ask for it is told even without --verbose
    (log.warning if host == "disk" else log.info)("host auto: %s: %s.", host, reason)
    return host, reason


def _bind_all(s: Slab, rt: Runtime) -> None:
    """stream=False: every block's blob copied to the device once and bound there (no streamer)."""
    for b in s.manifest.blocks:
        blob = s.block_bytes(b.index).to(rt.device, copy=True)
        rt.device_blobs.append(blob)
        rt.binder.bind(b.index, -1, blob)


def _run_blocks_through(model: nn.Module, streamer: Streamer, rt: Runtime) -> None:
    """Each streamed block's forward goes through the streamer (acquire its slot, run, release)."""
    weakref.finalize(model, streamer.close)  # the disk reader thread and its file go with the model
    for b in rt.manifest.blocks:
        block = model.get_submodule(b.name)
        block.forward = BlockRunner(block, b.index, streamer, rt)
