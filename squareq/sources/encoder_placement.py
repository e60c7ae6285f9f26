"""Where the cache's encoders run: whole on the GPU when they fit the run's VRAM budget, else the largest text
encoders streamed block by block (``squareq.runtime.stream_module``), the rest whole.

The budget is the run's ``vram_budget`` (``--vram-budget``), or what the device has free. What the encoders need is
counted from the loaded modules (their bytes in the dtype they run in) plus a workspace for their activations: the
text encoders' hidden states and logits for a batch of captions, and the VAE's feature maps for one image. A streamed
encoder needs its tensors outside the block list (embeddings, heads, a vision tower) and ``prefetch`` blocks. When
even streaming every text encoder does not fit, one sentence names the smallest budget that does.

A streamed encoder's blocks wait in host memory in one of two ways, chosen within the run's host budget: packed
once into page-locked memory (the whole encoder pinned, fastest), or, where that does not fit, packed on demand from
the encoder's own tensors (its weights file's pages, runtime/module_stream.py's ``host="ring"``) into a few
page-locked buffers. What the encoders hold on the host is counted too: those pinned blocks, the ring, and the copy a
library makes of an encoder it cannot map from its file (sources/encoder_files.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..devices import allocator_cap
from ..runtime import release_module, stream_module
from ..runtime.module_stream import RING_STAGES, blob_bytes, largest_block_list
from ..sizes import format_size, format_size_up
from .encoder_source import EncoderError
from .vae_memory import can_tile, vae_workspace

TEXT_BATCH = 8  # captions per encoder call (EmbeddingCache.fill's batch)
STREAM_PREFETCH = 2  # device slots of a streamed encoder
# what any CUDA program reserves beside its tensors (cuBLAS workspace, the allocator's rounding)
FIXED = 512 << 20


@dataclass(frozen=True)
class EncoderRun:
    """What the encoders are placed for: the budget (None: what the device has free), the caption length and the
    largest image's pixels, and the flag or key that set the budget (for messages)."""

    budget: int | None = None
    tokens: int = 512
    pixels: int = 1024 * 1024
    flag: str = "vram_budget"
    host_budget: int | None = None  # bytes the encoders may hold in host memory (None: no limit)
    host_flag: str = "host_budget"  # the flag or key that set it, for messages
    frames: int = 1  # the frames of the longest clip window (a video family's VAE encodes them at once or in chunks)


DEFAULT_RUN = EncoderRun()


class PlacementError(EncoderError):
    """The encoders cannot run within the budget, even streamed."""


