"""Running a streamed block: acquire its slot, run the family's own forward, release the slot.

Without gradients (inference, or a forward with nothing to train) a block is simply streamed forward.
With gradients, the block runs inside :class:`_StreamedCheckpoint`, this runtime's own activation
checkpoint: the forward keeps only the block's inputs; the backward brings the block back into a slot
(the streamer prefetches in reverse order), recomputes it under the forward's autocast and RNG state,
and returns the input and LoRA gradients. Owning the checkpoint is what makes the reverse-order replay
visible to the streamer; torch's own checkpoint (and hooks on forward only) would replay blocks the
streamer had already evicted.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .attention_choice import mark_cudnn_failed, preferring_cudnn
from .block_graphs import uncached_autocast
from .graph_keys import autocast_state
from .streamer import BACKWARD, FORWARD, Streamer

log = logging.getLogger("squareq.runtime")

NEEDS_CHECKPOINTING = (
    "{model} streams its blocks through {slots} device slot(s), so a block's weights are gone by the time the "
    "backward needs them; turn gradient checkpointing on before training (model.enable_gradient_checkpointing() "
    "for diffusers models, model.gradient_checkpointing_enable() for transformers models; the backward then "
    "re-streams each block in reverse order), or run this forward under torch.no_grad()."
)


# True while a streamed block runs for a training step: its checkpointed forward runs without autograd, as inference
# does, and code that may only act at inference (runtime/flux_attention.py) has to tell the two apart
_TRAINING_PASS = contextvars.ContextVar("squareq_training_pass", default=False)


def in_training_pass() -> bool:
    """Whether a streamed block is running for a training step now (its forward, or its recompute and backward)."""
    return _TRAINING_PASS.get()


@contextlib.contextmanager
def training_pass(on: bool):
    """Mark what runs inside as a training step's pass (``on``) or not, for :func:`in_training_pass`."""
    token = _TRAINING_PASS.set(on)
    try:
        yield
    finally:
        _TRAINING_PASS.reset(token)


class BlockRunner:
    """Everything needed to run streamed block ``index``: its module, original forward and the streamer."""

    def __init__(self, module: nn.Module, index: int, streamer: Streamer, runtime) -> None:
        self.module = module
        self.index = index
        self.streamer = streamer
        self.runtime = runtime
        self.forward = type(module).forward.__get__(module)
        # Which tensor outputs carry no gradient (e.g. T5's position bias), per pattern of inputs needing grad
        # and number of trainable tensors; learned on the block's first training forward.
        self.constant_outputs: dict[tuple, set[int]] = {}

    @property
    def forward(self):
        """The block's forward as the runtime runs it (its own, or its compiled one), with the attention kernel
        the runtime prefers (runtime/attention_choice.py)."""
        return self._forward

    @forward.setter
    def forward(self, forward) -> None:
        self._forward = preferring_cudnn(forward, self.runtime)

    def trainable(self) -> list[torch.Tensor]:
        """The block's parameters that train (LoRA factors, ours or PEFT's, and DoRA magnitudes)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def in_slot(self, phase: str, training: bool):
        """Hold this block in a device slot for the duration (nothing to do for a block kept on the device); yields
        the slot's index (:data:`RESIDENT` for a block kept on the device), which names the addresses it reads."""
        # a probe times forward passes only: a training step's forward has the least compute per copied block, so
        # a ring that hides its copies hides the backward's too
        timer = self.runtime.block_timer if phase == FORWARD else None
        if self.index in self.runtime.resident_blocks:  # kept on the device (runtime/residency.py)
            slot = None
        else:
            slot = self.streamer.acquire(self.index, phase, training)
        try:
            with training_pass(training):
                if timer is not None:
                    timer.start(self.index)
                yield RESIDENT if slot is None else slot.index
                if timer is not None:
                    timer.stop(self.index)
        finally:
            if slot is not None:
                self.streamer.release(slot, phase)

    def __call__(self, *args, **kwargs):
        params = self.trainable() if torch.is_grad_enabled() else []
        flat, spec = tree_flatten((args, kwargs))
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        skeleton = [_TENSOR if isinstance(v, torch.Tensor) else v for v in flat]
        if not torch.is_grad_enabled() or not (params or any(t.requires_grad for t in tensors)):
            with self.in_slot(FORWARD, training=False) as slot:
                if self.runtime.graphs is None:
                    return self.forward(*args, **kwargs)
                return self.run_forward(slot, skeleton, spec, tensors)
        if not self.runtime.checkpointing:
            raise RuntimeError(NEEDS_CHECKPOINTING.format(model=self.runtime.class_name,
                                                          slots=len(self.streamer.slots)))
        box: dict[str, Any] = {}
        outs = _StreamedCheckpoint.apply(self, skeleton, spec, box, len(tensors), *tensors, *params)
        return _join(outs, box["parts"])

    def run_forward(self, slot: int, skeleton: list, spec, tensors: list[torch.Tensor]):
        """The block's own forward on ``tensors`` (put back into its arguments by ``skeleton`` and ``spec``), replayed
        from its CUDA graph for ``slot`` when the runtime keeps graphs (runtime/block_graphs.py)."""
        graphs = self.runtime.graphs
        device_type = self.streamer.device.type
        key = None if graphs is None else self.graph_key(FORWARD, slot, skeleton, spec, autocast_state(device_type),
                                                         tensors)
        if key is None:
            args, kwargs = _rebuild(skeleton, spec, tensors)
            return self.forward(*args, **kwargs)

        uncached = _uncached_before_capture(self.runtime)

        def run(values: list[torch.Tensor], capturing: bool):
            args, kwargs = _rebuild(skeleton, spec, values)
            with uncached_autocast(device_type) if capturing or uncached else contextlib.nullcontext():
                return _split(self.forward(*args, **kwargs))

        return _join(*graphs.call(key, tensors, run))

    def graph_key(self, phase: str, slot: int, skeleton: list, spec, extra: tuple, tensors: list[torch.Tensor]):
        """The runtime's CUDA-graph key for this block called with these arguments (None: run it eagerly)."""
        layout = tuple(v is _TENSOR for v in skeleton)
        values = tuple(v for v in skeleton if v is not _TENSOR)
        return self.runtime.graphs.key(phase, self.index, slot, spec, layout, values, extra, tensors, self.module)


