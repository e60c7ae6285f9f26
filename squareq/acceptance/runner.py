"""``squareq accept``: open the slab and its source, run the gates, assemble the report."""
from __future__ import annotations

import dataclasses
import datetime
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..compiler.device_choice import block_weights, choose_device, tokens_per_sample
from ..compiler.thresholds import Thresholds
from ..devices import default_device, parse_device, run_on
from ..extras import ACCEPT_MODULES, check_installed
from ..models import ModelError
from ..runtime.compute import ComputeError, resolve_compute
from ..slab import SlabError, open_slab
from ..slab.manifest import MANIFEST_FILE
from ..slab.signature import model_signature
from ..sources import open_source
from ..sources.encoder_source import EncoderError, slab_encoders
from ..sources.hub import hub_ref, like_recorded
from ..train.tiny_dataset import write_tiny_dataset
from .block_drift import block_drift_gate
from .convergence import GATE_DEFAULTS, ConvergenceSettings, convergence_gate
from .gates import INCONCLUSIVE, SKIP
from .gradients import gradient_gate
from .image_drift import DriftError, check_clip_folder, image_drift_gate
from .layer_mse import layer_mse_gate
from .report import AcceptReport
from .resources import resources_gate


class AcceptError(ValueError):
    """The slab and the source cannot be compared; the message says which file and what to do."""


@dataclass(frozen=True)
class AcceptOptions:
    """What to gate and against what. ``training`` describes the convergence runs; its ``tau`` is taken from
    ``thresholds`` and its ``data`` defaults to the built-in tiny dataset (in the work folder). ``images``,
    ``sample_steps`` and ``clip_model`` describe the image-drift gate's drawings, ``gradient_steps`` ×
    ``gradient_times`` the gradient-agreement gate's batches, ``drift_blocks`` how many blocks the block-drift gate
    measures."""

    slab: Path
    model: str  # the source: a Hub ID, a folder, a BFL file or a built-in model
    revision: str | None = None  # of a Hub ID
    files: dict[str, str] = field(default_factory=dict)  # encoders as single files (--clip-l, --t5, --vae, --clip-g)
    device: str | None = None  # every gate's device (None or auto: the GPU when there is one)
    thresholds: Thresholds = field(default_factory=Thresholds)
    budget: int | None = None
    vram_budget: int | None = None
    workdir: Path | None = None  # default: <slab>.accept next to the slab
    require_gpu: bool = False
    samples: int = 2  # fresh calibration samples for the layer MSE and block drift gates
    training: ConvergenceSettings = field(default_factory=ConvergenceSettings)
    images: int = 4
    sample_steps: int = 20
    clip_model: str | None = None
    gradient_steps: int = 4
    gradient_times: int = 4
    drift_blocks: int = 8


def accept(opts: AcceptOptions, echo=print, progress: bool | None = None) -> AcceptReport:
    """Run every gate on ``opts.slab`` against ``opts.model``; the report says whether the slab passes. Each gate shows
    how far it is on a bar titled with its name, with its ETA, when ``progress`` (None: when stderr is a terminal),
    else in plain lines for ``echo`` (acceptance/gates.py :func:`gate_bar`)."""
    check_installed(ACCEPT_MODULES, "squareq accept")  # before the slab is hashed and anything is measured
    parse_device(opts.device)  # a wrong --device is refused before the slab is hashed
    with open_slab(opts.slab, verify="eager") as slab:  # a corrupted slab fails here, before any measurement
        check_recorded(slab)
        source, encoders, device = _open_source(opts, slab)
        with run_on(device):
            return _accept(opts, slab, source, encoders, echo, progress)


def _count(value) -> bool:
    return type(value) is int and value >= 0  # a bool or "2MB" is not a count


def _finite_list(value) -> bool:
    return isinstance(value, list) and all(type(v) in (int, float) and math.isfinite(v) for v in value)


# the manifest's calibration fields the gates read (layer_mse.fresh_inputs, resources._size), each absent, null or:
RECORDED = {
    "budget_bytes": (_count, "a whole number of bytes"),
    "seed": (_count, "a whole number of at least 0"),
    "samples": (_count, "a whole number of at least 0"),
    "resolution": (lambda v: _count(v) and v > 0, "a whole number of pixels"),
    "max_sequence_length": (lambda v: _count(v) and v > 0, "a whole number of tokens"),
    "max_tokens": (lambda v: _count(v) and v > 0, "a whole number of tokens"),
    "timesteps": (_finite_list, "a list of finite numbers"),
    **{key: (lambda v: isinstance(v, str), "a text") for key in ("kind", "text_file", "cache", "data", "encoders")},
}


def check_recorded(slab) -> None:
    """Refuse, before any measurement, a manifest whose calibration fields the gates read are not what the compile
    writes (the last gate would otherwise crash after every other gate ran, and no report be written)."""
    recorded = slab.manifest.calibration or {}
    for key, (fits, wanted) in RECORDED.items():
        value = recorded.get(key)
        if value is not None and not fits(value):
            raise AcceptError(f"{slab.path / MANIFEST_FILE}'s calibration.{key} is {str(value)[:40]!r}, not {wanted} "
                              "as the compile writes it; correct the value there (or compile the slab again).")