@dataclass(frozen=True)
class Placement:
    """The encoders' placement: which run whole on the device and which stream, and what each needs there."""

    budget: int | None
    sizes: dict[str, int]  # each encoder's bytes in its run dtype
    streamed_sizes: dict[str, int]  # a streamed encoder's bytes on the device: outside its blocks + prefetch blocks
    workspace: int
    streamed: tuple[str, ...] = ()
    device: str = "cpu"
    names: dict[str, str] = field(default_factory=dict)  # component -> class name, for the log
    ring: tuple[str, ...] = ()  # streamed encoders packed on demand from their files' pages, not pinned whole
    pinned_sizes: dict[str, int] = field(default_factory=dict)  # a streamed encoder's blocks, pinned whole
    ring_sizes: dict[str, int] = field(default_factory=dict)  # its ring of page-locked buffers
    copies: dict[str, int] = field(default_factory=dict)  # host copies the libraries make on load (encoder_files)
    vae_tiled: bool = False  # the VAE splits frames into tiles (sources/vae_memory.py): whole ones do not fit

    def host_part(self, name: str) -> int:
        """What encoder ``name`` holds in host memory at most: its copy, beside its ring; or, pinned whole, the
        larger of its copy and its pinned blocks (packing frees the copy block by block as the blocks move in)."""
        copy = self.copies.get(name, 0)
        if name not in self.streamed:
            return copy
        if name in self.ring:
            return copy + self.ring_sizes[name]
        return max(copy, self.pinned_sizes[name])

    @property
    def host_expected(self) -> int:
        """What the encoders hold in host memory at most."""
        return sum(self.host_part(n) for n in self.sizes)

    @property
    def expected(self) -> int:
        return sum(self.streamed_sizes[n] if n in self.streamed else s for n, s in self.sizes.items()) \
            + self.workspace + FIXED

    def describe(self) -> str:
        """One line for the log: the choice and why."""
        whole = sum(self.sizes.values()) + self.workspace + FIXED
        parts = ", ".join(f"{n} ({self.names.get(n, n)}) {format_size(s)}" for n, s in self.sizes.items())
        if self.budget is None:
            return f"encoders on {self.device}, whole: {parts}; with activations {format_size(whole)}."
        budget = f"the budget {format_size(self.budget)}"
        tiles = "; the VAE encodes in tiles, since whole frames do not fit" if self.vae_tiled else ""
        if not self.streamed:
            return (f"encoders on {self.device}, whole: {parts}; with activations {format_size(whole)}, within {budget}"
                    f"{tiles}.")
        streamed = ", ".join(f"{n} ({format_size(self.streamed_sizes[n])} on the device at a time, "
                             + (f"from its file through {format_size(self.ring_sizes[n])} of page-locked buffers)"
                                if n in self.ring else f"from {format_size(self.pinned_sizes[n])} of page-locked "
                                "host memory)") for n in self.streamed)
        return (f"encoders on {self.device}: {parts}; whole they need {format_size(whole)} with activations, more than "
                f"{budget}, so {streamed} stream block by block{tiles}; expected peak {format_size(self.expected)}.")

    def record(self) -> dict:
        """What the cache keeps beside the entries' identity (EmbeddingCache.record_encoders)."""
        return {"device": self.device, "budget_bytes": self.budget, "streamed": list(self.streamed),
                "bytes": dict(self.sizes), "expected_peak_bytes": self.expected, "ring": list(self.ring),
                "host_bytes": self.host_expected, "vae_tiled": self.vae_tiled}


def module_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s tensors once its floating ones are cast to ``dtype``."""
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


def streamed_bytes(module: nn.Module, dtype: torch.dtype, prefetch: int = STREAM_PREFETCH) -> int:
    """Device bytes of ``module`` streamed: everything outside its largest block list, and ``prefetch`` blocks."""
    blocks = list(module.get_submodule(largest_block_list(module)))
    per_block = [module_bytes(b, dtype) for b in blocks]
    return module_bytes(module, dtype) - sum(per_block) + prefetch * max(per_block)


def host_copies(parts: Mapping[str, nn.Module], mapped: Mapping[str, torch.dtype], run_dtype: torch.dtype,
                device: torch.device) -> dict[str, int]:
    """Bytes of host memory each loaded component holds as a copy of its own: none for a text encoder in
    ``mapped`` (its file's pages; on a CPU, where the whole encoders run from host memory, only if its file is in
    ``run_dtype`` already), its size in ``run_dtype`` for the rest (cast on load; diffusers reads the VAE into
    memory)."""
    views = {n for n, d in mapped.items() if device.type != "cpu" or d == run_dtype}
    return {n: 0 if n in views else module_bytes(m, run_dtype) for n, m in parts.items()}


def block_bytes(module: nn.Module, dtype: torch.dtype) -> list[int]:
    """Each block's blob bytes in ``dtype`` (runtime/module_stream.py), of ``module``'s largest block list."""
    return [blob_bytes(b, dtype) for b in module.get_submodule(largest_block_list(module))]


def _streamable(module: nn.Module) -> bool:
    try:
        largest_block_list(module)
    except ValueError:
        return False
    return True


def _text_config(module: nn.Module):
    config = getattr(module, "config", None)
    return getattr(config, "text_config", None) or config


def text_workspace(module: nn.Module, tokens: int, dtype: torch.dtype, batch: int = TEXT_BATCH) -> int:
    """Activation bytes of one caption batch through a text encoder: every layer's hidden states (the pipelines ask
    for them), the MLP's widest intermediate twice, and the logits where the model has a language-model head (the
    pipelines read hidden states, but the model's forward computes them)."""
    cfg = _text_config(module)
    first = lambda *names: next((int(v) for v in (getattr(cfg, n, None) for n in names) if v), 0)  # noqa: E731
    hidden = first("d_model", "hidden_size")
    layers = first("num_layers", "num_hidden_layers")
    ffn = first("d_ff", "intermediate_size")
    head = getattr(module, "get_output_embeddings", lambda: None)()
    vocab = first("vocab_size") if head is not None else 0
    rows = batch * tokens
    return rows * dtype.itemsize * (hidden * (layers + 4) + 2 * ffn + vocab)


