"""``squareq accept``: open the slab and its source, run the three gates, assemble the report."""
from __future__ import annotations

import dataclasses
import datetime
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..compiler.sources import open_source
from ..compiler.thresholds import Thresholds
from ..models import ModelError
from ..slab import SlabError, open_slab
from ..slab.signature import model_signature
from ..train.tiny_dataset import write_tiny_dataset
from .convergence import ConvergenceSettings, convergence_gate
from .layer_mse import layer_mse_gate
from .report import AcceptReport
from .resources import resources_gate


class AcceptError(ValueError):
    """The slab and the source cannot be compared; the message says which file and what to do."""


@dataclass(frozen=True)
class AcceptOptions:
    """What to gate and against what. ``training`` describes the convergence runs; its ``tau`` and ``delta`` are
    taken from ``thresholds`` and its ``data`` defaults to the built-in tiny dataset (in the work folder)."""

    slab: Path
    model: str
    thresholds: Thresholds = field(default_factory=Thresholds)
    budget: int | None = None
    vram_budget: int | None = None
    workdir: Path | None = None  # default: <slab>.accept next to the slab
    require_gpu: bool = False
    samples: int = 2  # calibration samples for the layer MSE gate
    training: ConvergenceSettings = field(default_factory=ConvergenceSettings)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def accept(opts: AcceptOptions, echo=print) -> AcceptReport:
    """Run every gate on ``opts.slab`` against ``opts.model``; the report says whether the slab passes."""
    with open_slab(opts.slab, verify="eager") as slab:  # a corrupted slab fails here, before any measurement
        return _accept(opts, slab, echo)


def _accept(opts: AcceptOptions, slab, echo) -> AcceptReport:
    recorded = slab.manifest.model
    try:  # a generic-mode slab names its block lists; a family's adapter knows its own
        source = open_source(opts.model, recorded.block_lists if recorded.family == "generic" else None)
    except ModelError as exc:
        raise AcceptError(f"--model {opts.model}: {exc}") from None
    if model_signature(source.skeleton()) != recorded.signature:
        raise AcceptError(f"{opts.slab} was not compiled from --model {opts.model} (the model class, config or tensor "
                          "shapes differ); pass the model the slab was compiled from.")
    workdir = Path(opts.workdir or f"{opts.slab}.accept")
    workdir.mkdir(parents=True, exist_ok=True)
    device = _device()
    if opts.require_gpu and device.type != "cuda":
        echo("no CUDA device: the GPU measurements will fail (--require-gpu)")

    echo(f"[1/3] layer MSE: every layer of {opts.slab} on fresh inputs through {source.description}")
    gates = [layer_mse_gate(source, slab, opts.thresholds.mse, opts.samples, device)]
    echo(f"      {gates[-1].status}: {gates[-1].measured}")

    data = Path(opts.training.data) if opts.training.data else write_tiny_dataset(workdir / "data")
    settings = dataclasses.replace(opts.training, delta=opts.thresholds.conv_steps, tau=opts.thresholds.conv,
                                   data=str(data))
    echo(f"[2/3] convergence: LoRA on the bf16 source vs the slab, {settings.steps} steps on {data}")
    conv, records = convergence_gate(source, slab, opts.model, workdir, settings, echo)
    gates.append(conv)
    echo(f"      {conv.status}: {conv.measured}{'' if conv.status != 'SKIP' else ' (' + conv.note + ')'}")

    echo("[3/3] peak VRAM and size")
    gates.append(resources_gate(slab, opts.budget, records, opts.vram_budget, opts.require_gpu))
    context = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "squareq": __version__, "torch": torch.__version__, "thresholds": opts.thresholds.to_dict(),
        "workdir": str(workdir), "data": str(data)}
    return AcceptReport(str(opts.slab), opts.model, gates, context)


__all__ = ["AcceptError", "AcceptOptions", "SlabError", "accept"]
