"""What a run holds in host memory, phase by phase, and its choices within ``host_budget``.

The phases do not overlap: while the cache fills, the VAE and text encoders hold what the libraries copy of them and
a streamed encoder's page-locked blocks or ring (sources/encoder_placement.py); they are released before the slab
loads, and during the steps the slab's blobs wait pinned, or in the disk staging ring (runtime/host/staging.py), with
FLUX.1's sample VAE beside them (the other families' samples load their pipeline's encoders again). ``squareq sample``
holds its slab and its encoders at once. Beside them: the process as measured when the plan is made (RssAnon: its
own pages, not the files it maps), and room for what a run grows (the feed's page-locked batches, Python's objects,
the libraries' buffers: runtime/host/budget.py's ``working_room``, 1 GB on a CPU and 3 GB with CUDA).

Within the budget the plan takes the fast choices that fit (the slab pinned under ``host = auto``, a streamed
encoder pinned whole), else the slab read from its file and the encoders from theirs through page-locked rings. A run
that cannot fit even so is refused before any work, in one sentence naming the smallest budget that fits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime.compute import resolve_dtype
from ..runtime.host.budget import anonymous_memory, default_host_budget, working_room
from ..runtime.host.staging import STAGES
from ..sizes import format_size, format_size_up, parse_size
from ..sources.encoder_files import EncoderFiles, planned_placement, read_encoder_files
from ..sources.encoder_placement import EncoderRun, Placement
from ..sources.encoders import encoder_dtype
from .clips import TEMPORAL_STRIDE
from .config import TrainConfig
from .errors import TrainError

KINDS = ("train", "cache", "sample")  # what the plan is for: a training run, squareq cache, squareq sample


@dataclass(frozen=True)
class HostPlan:
    """A run's host memory: the budget, the process, and what each phase holds."""

    kind: str
    budget: int | None  # None: the machine does not say what it has, and no budget was given
    how: str  # where the budget came from, for messages
    process: int  # the process's own memory when planned
    working: int  # room beside it for what the run grows (runtime/host/budget.py's working_room)
    encoders: Placement | None  # None: no encoders load (the built-in toys, or nothing to encode)
    slab_host: str | None  # where the slab's blobs wait (None: no slab, squareq cache)
    slab_bytes: int  # what they hold there: every blob pinned, or the staging ring
    sample_bytes: int  # what sample images add during the steps
    activation_bytes: int = 0  # the checkpointed block inputs offloaded during the steps (offload_activations)

    @property
    def base(self) -> int:
        return self.process + self.working

    @property
    def encoder_bytes(self) -> int:
        return self.encoders.host_expected if self.encoders is not None else 0

    @property
    def peak(self) -> int:
        """What the run is expected to hold at most."""
        if self.kind == "sample":
            return self.base + self.slab_bytes + self.encoder_bytes
        return self.base + max(self.encoder_bytes, self.slab_bytes + self.sample_bytes + self.activation_bytes)

    @property
    def encoder_budget(self) -> int | None:
        """What the encoders may hold within the budget (EncoderRun.host_budget) when they load: beside the slab
        in ``squareq sample``, alone while a run's cache fills."""
        return self.encoders_beside_slab if self.kind == "sample" else \
            None if self.budget is None else self.budget - self.base

    @property
    def encoders_beside_slab(self) -> int | None:
        """What encoders loaded while the slab is (samples through a family's pipeline) may hold."""
        return None if self.budget is None else self.budget - self.base - self.slab_bytes

    def slab_reason(self) -> str:
        """Why the slab's blobs wait where they do, for ``host = auto``'s line."""
        if self.slab_host == "disk":
            return f"pinned, they would pass {format_size(self.budget)} ({self.how}); read from the slab file"
        within = f"within {format_size(self.budget)}" if self.budget is not None else "(no budget known)"
        return f"the slab's {format_size(self.slab_bytes)} of blocks, beside the rest of the run, fit {within}"

    def parts(self) -> str:
        """What each phase holds, in words."""
        said = []
        if self.encoders is not None:
            ring = [f"{n} from its file through {format_size(self.encoders.ring_sizes[n])} of page-locked blocks"
                    for n in self.encoders.ring]
            pinned = [f"{n} pinned whole ({format_size(self.encoders.pinned_sizes[n])})"
                      for n in self.encoders.streamed if n not in self.encoders.ring]
            copies = [f"{n} {format_size(c)}" for n, c in self.encoders.copies.items() if c]
            what = "; ".join(x for x in (", ".join(ring + pinned), "copies: " + ", ".join(copies) if copies else "")
                             if x) or "nothing beyond the files' pages"
            said.append(f"the encoders {format_size(self.encoder_bytes)} ({what})")
        if self.slab_host is not None:
            where = "pinned" if self.slab_host in ("pinned", "shared") else "read from the slab file through " \
                f"{STAGES} page-locked blocks"
            said.append(f"the slab's blocks {format_size(self.slab_bytes)} ({where})")
        if self.sample_bytes:
            said.append(f"sample images {format_size(self.sample_bytes)}")
        if self.activation_bytes:
            said.append(f"the checkpointed block inputs {format_size(self.activation_bytes)} (offloaded, pinned)")
        return ", ".join(said)

    def line(self) -> str:
        """The plan in one line: the budget, what each phase holds, the expected peak."""
        within = f"within {format_size(self.budget)}, {self.how}" if self.budget is not None else f"({self.how})"
        return (f"host memory {within}: {self.parts() or 'no encoders or slab'}; expected peak "
                f"{format_size(self.peak)} with {format_size(self.base)} for the process and its working room.")