def plan_placement(parts: dict[str, nn.Module], budget: int | None, device: torch.device, dtype: torch.dtype,
                   tokens: int, pixels: int, flag: str = "vram_budget", frames: int = 1) -> Placement:
    """Whole on ``device`` when everything fits ``budget`` (None: no limit); else stream the largest streamable text
    encoders, one at a time, until it fits; and where even that does not, the VAE in tiles (sources/vae_memory.py).
    ``parts``: component name -> module (``vae`` is never streamed); ``pixels`` × ``frames``: the largest entry."""
    sizes = {n: module_bytes(m, dtype) for n, m in parts.items()}
    texts = {n: m for n, m in parts.items() if n != "vae"}
    text = max([text_workspace(m, tokens, dtype) for m in texts.values()], default=0)
    vae = parts.get("vae")
    streamed_sizes = {n: streamed_bytes(m, dtype) for n, m in texts.items() if _streamable(m)}
    # only encoders with more blocks than slots save memory streamed
    streamable = sorted((n for n, b in streamed_sizes.items() if b < sizes[n]), key=lambda n: -sizes[n])
    names = {n: type(m).__name__ for n, m in parts.items()}
    placement = None
    for tiled in (False, True) if vae is not None and can_tile(vae) else (False,):
        workspace = text + (vae_workspace(vae, pixels, frames, tiled) if vae is not None else 0)
        for i in range(len(streamable) + 1):
            placement = Placement(budget, sizes, streamed_sizes, workspace, tuple(streamable[:i]), str(device), names,
                                  vae_tiled=tiled)
            if budget is None or placement.expected <= budget:
                return placement
    raise PlacementError(
        f"{flag} {format_size(budget)} cannot hold the cache's encoders even with "
        f"{' and '.join(streamable) or 'nothing'} streamed block by block: "
        + ", ".join(f"{n} {format_size(placement.streamed_sizes.get(n, s) if n in placement.streamed else s)}"
                    for n, s in sizes.items())
        + f" and {format_size(workspace)} of activations need {format_size(placement.expected)}; give {flag} at least "
        f"{format_size_up(placement.expected)}, or cache on a larger card with `squareq cache`.")


def plan_host(placement: Placement, parts: dict[str, nn.Module], dtype: torch.dtype, budget: int | None,
              copies: dict[str, int]) -> Placement:
    """Where ``placement``'s streamed encoders wait on the host within ``budget`` (None: no limit), the largest
    first: pinned whole while that fits beside ``copies`` (what the libraries copy on load), else through a ring of
    page-locked buffers from the encoder's own tensors. The result may still be over ``budget``
    (:func:`check_host` refuses it)."""
    blocks = {n: block_bytes(parts[n], dtype) for n in placement.streamed}
    pinned = {n: sum(b) for n, b in blocks.items()}
    rings = {n: RING_STAGES * max(b) for n, b in blocks.items()}
    placement = dataclasses.replace(placement, pinned_sizes=pinned, ring_sizes=rings, copies=dict(copies), ring=())
    for name in sorted(placement.streamed, key=lambda n: -pinned[n]):
        if budget is None or placement.host_expected <= budget:
            break
        if rings[name] < pinned[name]:  # an encoder of RING_STAGES blocks or fewer stays pinned: a ring saves nothing
            placement = dataclasses.replace(placement, ring=placement.ring + (name,))
    return placement