_TENSOR = object()  # marks where a tensor argument goes back into a flattened call
RESIDENT = -1  # the slot "index" of a block kept on the device


def _split(out) -> tuple[list[torch.Tensor], tuple]:
    """A block's output as its tensors and what puts them back in place (:func:`_join`); the parts hold no tensor."""
    leaves, spec = tree_flatten(out)
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    return [leaves[i] for i in where], (spec, [None if isinstance(v, torch.Tensor) else v for v in leaves], where)


def _join(tensors, parts: tuple):
    """The output :func:`_split` took apart, with ``tensors`` in its tensors' places."""
    spec, leaves, where = parts
    leaves = list(leaves)
    for i, t in zip(where, tensors, strict=True):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _rebuild(skeleton: list, spec, tensors) -> tuple[tuple, dict]:
    flat, it = list(skeleton), iter(tensors)
    for i, v in enumerate(skeleton):
        if v is _TENSOR:
            flat[i] = next(it)
    args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs


class _AmpState:
    """The autocast state of the forward, re-entered for the recompute in the backward."""

    def __init__(self, device_type: str) -> None:
        self.states = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                       for dt in dict.fromkeys((device_type, "cpu"))]
        self.cache = torch.is_autocast_cache_enabled()
        self.key = (tuple(self.states), self.cache)

    @contextlib.contextmanager
    def restore(self, cache: bool = True):
        """The forward's autocast; ``cache=False`` turns its cast cache off (for a CUDA graph capture)."""
        with contextlib.ExitStack() as stack:
            for dt, enabled, dtype in self.states:
                stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache and cache))
            yield


class _RngState:
    """CPU and device RNG state at the forward, so a recompute draws the same random numbers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restore(self):
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def disable_cudnn_attention(what: str) -> bool:
    """Turn torch's cuDNN attention backend off for this process after it failed (``what`` says how), saying so
    once. Returns whether it was on, i.e. whether redoing the work can now give another result."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    mark_cudnn_failed()  # and the blocks stop preferring it (runtime/attention_choice.py)
    # A compiled block (runtime/block_compile.py) fixed its attention kernel when it was compiled, and Dynamo does not
    # guard on the backend switches: drop the compiled code, so the next calls compile without cuDNN. The on-disk
    # caches do not key on them either (a second compile of the same graph with other switches is a cache hit), so
    # this process stops reading them.
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    log.warning("the cuDNN attention backward %s on this GPU; SquareQ turned the cuDNN attention backend off for "
                "this process and redid the work with the flash/efficient kernels, so training goes on.", what)
    return True