def resolve_budget(budget: str | int | None, flag: str = "host_budget") -> tuple[int | None, str]:
    """(bytes, how it was found) of a host budget given as ``flag``: bytes, a size (``24GB``) or ``auto`` (None too):
    what the machine has available, less a margin."""
    if isinstance(budget, int):
        return budget, f"{flag} {format_size(budget)}"
    if budget not in (None, "auto"):
        return parse_size(budget, flag), f"{flag} {budget}"
    found, how = default_host_budget()
    return found, f"{flag} auto ({how})"


def train_host_plan(cfg: TrainConfig, kind: str, device: torch.device, blobs: list[int] | None = None,
                    encoder_source=None, family: str | None = None, encode: bool = True,
                    activations: int = 0) -> HostPlan:
    """:func:`plan_host_memory` for a training run (``kind`` train) or ``squareq cache`` (``kind`` cache) of
    ``cfg``; ``activations``: the checkpointed inputs offloaded during the steps (train/run_plan.py)."""
    stride = TEMPORAL_STRIDE.get(family)  # a video family's VAE: the longest window's frames the config can cut
    run = EncoderRun(cfg.vram_budget_bytes, cfg.max_sequence_length, cfg.largest_resolution ** 2, "vram_budget",
                     frames=cfg.largest_batch(stride)[2] if stride else 1)
    return plan_host_memory(kind, device, cfg.host_budget, cfg.host, cfg.dtype, run, blobs, encoder_source, family,
                            encode, sampling=kind == "train" and bool(cfg.sample_every), activations=activations)


def plan_host_memory(kind: str, device: torch.device, budget: str | int | None, host: str, dtype: str,
                     run: EncoderRun, blobs: list[int] | None = None, encoder_source=None, family: str | None = None,
                     encode: bool = True, sampling: bool = False, flag: str = "host_budget",
                     activations: int = 0) -> HostPlan:
    """The host plan of a ``kind`` run (:data:`KINDS`) on ``device`` within ``budget`` (:func:`resolve_budget`):
    ``host`` where the slab's blobs wait (``auto``: chosen here), ``dtype`` the run's (``auto`` too), ``run`` the
    encoders' VRAM placement, ``blobs`` the slab's block sizes (None: no slab), ``encoder_source`` the encoders it
    loads (with ``encode``), ``sampling`` whether it draws samples during the steps, ``flag`` how the budget was given.
    Refused with :class:`TrainError` when it cannot fit the budget, naming the smallest budget that would."""
    budget, how = resolve_budget(budget, flag)
    planner = _Planner(kind, device, budget, how, run, blobs, family, sampling,
                       read_encoder_files(encoder_source) if encode and encoder_source is not None else None,
                       encoder_dtype(device, resolve_dtype(dtype, device)[0]), activations)
    asked = host if blobs is not None else None
    plan = planner.make("pinned" if asked == "auto" else asked)
    if asked == "auto" and budget is not None and plan.peak > budget:  # pinned does not fit: from the slab file
        plan = planner.make("disk")
    if budget is None or plan.peak <= budget:
        return plan
    least = planner.make("disk" if asked == "auto" else asked, least=True)
    given = not how.startswith(f"{flag} auto")
    advice = (f"give {flag} at least {format_size_up(least.peak)}" if given
              else f"free memory until {flag} auto comes to {format_size_up(least.peak)}, or give it a size")
    if asked in ("pinned", "shared") and planner.make("disk", least=True).peak <= budget:
        advice = "pass --host disk (the slab's blocks read from its file), or " + advice
    raise TrainError(f"{how} leaves {format_size(budget)} of host memory, and this run needs at least "
                     f"{format_size(least.peak)}: {least.parts() or 'no encoders or slab'}, and "
                     f"{format_size(least.base)} for the process and its working room; {advice}.")


@dataclass(frozen=True)
class _Planner:
    """What a host plan is made from, read once: the budget, the process, the slab's blocks and the encoders' files."""

    kind: str
    device: torch.device
    budget: int | None
    how: str
    run: EncoderRun
    blobs: list[int] | None
    family: str | None
    sampling: bool
    files: EncoderFiles | None
    encoder: torch.dtype
    activations: int = 0  # offloaded checkpointed inputs during the steps
    process: int = dataclasses.field(default_factory=lambda: anonymous_memory())  # measured when planned

    def make(self, slab_host: str | None, least: bool = False) -> HostPlan:
        """The plan with the slab's blobs at ``slab_host``; the encoders pinned where the budget allows (``least``:
        read through their rings wherever that holds less)."""
        plan = HostPlan(self.kind, self.budget, self.how, self.process, working_room(self.device), None, slab_host,
                        _slab_bytes(self.blobs, slab_host), 0, self.activations)
        if self.files is None:
            return plan
        # squareq sample loads its encoders beside the slab on the GPU: planned streamed, the most host memory
        encoders = self._encoders(0 if least else plan.encoder_budget, stream_all=self.kind == "sample")
        extra = 0
        if self.sampling:  # FLUX.1's samples keep its VAE on the host; the others load their pipeline's encoders
            extra = encoders.sizes.get("vae", 0) if self.family == "flux" else \
                self._encoders(0 if least else plan.encoders_beside_slab, stream_all=True).host_expected
        return dataclasses.replace(plan, encoders=encoders, sample_bytes=extra)

    def _encoders(self, room: int | None, stream_all: bool) -> Placement:
        return planned_placement(self.files, self.device, self.encoder,
                                 dataclasses.replace(self.run, host_budget=room), stream_all)


def _slab_bytes(blobs: list[int] | None, host: str | None) -> int:
    if not blobs or host is None:
        return 0
    return STAGES * max(blobs) if host == "disk" else sum(blobs)