def _open_source(opts: AcceptOptions, slab):
    """The source (at the slab's recorded commit when ``--model`` names its Hub repository without a revision), the
    encoders the gates use, and the device they run on (a model over 1B parameters is not gated on a CPU unasked)."""
    recorded = slab.manifest.model
    chosen = []

    def on_device(candidate) -> None:
        chosen.append(choose_device(opts.device, candidate, lambda skeleton: _least_flops(opts, candidate, skeleton),
                                    "gating it"))

    ref = hub_ref(opts.model, opts.revision)
    revision = like_recorded(ref, recorded.source).revision if ref is not None else opts.revision
    # --model-class is taken by a folder or Hub ID, where generic mode builds a class
    builds_class = recorded.family == "generic" and (ref is not None or Path(str(opts.model)).is_dir())
    try:  # a generic-mode slab names its block lists and the class it built (--model-class); a family knows its own
        source = open_source(opts.model, recorded.block_lists if recorded.family == "generic" else None, revision,
                             check=on_device, model_class=recorded.class_name if builds_class else None)
    except ModelError as exc:
        raise AcceptError(f"--model {opts.model}: {exc}") from None
    if model_signature(source.skeleton()) != recorded.signature:
        raise AcceptError(f"{opts.slab} was not compiled from --model {opts.model} (the model class, config or tensor "
                          "shapes differ); pass the model the slab was compiled from.")
    # the encoders the slab was compiled with (what squareq train uses), else the source's own; single files in place
    try:
        encoders = slab_encoders(recorded, files=opts.files, unrecorded=source.encoder_source or opts.model)
    except EncoderError as exc:
        raise AcceptError(str(exc)) from None
    return source, encoders, chosen[0]


def _least_flops(opts: AcceptOptions, source, skeleton) -> float:
    """The convergence gate alone: three training runs of ``steps`` steps, each a forward, a recompute and a
    backward of one image at the gate's resolution."""
    settings = opts.training
    builtin = not settings.data and not settings.base
    resolution = settings.resolution or (64 if builtin else GATE_DEFAULTS["resolution"])
    tokens = tokens_per_sample(source, skeleton, resolution,
                               settings.max_sequence_length or GATE_DEFAULTS["max_sequence_length"])
    return 2.0 * block_weights(source, skeleton) * tokens * 3 * 3 * settings.steps


def _accept(opts: AcceptOptions, slab, source, encoders, echo, progress: bool | None) -> AcceptReport:
    if opts.clip_model:
        try:
            check_clip_folder(opts.clip_model)
        except DriftError as exc:
            raise AcceptError(str(exc)) from None
    workdir = Path(opts.workdir or f"{opts.slab}.accept")
    workdir.mkdir(parents=True, exist_ok=True)
    device = default_device()
    if opts.require_gpu and device.type != "cuda":
        echo("no CUDA device: the GPU measurements will fail (--require-gpu)")

    thresholds = opts.thresholds
    data = Path(opts.training.data) if opts.training.data else write_tiny_dataset(workdir / "data")
    try:
        compute, why = resolve_compute(opts.training.compute, device)
    except ComputeError as exc:
        raise AcceptError(f"--compute {opts.training.compute}: {exc}") from None
    echo(f"the slab computes in {compute} ({why}); the bf16 references in bf16")
    settings = dataclasses.replace(opts.training, tau=thresholds.conv, data=str(data), compute=compute)
    resolution = settings.resolution or GATE_DEFAULTS["resolution"]
    tokens = settings.max_sequence_length or GATE_DEFAULTS["max_sequence_length"]
    steps = [
        ("layer MSE", f"every layer of {opts.slab} on fresh inputs through {source.description}",
         lambda: layer_mse_gate(source, slab, thresholds.mse, opts.samples, device, progress=progress, echo=echo)),
        ("block drift", f"the model's output with one block quantized, up to {opts.drift_blocks} blocks",
         lambda: block_drift_gate(source, slab, thresholds.drift, opts.samples, opts.drift_blocks, device, progress,
                                  echo)),
        ("image drift", f"{opts.images} images from the bf16 source and from the slab, same prompts and seeds",
         lambda: image_drift_gate(source, slab, encoders, workdir, thresholds.psnr, thresholds.ssim, opts.images,
                                  resolution, opts.sample_steps, tokens, settings.seed, opts.clip_model, echo,
                                  settings.compute, progress)),
        ("gradient agreement", f"LoRA gradients on {opts.gradient_steps} batches × {opts.gradient_times} times",
         lambda: gradient_gate(source, slab, encoders, workdir, settings, thresholds.grad_cos, thresholds.grad_norm,
                               opts.gradient_steps, opts.gradient_times, device, echo, progress)),
    ]
    total = len(steps) + 2
    gates = []
    for i, (name, what, run) in enumerate(steps, 1):
        echo(f"[{i}/{total}] {name}: {what}")
        gates.append(run())
        echo(f"      {_summary(gates[-1])}")
    echo(f"[{total - 1}/{total}] convergence: LoRA on a frozen and a trained bf16 source vs the slab, "
         f"{settings.steps} steps on {data}")
    conv, records = convergence_gate(source, slab, encoders, workdir, settings, echo, progress)
    gates.append(conv)
    echo(f"      {_summary(conv)}")
    echo(f"[{total}/{total}] peak VRAM and size")
    gates.append(resources_gate(slab, opts.budget, records, opts.vram_budget, opts.require_gpu))
    context = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "squareq": __version__, "torch": torch.__version__, "thresholds": opts.thresholds.to_dict(),
        "workdir": str(workdir), "data": str(data), "compute": compute}
    return AcceptReport(str(opts.slab), source.description, gates, context)


def _summary(gate) -> str:
    return f"{gate.status}: {gate.measured}" + (f" ({gate.note})" if gate.status in (SKIP, INCONCLUSIVE) else "")


__all__ = ["AcceptError", "AcceptOptions", "SlabError", "accept"]