def retry_without_cudnn(device: torch.device) -> bool:
    """Non-finite gradients on a GPU with cuDNN attention on: on some driver/cuDNN builds its backward returns
    NaN/Inf without raising. Turn it off (said once) and report whether the work is worth redoing."""
    return device.type == "cuda" and disable_cudnn_attention("returned NaN/Inf gradients")


def _is_cudnn_attention_failure(exc: BaseException) -> bool:
    text = str(exc)
    return "mha_graph" in text or ("cudnn" in text.lower() and "attention" in text.lower())


class _StreamedCheckpoint(torch.autograd.Function):
    """A block's forward without saved activations; its backward re-streams and recomputes it."""

    @staticmethod
    def forward(ctx, runner: BlockRunner, skeleton, spec, box, n_inputs: int, *tensors):
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.runner, ctx.skeleton, ctx.spec, ctx.n_params = runner, skeleton, spec, len(params)
        ctx.amp = _AmpState(runner.streamer.device.type)
        ctx.rng = _RngState(runner.streamer.device)
        offload = runner.runtime.activation_offload  # the inputs that carry a gradient wait in host memory
        moved = [i for i, t in enumerate(inputs) if offload.wanted(t)] if offload is not None else []
        ctx.offloaded = (moved, offload.put([inputs[i] for i in moved])) if moved else None
        ctx.save_for_backward(*[t for i, t in enumerate(inputs) if i not in moved])
        key = (tuple(t.requires_grad for t in inputs), len(params))
        constant = runner.constant_outputs.get(key)
        with runner.in_slot(FORWARD, training=True) as slot:
            if constant is None:
                out = _forward_learning_constants(runner, skeleton, spec, inputs, key)
                constant = runner.constant_outputs[key]
            else:  # detached: without autograd recording only a compiled block's guards would see requires_grad
                out = runner.run_forward(slot, skeleton, spec, [t.detach() for t in inputs])
        outs, box["parts"] = _split(out)
        outs = tuple(outs)
        # An output the recompute would not connect to any input or LoRA factor must not look differentiable
        # to the next block, or its backward would grow a branch the resident model does not have.
        ctx.mark_non_differentiable(*[t for i, t in enumerate(outs) if i in constant or not t.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        runner = ctx.runner
        saved = list(ctx.saved_tensors)
        if ctx.offloaded is not None:  # back from the host, in their places among the inputs
            moved, key = ctx.offloaded
            for i, t in zip(moved, runner.runtime.activation_offload.take(key), strict=True):
                saved.insert(i, t)
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        params = runner.trainable()
        if len(params) != ctx.n_params:
            raise RuntimeError(f"block {runner.index}'s trainable LoRA parameters changed between its forward and "
                               "backward; add or freeze LoRA layers only between training steps.")
        try:
            grads = _recompute_grads(ctx, runner, inputs, params, grad_outs)
        except RuntimeError as exc:
            if not (_is_cudnn_attention_failure(exc) and
                    disable_cudnn_attention(f"failed ({str(exc).splitlines()[0][:200]})")):
                raise
            grads = _recompute_grads(ctx, runner, inputs, params, grad_outs)
        wanted = [t for t in inputs if t.requires_grad]
        input_grads = iter(grads[: len(wanted)])
        per_input = [next(input_grads) if t.requires_grad else None for t in inputs]
        return (None, None, None, None, None, *per_input, *grads[len(wanted):])


@contextlib.contextmanager
def _parameters_as_fresh_leaves(module: nn.Module, params: list[torch.Tensor]):
    """Inside, ``module`` uses a new leaf on the same storage in place of each of ``params``; yields those leaves.

    Why: the step's autograd graph keeps each parameter's gradient accumulator alive, made on the stream of the
    forward. A CUDA-graph capture on another stream that fed it would make that stream wait on the capturing one,
    which CUDA refuses. A fresh leaf gets its accumulator where it is first used, and its gradient is the
    parameter's."""
    # Parameters, as the ones they stand for: a compiled block's graphs guard on the type
    leaves = {id(p): nn.Parameter(p.detach()) for p in params}
    swapped = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if id(p) in leaves]
    try:
        for m, name, p in swapped:
            m._parameters[name] = leaves[id(p)]
        yield [leaves[id(p)] for p in params]
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


def _forward_learning_constants(runner: BlockRunner, skeleton, spec, inputs, key):
    """Run the block once with autograd recording (saved tensors discarded, so memory is that of a no-grad
    forward) to learn which tensor outputs carry no gradient; return its outputs, detached. A compiled block runs it
    with autocast's cast cache as its recompute has it, so the two share their compiled graphs."""
    uncached = uncached_autocast(runner.streamer.device.type) if _uncached_before_capture(runner.runtime) \
        else contextlib.nullcontext()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda _: None), uncached:
        args, kwargs = _rebuild(skeleton, spec, [t.detach().requires_grad_(t.requires_grad) for t in inputs])
        out = runner.forward(*args, **kwargs)
    leaves, out_spec = tree_flatten(out)
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    runner.constant_outputs[key] = {i for i, t in enumerate(tensors) if not t.requires_grad}
    return tree_unflatten([v.detach() if isinstance(v, torch.Tensor) else v for v in leaves], out_spec)


