"""What a compile works out before it measures anything, and before any state is written: the calibration batch,
how many samples a block sees at once, the VRAM, host and disk plans, the key its measurements are stored under, the
model's shell with the calibration pass standing in for its blocks, and the resident tensors."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..slab.writer import stored_tensor
from ..sources import Source
from .budget import BudgetError, check_block_cap, check_least_budget, check_vram_cap
from .calibration_pass import CalibrationPass, on_device
from .chunks import BatchAxes, batched_kwargs, probe_batch_axes
from .disk import check_disk, estimate_disk
from .host_plan import HostPlan, check_least_host, estimate_host, plan_host
from .inputs import calibration_batch
from .ladder import rung_specs
from .options import CompileOptions
from .previous import Previous, read_previous
from .progress import CompileProgress
from .state import state_folder
from .vram import VramPlan, estimate_needs, plan_vram


@dataclass
class CompileSetup:
    """What the compile works out before it measures anything (and before any state is written)."""

    skeleton: nn.Module
    previous: Previous | None
    batch: object
    batched: set
    axes: BatchAxes
    vram: VramPlan
    host: HostPlan
    key: str
    calibration: CalibrationPass
    shell: nn.Module
    residents: dict
    cap: int | None

    @property
    def reused(self) -> bool:
        return self.previous is not None and self.previous.key == self.key

    @property
    def held(self) -> tuple[dict, torch.Tensor | None]:
        """The held-out samples' forward arguments and row mask (all samples when none are held out), on the
        device."""
        b = self.batch
        if b.heldout_kwargs is not None:
            return b.heldout_kwargs, b.heldout_row_mask
        return on_device(b.kwargs, self.vram.device), b.row_mask


def set_up(source: Source, out: Path, opts: CompileOptions, progress: CompileProgress) -> CompileSetup:
    """Work out the compile's setup (the module docstring), saying each plan as it is made."""
    skeleton = source.skeleton()
    previous = read_previous(opts.previous, source, skeleton) if opts.previous else None
    check_budget(source, opts)
    source.check_finite(progress)  # NaN/Inf weights, refused before any calibration (the CLI checked already)
    specs = rung_specs(opts.formats, opts.group_size)
    batch = calibration_batch(source, skeleton, opts)
    progress(_calibration_line(batch.description))
    samples = int(batch.description.get("samples") or 1)
    batched = batched_kwargs(batch.kwargs, batch.heldout_kwargs, samples)
    axes = probe_batch_axes(source, batch.kwargs, batched, samples)
    needs = estimate_needs(source, skeleton, batch, axes, gptq=opts.rounding == "gptq", max_rows=opts.max_rows,
                           probes=opts.effect_probes, specs=specs)
    # between the passes that read it, the calibration batch waits in host memory (FLUX.2's text states are 1 GB)
    batch.kwargs = on_device(batch.kwargs, "cpu")
    vram = plan_vram(needs, opts.vram_budget, opts.device)
    host_needs = estimate_host(needs, vram, skeleton, source.block_paths, batch, axes, specs, opts.effect_probes,
                               opts.rounding == "gptq")
    host = plan_host(host_needs, opts.host_budget, vram, state_folder(out))
    progress(vram.describe(axes.chunk_samples, axes.why))
    progress(host.describe())
    key = measurement_key(source, batch, opts, axes.chunk_samples)
    spilled = max(needs.tape if host.spill_tape else 0, needs.saved if host.spill_saved else 0)
    disk = estimate_disk(skeleton, source.block_paths, specs, spilled, opts.budget, state_folder(out),
                         rebuild=previous is not None and previous.key == key)
    progress(check_disk(disk, state_folder(out), out))
    calibration = CalibrationPass(source, opts, progress, batch, axes, vram, host)
    shell = source.shell(calibration.block, opts.device, upcast_linears=True)  # checks the checkpoint
    residents = source.resident_state("cpu", torch.float32)
    return CompileSetup(skeleton, previous, batch, batched, axes, vram, host, key, calibration, shell, residents,
                        _block_cap(opts, residents))


def check_budget(source: Source, opts: CompileOptions) -> None:
    """Refuse, from the shapes alone, a ``--budget`` no slab of ``source`` fits, or a ``--max-block-bytes`` no block
    fits: before any encoder or calibration runs (a rebuild is not checked: it may keep rungs its ``--formats`` no
    longer offers)."""
    if opts.previous is None:
        specs = rung_specs(opts.formats, opts.group_size)
        check_least_budget(opts.budget, source.skeleton(), source.block_paths, specs)
        check_block_cap(opts.max_block_bytes, source.skeleton(), source.block_paths, specs)
        check_vram_cap(opts.vram_cap, opts.ring_slots, source.skeleton(), source.block_paths, specs)
    check_least_host(opts.host_budget, opts.device)


def _block_cap(opts: CompileOptions, residents: dict) -> int | None:
    """The largest block the plan may make: --max-block-bytes, or (--vram-cap − the resident tensors as stored) /
    --ring-slots, since the runtime's ring holds that many slots of the largest block."""
    if opts.vram_cap is None:
        return opts.max_block_bytes
    resident = sum(t.numel() * t.element_size() for t in map(stored_tensor, residents.values()))
    cap = (opts.vram_cap - resident) // max(opts.ring_slots, 1)
    if cap <= 0:
        raise BudgetError(f"--vram-cap {opts.vram_cap:,} bytes does not even hold the resident tensors ({resident:,} "
                          "bytes); raise it.")
    return cap


# Bumped when the measurements' arithmetic changes, so that no rebuild reuses measurements made the old way (2: chunked
# calibration forward, per-sample effect probes; 3: the effects pass's own attention and products a slice of rows at a
# time; 4: the search's Hadamard-rotated candidates; 5: learned rounding).
MEASUREMENT_VERSION = 5


def measurement_key(source: Source, batch, opts: CompileOptions, chunk_samples: int | None = None) -> str:
    """Changes when anything the measurements depend on does: the source's weights (files, sizes, times), the
    calibration data, how many samples a block sees at once and the search options."""
    parts = {"source": source.fingerprint(), "calibration": batch.description, "chunk_samples": chunk_samples,
             "version": MEASUREMENT_VERSION, **opts.fingerprint()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _calibration_line(d: dict) -> str:
    what = d.get("source") or d.get("why") or d.get("kind")
    held = f", {d['heldout_samples']} held out to judge the transforms" if d.get("heldout_samples") else ""
    return f"calibrating on {d.get('samples')} samples of {what}{held}"