def every_streamed(placement: Placement) -> Placement:
    """``placement`` with every text encoder that streaming makes smaller on the device streamed, the largest
    first."""
    streamed = sorted((n for n, b in placement.streamed_sizes.items() if b < placement.sizes[n]),
                      key=lambda n: -placement.sizes[n])
    return dataclasses.replace(placement, streamed=tuple(streamed))


def check_host(placement: Placement, budget: int | None, flag: str = "host_budget") -> None:
    """Refuse, in one sentence naming the smallest budget that works, encoders over ``budget`` in host memory even
    with every streamed one read through its ring."""
    if budget is None or placement.host_expected <= budget:
        return
    parts = ", ".join(f"{n} {format_size(placement.host_part(n))}" for n in placement.sizes if placement.host_part(n))
    short = format_size_up(placement.host_expected - budget)
    how = (f"even with {' and '.join(placement.ring)} read from their files through page-locked rings"
           if placement.ring else "as loaded")
    raise PlacementError(
        f"{flag} leaves {format_size(budget)} of host memory for the VAE and text encoders beside the rest of the "
        f"run, and {how} they hold {format_size(placement.host_expected)} ({parts}); give {flag} {short} more, or "
        "free that much memory.")


@contextlib.contextmanager
def placed(owner, names, device: torch.device, dtype: torch.dtype, run: EncoderRun,
           mapped: Mapping[str, torch.dtype] | None = None) -> Iterator[Placement]:
    """Plan the placement of ``owner``'s components ``names`` (a pipeline's ``vae``, ``text_encoder``, ...; missing
    ones skipped) for ``run`` and apply it: whole ones moved to ``device`` in ``dtype``, streamed ones streamed
    (pinned whole, or through a ring where ``run.host_budget`` says so). ``mapped``: the components loaded as views
    of their files (no host copy of their own). On exit the streamed ones' host blobs and device slots are released
    now, not at a later garbage collection (training needs the memory), also after an error half-way through."""
    parts = {n: getattr(owner, n) for n in names if getattr(owner, n, None) is not None}
    placement = plan_placement(parts, run_budget(run.budget, device), device, dtype, run.tokens, run.pixels,
                               run.flag, run.frames)
    placement = plan_host(placement, parts, dtype, run.host_budget, host_copies(parts, mapped or {}, dtype, device))
    check_host(placement, run.host_budget, run.host_flag)
    streamed = []
    try:
        for name, module in parts.items():
            if name in placement.streamed:
                host = "ring" if name in placement.ring else "pinned"
                streamed.append(stream_module(module, device, prefetch=STREAM_PREFETCH, host=host, dtype=dtype))
            else:
                module.to(device=device, dtype=dtype).eval()
        if placement.vae_tiled:
            parts["vae"].enable_tiling()
        yield placement
    finally:
        for module in streamed:
            release_module(module)


def run_budget(budget: int | None, device: torch.device) -> int | None:
    """The budget the encoders are placed within: ``budget``, or on a GPU what this process can still take there
    (None on a CPU without one): the device's free memory plus what the allocator holds unused, within the
    allocator's cap when one is set (``torch.cuda.set_per_process_memory_fraction``: the compile's ``--vram-budget``,
    a benchmark's card)."""
    if budget is not None or device.type != "cuda":
        return budget
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    available = free + torch.cuda.memory_reserved(index) - allocated
    cap = allocator_cap(index, total)
    if cap is not None:
        available = min(available, cap - allocated)
    return max(available, 0)