def _recompute_grads(ctx, runner: BlockRunner, inputs, params, grad_outs):
    """The block's input and LoRA gradients: it is brought back into a slot and recomputed, eagerly or by replaying
    its CUDA graph for that slot (runtime/block_graphs.py)."""
    with torch.enable_grad(), ctx.rng.restore(), runner.in_slot(BACKWARD, training=True) as slot:
        graphs, key = runner.runtime.graphs, None
        given = [g for g in grad_outs if g is not None]
        if graphs is not None:
            extra = (ctx.amp.key, tuple(g is None for g in grad_outs), len(params))
            key = runner.graph_key(BACKWARD, slot, ctx.skeleton, ctx.spec, extra, [*inputs, *given])

        uncached = _uncached_before_capture(runner.runtime)

        def run(values: list[torch.Tensor], capturing: bool):
            it = iter(values[len(inputs):])
            full = [None if g is None else next(it) for g in grad_outs]
            grads = _grads_of_recompute(ctx, runner, values[: len(inputs)], params, full,
                                        cache=not (capturing or uncached),
                                        fresh_leaves=key is not None)
            return grads, None

        if key is None:
            return run([*inputs, *given], False)[0]
        return graphs.call(key, [*inputs, *given], run)[0]


def _uncached_before_capture(runtime) -> bool:
    """Whether a graphed block's eager runs before its capture also run with autocast's cast cache off, as the
    capture must: under ``torch.compile`` (runtime/block_compile.py) the cache's state is among the compiled graphs'
    guards, so a capture with another state would compile again inside the capture, which cannot work."""
    return getattr(runtime, "compiled", False)


def _grads_of_recompute(ctx, runner: BlockRunner, inputs, params, grad_outs, cache: bool = True,
                        fresh_leaves: bool = False):
    # The forward saw these inputs as non-leaf tensors (outputs of the previous block). A detached input that
    # requires grad is a leaf, and autocast caches its casts to bf16 (one cast shared by every use) where the
    # forward made one cast per use; the gradients would then be summed in another dtype and order. A view is
    # not a leaf, so the recompute builds exactly the forward's graph.
    leaves = _parameters_as_fresh_leaves(runner.module, params) if fresh_leaves else contextlib.nullcontext(params)
    with ctx.amp.restore(cache), leaves as params:  # the forward's autocast; its backward, like any, runs without
        wanted = [t for t in inputs if t.requires_grad] + list(params)
        args, kwargs = _rebuild(ctx.skeleton, ctx.spec, [t.view_as(t) if t.requires_grad else t for t in inputs])
        out = runner.forward(*args, **kwargs)
    outs = [v for v in tree_flatten(out)[0] if isinstance(v, torch.Tensor)]
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad and g is not None]
    if not pairs or not wanted:
        return [None] * len(wanted)
    return list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
