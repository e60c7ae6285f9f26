"""Running a block on a few calibration samples at a time, whatever the model's forward passes its blocks.

A block's activations grow with the samples it sees at once: on a 12B FLUX block the 32 calibration samples took
7.4 GB beyond the block itself, and FLUX.2's blocks are 2.8x larger. The compiler's passes therefore run each block
on *chunks* of samples and join the outputs. To split a block's arguments it must know which of them carry the batch
axis (hidden states, temb) and which do not (rotary embeddings, whose first axis is the token count and may equal
the batch size by chance). :func:`probe_batch_axes` finds out once per compile, exactly, by running the model's own
forward on the meta device (no data, no memory) at two batch sizes and recording which tensors every block call
receives and returns change with it.

The chunk size depends only on the model and the calibration data (about :data:`CHUNK_BYTES` of block input per
chunk), never on the VRAM budget: every chunking is the same arithmetic on every budget, so a tight budget builds
the same slab (docs/compiler.md, "Compiling within a VRAM budget").
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import spill

# Block input bytes (float32) per chunk: FLUX.1 at 512 px gets 3 samples (19 MB each: 1,536 tokens x 3,072), FLUX.2
# one, a 128-token text model hundreds.
CHUNK_BYTES = 64 << 20
# Block input bytes (float32) of the probe copies in one effects pass (compiler/effect.py)
EFFECT_PASS_BYTES = 640 << 20


@dataclass(frozen=True)
class CallAxes:
    """For one block call: whether each tensor among its arguments and among its outputs (in ``tree_flatten`` order)
    has the batch axis first."""

    inputs: tuple[bool, ...]
    outputs: tuple[bool, ...]
    sample_bytes: int  # float32 bytes per sample of the batched floating inputs
    tape_bytes: int = 0  # float32 bytes per sample of the distinct inputs its linear layers read
    # bytes of each tensor among its arguments and among its outputs (per sample for a batched one; floating ones
    # as float32) and float32 bytes per sample of each distinct input its linear layers read: the host plan counts
    # the pinned copies one by one, as the pinned allocator rounds each up to a power of two (runtime/host/budget.py)
    input_bytes: tuple[int, ...] = ()
    output_bytes: tuple[int, ...] = ()
    tape_inputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class BatchAxes:
    """The block calls of one forward pass, in order, and how many samples a chunk holds (None: the whole batch at
    once, with ``why``)."""

    calls: tuple[tuple[int, CallAxes], ...] = ()
    chunk_samples: int | None = None
    why: str = ""

    @property
    def replay_samples(self) -> int | None:
        """Samples per chunk of the effects pass's replays: a third of :attr:`chunk_samples` (a replay holds its
        activations and their gradients, several times a forward's)."""
        return max(1, self.chunk_samples // 3) if self.chunk_samples else None

    def probes_per_pass(self, held: int, probes: int) -> int:
        """Probe copies of the ``held`` held-out samples in one effects pass: about :data:`EFFECT_PASS_BYTES` of
        block input (FLUX.1 at 512 px: all 4, FLUX.2: 2), since that pass keeps its hidden states and their
        gradients for all of them at once."""
        per_probe = held * max((c.sample_bytes for _, c in self.calls), default=0)
        return max(1, min(probes, EFFECT_PASS_BYTES // max(per_probe, 1)))

    def cursor(self) -> AxesCursor:
        """A fresh walk over the calls of one forward pass."""
        return AxesCursor(self)

    def ranges(self, samples: int, step: int | None = None) -> list[tuple[int, int]]:
        """The chunks of a batch of ``samples``: ``[(start, stop), ...]`` (``step`` samples each, by default
        :attr:`chunk_samples`)."""
        step = step or self.chunk_samples or samples
        return [(s, min(s + step, samples)) for s in range(0, samples, max(step, 1))]


class AxesCursor:
    """Hands out each block call's :class:`CallAxes` in the order the probe saw them (None once the pass differs)."""

    def __init__(self, axes: BatchAxes) -> None:
        self.axes, self.position = axes, 0

    def next(self, index: int) -> CallAxes | None:
        calls = self.axes.calls
        if self.axes.chunk_samples is None or self.position >= len(calls) or calls[self.position][0] != index:
            return None
        self.position += 1
        return calls[self.position - 1][1]


def batched_kwargs(kwargs: Mapping, other: Mapping | None, samples: int) -> set[str]:
    """The forward keyword arguments that carry the batch axis (dotted names inside dicts, e.g.
    ``added_cond_kwargs.time_ids``): tensors whose first axis differs from the same argument of ``other`` (the
    held-out batch), or, without one, whose first axis is ``samples``; lists of one tensor per sample (Z-Image)."""
    names = set()
    for name, value in kwargs.items():
        ref = other.get(name) if isinstance(other, Mapping) else None
        if isinstance(value, Mapping):
            names |= {f"{name}.{n}" for n in batched_kwargs(value, ref, samples)}
        elif isinstance(value, list) and len(value) == samples and all(torch.is_tensor(v) for v in value):
            names.add(name)
        elif torch.is_tensor(value) and value.dim():
            if torch.is_tensor(ref) and ref.dim() == value.dim():
                if ref.shape[0] != value.shape[0]:
                    names.add(name)
            elif value.shape[0] == samples:
                names.add(name)
    return names


def map_batched(kwargs: Mapping, batched: set[str], tensor_fn: Callable, list_fn: Callable, other_fn=lambda v: v,
                prefix: str = "") -> dict:
    """``kwargs`` with each batched tensor passed through ``tensor_fn``, each batched per-sample list through
    ``list_fn``, every other tensor through ``other_fn`` (dicts are walked)."""
    out = {}
    for name, value in kwargs.items():
        full = prefix + name
        if isinstance(value, Mapping):
            out[name] = map_batched(value, batched, tensor_fn, list_fn, other_fn, full + ".")
        elif full in batched:
            out[name] = list_fn(value) if isinstance(value, list) else tensor_fn(value)
        else:
            out[name] = other_fn(value) if torch.is_tensor(value) else value
    return out


def _meta_kwargs(kwargs: Mapping, batched: set[str], samples: int) -> dict:
    meta = lambda shape, v: torch.empty(shape, dtype=v.dtype, device="meta")  # noqa: E731
    return map_batched(kwargs, batched, lambda v: meta((samples, *v.shape[1:]), v),
                       lambda vs: [meta(v.shape, v) for v in vs[:1] * samples], lambda v: meta(v.shape, v))


def probe_batch_axes(source, kwargs: Mapping, batched: set[str], samples: int,
                     chunk_bytes: int | None = None) -> BatchAxes:
    """Run ``source``'s forward on the meta device at batch sizes 2 and 3 and record, for every block call, which
    tensors change with the batch size. Any failure (an operation without a meta kernel, a forward that reads
    values) means no chunking, with the reason."""
    if samples < 2:
        return BatchAxes(why="one sample")
    seen: dict[int, list] = {2: [], 3: []}
    templates = source.skeleton().to("meta")  # buffers a class builds on the host (rotary tables) too

    def run(index, path, args, kw):
        block = templates.get_submodule(path)
        with _LinearInputs(block, batch) as tape:
            out = block(*args, **kw)
        seen[batch].append((index, _shapes((args, kw)), _shapes(out), tape.inputs))
        return out

    try:
        shell = source.shell(run, "meta").to("meta")
        for batch in (2, 3):
            with torch.no_grad():
                shell(**_meta_kwargs(kwargs, batched, batch))
    except Exception as exc:  # noqa: BLE001 - any op the meta device cannot run: fall back to whole batches
        return BatchAxes(why=f"the model's forward does not run on the meta device ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:100]})")
    if len(seen[2]) != len(seen[3]) or not seen[2]:
        return BatchAxes(why="the model calls its blocks differently at different batch sizes")
    calls = []
    for (i2, in2, out2, tape2), (i3, in3, out3, _) in zip(seen[2], seen[3]):
        if i2 != i3 or len(in2) != len(in3) or len(out2) != len(out3):
            return BatchAxes(why="the model calls its blocks differently at different batch sizes")
        inputs = tuple(_scales(a, b) for a, b in zip(in2, in3))
        outputs = tuple(_scales(a, b) for a, b in zip(out2, out3))
        pairs = list(zip(in2, in3, inputs)) + list(zip(out2, out3, outputs))
        if any(a[0] != b[0] and not batched_leaf for a, b, batched_leaf in pairs):
            return BatchAxes(why="a block argument carries the batch on an axis other than the first")
        per_sample = sum(4 * math.prod(s[1:]) for (s, fl, _), batched_leaf in zip(in2, inputs) if batched_leaf and fl)
        calls.append((i2, CallAxes(inputs, outputs, per_sample, sum(tape2), _bytes(in2, inputs),
                                   _bytes(out2, outputs), tuple(tape2))))
    largest = max(c.sample_bytes for _, c in calls)
    return BatchAxes(tuple(calls), max(1, (chunk_bytes or CHUNK_BYTES) // max(largest, 1)))


class _LinearInputs:
    """Counts the float32 bytes per sample of the distinct inputs a block's linear layers read (meta tensors)."""

    def __init__(self, block: torch.nn.Module, batch: int) -> None:
        self.block, self.batch, self.inputs, self.handles = block, batch, [], []
        self.seen: dict[int, torch.Tensor] = {}  # holding the inputs keeps their ids from being reused

    def __enter__(self) -> _LinearInputs:
        self.handles = [m.register_forward_pre_hook(self._hook) for m in self.block.modules()
                        if isinstance(m, torch.nn.Linear)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, module, args) -> None:
        x = args[0]
        if id(x) not in self.seen:
            self.seen[id(x)] = x
            per = x.numel() // self.batch if x.dim() and x.shape[0] == self.batch else x.numel()
            self.inputs.append(4 * per)


def _shapes(tree) -> list[tuple[tuple[int, ...], bool, int]]:
    """(shape, floating, bytes per element as the compile holds it: 4 for a floating one) of each tensor leaf."""
    leaves, _ = tree_flatten(tree)
    return [(tuple(x.shape), x.is_floating_point(), 4 if x.is_floating_point() else x.element_size())
            for x in leaves if torch.is_tensor(x)]


def _bytes(shapes, batched: tuple[bool, ...]) -> tuple[int, ...]:
    """Bytes of each tensor of ``shapes``, per sample for a batched one."""
    return tuple(size * math.prod(s[1:] if b else s) for (s, _, size), b in zip(shapes, batched))


def _scales(a, b) -> bool:
    (sa, _, _), (sb, _, _) = a, b
    return len(sa) > 0 and sa[0] == 2 and sb[0] == 3 and sa[1:] == sb[1:]


def call_batch(leaves, call: CallAxes | None) -> int | None:
    """The batch size of a block call: the first axis of its first batched tensor (None when not chunked)."""
    if call is None:
        return None
    flags = iter(call.inputs)
    return next((x.shape[0] for x in leaves if torch.is_tensor(x) and next(flags)), None)


def run_chunked(fn: Callable, args, kwargs, axes: CallAxes | None, ranges: list[tuple[int, int]],
                each: Callable[[int, int], object] | None = None):
    """``fn(*args, **kwargs)`` computed chunk by chunk over ``ranges`` of the batch and joined, or in one call when
    ``axes`` is None. ``each(start, stop)``, when given, is a context manager entered around each chunk's call."""
    if axes is None or len(ranges) <= 1:
        start, stop = ranges[0] if ranges else (0, 0)
        return _call(fn, args, kwargs, each, start, stop)
    leaves, spec = tree_flatten((args, kwargs))
    outs = []
    for start, stop in ranges:
        part = split_leaves(leaves, axes.inputs, start, stop)
        a, kw = tree_unflatten(part, spec)
        outs.append(_call(fn, a, kw, each, start, stop))
    return join_outputs(outs, axes.outputs)


def _call(fn, args, kwargs, each, start, stop):
    if each is None:
        return fn(*args, **kwargs)
    with each(start, stop):
        return fn(*args, **kwargs)


def split_leaves(leaves: list, batched: tuple[bool, ...], start: int, stop: int) -> list:
    """``leaves`` (of ``tree_flatten``) with the batched tensors cut to samples ``[start, stop)``."""
    it = iter(batched)
    return [x[start:stop] if torch.is_tensor(x) and next(it) else x for x in leaves]


def join_outputs(outs: list, batched: tuple[bool, ...]):
    """The chunks' outputs as one: batched tensors concatenated along the batch axis (spilled ones joined as one
    spilled tensor, read back when consumed), the others taken from the first chunk."""
    flat = [tree_flatten(o) for o in outs]
    spec = flat[0][1]
    columns = list(zip(*[leaves for leaves, _ in flat]))
    it = iter(batched)
    joined = [(spill.join(col) if any(spill.is_spilled(c) for c in col) else torch.cat(col))
              if (torch.is_tensor(col[0]) or spill.is_spilled(col[0])) and next(it) else col[0] for col in columns]
    return tree_unflatten(joined, spec)
