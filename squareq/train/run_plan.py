"""A run's plan: everything settled and checked against the slab before anything loads. The configuration takes the
family's defaults (and a resumed run's targets); the dtype, the base layers' arithmetic, CUDA graphs and
torch.compile are resolved for the device; the memory plan is checked against ``vram_budget``; the family, the
objective, the LoRA kind beside a checkpoint, the LoRA layouts and the sample settings are refused in one sentence
where they cannot work. :class:`RunPlan` holds the result."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import runtime
from ..models import ADAPTERS, BUILTIN_MODELS
from ..runtime.block_compile import resolve_compile
from ..runtime.compute import ComputeError, resolve_compute, resolve_dtype
from ..runtime.lora import matches as lora_matches
from ..slab import open_slab
from ..sources.encoder_source import EncoderSource, slab_encoders
from .checkpoint import checkpoint_config, resume_path
from .clips import TEMPORAL_STRIDE
from .config import TrainConfig
from .controls import control_tokens, edit_families
from .errors import TrainError
from .layouts import LAYOUTS, layout_for
from .layouts.lycoris import lokr_key
from .lora_factors import LoraFileError
from .objective import training_objective
from .run_samples import check_sampling

log = logging.getLogger("squareq.train")


@dataclass
class RunPlan:
    """What :func:`plan_run` settled: the configuration and what it resolved to on this device for this slab."""

    cfg: TrainConfig  # with the family's defaults and a resumed run's targets
    slab: object  # the opened slab
    family: str
    recipe: object  # the family's training recipe (squareq/models)
    objective: str  # flow, epsilon or v_prediction
    dtype: str
    dtype_why: str
    compute: str  # the base layers' arithmetic
    compute_why: str
    cuda_graphs: bool
    compile_blocks: bool  # torch.compile of the blocks
    compile_why: str
    formats: list[str]  # the LoRA layouts to write
    started: float  # when the run started, for the LoRA files' metadata
    encoder_source: EncoderSource
    sample_stages: tuple[Path, Path] | None  # a Würstchen stage's two pipeline folders for sample images
    offload: bool = False  # the checkpointed block inputs wait in host memory (runtime/activation_offload.py)
    offload_bytes: int = 0  # what they take there at most (the memory plan's figure; 0 where it was not made)

    def say_choices(self, echo) -> None:
        """Say what ``auto`` and fp16 chose, and why."""
        cfg = self.cfg
        if self.dtype == "fp16":
            echo(f"dtype {cfg.dtype}: fp16: {self.dtype_why}; the LoRA trains in fp32 with a scaled loss, the "
                 "encoders and the sample VAE run in fp32")
        if cfg.compute == "auto":
            echo(f"compute auto: {'no FP8' if self.dtype == 'fp16' else self.compute}: {self.compute_why}")
        if cfg.compile == "auto":
            echo(f"compile auto: {'on' if self.compile_blocks else 'off'}: {self.compile_why}")


def plan_run(cfg: TrainConfig, out: Path, device: torch.device, world: int, echo) -> RunPlan:
    """Open the slab, settle the configuration against it and check the memory plan (``world`` processes train)."""
    slab = open_slab(cfg.slab, verify="eager")
    cfg = _resumed_targets(cfg, out)
    given = cfg.targets is not None
    cfg = cfg.with_family_defaults(slab.manifest.model.family)
    _check_targets(cfg.targets, [layer.name for layer in slab.manifest.layers], given)
    _check_variant(cfg, out, world)
    try:
        dtype, dtype_why = resolve_dtype(cfg.dtype, device)
    except ComputeError as exc:
        raise TrainError(f"--dtype {cfg.dtype}: {exc}") from None
    compute, compute_why = _compute(cfg, device, dtype)
    cuda_graphs = _use_cuda_graphs(cfg, device, echo)
    compile_blocks, compile_why = resolve_compile(cfg.compile, device, family=slab.manifest.model.family)
    family = slab.manifest.model.family
    controls = control_tokens(cfg, family)  # an edit pair's tokens beside each target (reads the control folders)
    offload, offload_bytes = _check_memory_plan(cfg, slab, device, compute, dtype, echo, controls)
    _check_trainable(cfg.slab, family)
    _check_pairs(cfg, slab.manifest.model, echo)
    targeted = [layer.name for layer in slab.manifest.layers if lora_matches(layer.name, cfg.targets)]
    formats = save_formats(cfg, family, targeted, echo)
    started = time.time()
    recipe = ADAPTERS[family].recipe
    encoder_source = slab_encoders(slab.manifest.model, cfg.model, cfg.revision, cfg.encoder_files)
    sample_stages = check_sampling(cfg, family, encoder_source)
    objective = training_objective(encoder_source, family)
    if objective != "flow" and (cfg.loss_weighting != "none" or cfg.timestep_sampling == "flux_shift"):
        raise TrainError(f"loss_weighting = {cfg.loss_weighting} and timestep_sampling = {cfg.timestep_sampling} "
                         f"are for flow-matching models; this {family} model trains with the {objective} "
                         "objective, so leave them at none and shift.")
    return RunPlan(cfg=cfg, slab=slab, family=family, recipe=recipe, objective=objective, dtype=dtype,
                   dtype_why=dtype_why, compute=compute, compute_why=compute_why, cuda_graphs=cuda_graphs,
                   compile_blocks=compile_blocks, compile_why=compile_why, formats=formats, started=started,
                   encoder_source=encoder_source, sample_stages=sample_stages, offload=offload,
                   offload_bytes=offload_bytes)


def _compute(cfg: TrainConfig, device: torch.device, dtype: str) -> tuple[str, str]:
    """The base layers' arithmetic for ``cfg.compute`` on this device and the run's dtype, and why; ``auto`` says what
    it chose (an fp16 run: no FP8)."""
    try:
        return resolve_compute(cfg.compute, device, dtype)
    except ComputeError as exc:
        raise TrainError(f"--compute {cfg.compute}: {exc}") from None


def _use_cuda_graphs(cfg: TrainConfig, device: torch.device, echo) -> bool:
    """``cuda_graphs`` settled for this run. ``auto`` is on with a CUDA GPU, except with an active LoRA dropout (its
    blocks are never captured, so graphs would only cost memory) and under a ``vram_budget``: the memory plan does not
    count the graphs' pool and static buffers (+0.3-0.5 GB on FLUX.1-12B), so it could not keep its promise. ``on``
    without a CUDA GPU is refused (:class:`TrainError`)."""
    if cfg.cuda_graphs == "on" and device.type != "cuda":
        raise TrainError(f"--cuda-graphs on needs a CUDA GPU and this run trains on {device}; use auto or off.")
    if cfg.cuda_graphs == "off" or device.type != "cuda":
        return False
    if cfg.cuda_graphs == "on":
        if cfg.vram_budget_bytes is not None:
            log.warning("cuda_graphs = on with vram_budget: the memory plan does not count the CUDA graphs' memory "
                        "(measured +0.3-0.5 GB on FLUX.1-12B); leave that much below the budget.")
        return True
    if cfg.lora_dropout:
        return False
    if cfg.vram_budget_bytes is not None:
        echo("cuda graphs auto: off, because vram_budget is set and the memory plan does not count their memory; "
             "--cuda-graphs on turns them on (about 0.3-0.5 GB more)")
        return False
    return True


def _check_memory_plan(cfg: TrainConfig, slab, device: torch.device, compute: str, dtype: str,
                       echo, controls: int = 0) -> tuple[bool, int]:
    """With ``vram_budget`` on a GPU: say the expected device memory and refuse a plan over the budget. Returns
    whether the checkpointed inputs go to host memory (``offload_activations``: on; auto: where only that fits the
    budget, said in one line) and what they take there (0: not planned)."""
    offload = cfg.offload_activations == "on"
    if device.type != "cuda" or (cfg.vram_budget_bytes is None and not offload):
        return offload, 0
    stride = TEMPORAL_STRIDE.get(slab.manifest.model.family)  # a video family: its longest window's frames count
    side, batch, frames = cfg.largest_batch(stride)  # the dataset whose batches hold the most pixels

    def planned(offload: bool):
        return runtime.plan(slab, resolution=side, batch=batch, frames=frames if stride else None,
                            text_tokens=cfg.max_sequence_length, prefetch=cfg.start_prefetch, lora_rank=cfg.rank,
                            lora_targets=cfg.targets, compute=compute, dtype=dtype, offload=offload,
                            control_tokens=controls)

    plan = planned(offload)
    if cfg.vram_budget_bytes is None:  # offload on without a budget: the host plan counts what it pins
        return offload, plan.offloaded
    if cfg.offload_activations == "auto" and plan.peak_reserved > cfg.vram_budget_bytes:
        kept = plan
        plan = planned(True)
        offload = plan.peak_reserved <= cfg.vram_budget_bytes
        if offload:
            echo(f"offload_activations auto: on: the {kept.checkpoints / 1e9:.2f} GB of checkpointed block inputs "
                 f"do not fit vram_budget beside the rest, so they wait in host memory ({plan.offloaded / 1e9:.2f} "
                 "GB), copied out and back while the blocks compute")
        else:
            plan = kept
    echo("expected device memory:\n" + str(plan))
    if cfg.use_dora:
        log.warning("vram_budget: the memory plan does not count DoRA's own memory (measured on FLUX.1-12B: "
                    "1.7 GB more at 512², 2.1 GB at 1024²); leave that much below the budget.")
    plan.check(cfg.vram_budget_bytes)
    return offload, plan.offloaded


def _check_trainable(slab, family: str) -> None:
    if family not in ADAPTERS or ADAPTERS[family].recipe is None:
        raise TrainError(f"{slab} holds a {family} model, which squareq train cannot train yet; the families it "
                         f"trains are: {', '.join(f for f, a in ADAPTERS.items() if a.recipe)}.")


def _check_pairs(cfg: TrainConfig, model, echo) -> None:
    """Edit pairs (``control_dir``, train/controls.py) only for a family that trains on them, refused before anything
    loads; a slab whose source is not named for its edit model (Kontext, Qwen-Image-Edit) is said in a line (the edit
    models are their base models' classes, so the slab cannot tell)."""
    views = [v for v in cfg.dataset_views() if v.control_dir]
    if not views:
        return
    recipe = ADAPTERS[model.family].recipe
    if not recipe.controls:
        raise TrainError(f"control_dir = {views[0].control_dir}: edit pairs train {', '.join(edit_families())}, and "
                         f"{cfg.slab} holds a {model.family} model; remove control_dir to train it on the images "
                         "alone.")
    source, word = str(getattr(model, "source", "")), recipe.edit_word
    if word and word.lower() not in source.lower() and source not in BUILTIN_MODELS:
        echo(f"edit pairs: {cfg.slab} was compiled from {source}, whose name does not say {word}; it trains as "
             f"{recipe.edit_name} (the same model class), which a base model was not trained for")


def save_formats(cfg: TrainConfig, family: str, layers=(), echo=None) -> list[str]:
    """The LoRA layouts to write: ``cfg.save_format``, or by default the diffusers file (a LoKr's or LoHa's PEFT
    folder) and the family's kohya/ComfyUI file (LyCORIS's for a LoKr or LoHa), whose ``.alpha`` tensors or baked
    factors carry the strength to ComfyUI. ``layers``: the layers the LoRA will have. A kohya file that cannot hold
    this LoRA (DoRA, a family with no such layout, a layer it has no place for) is refused before training when
    asked for, and left out of the default with a line to ``echo`` saying why."""
    lycoris = cfg.lora_type != "lora"  # config_values.py refused diffusers for them, peft for a LoRA
    formats = list(cfg.save_format or (["peft", "kohya"] if lycoris else ["diffusers", "kohya"]))
    why, quiet = _kohya_refusal(cfg, family, layers) if "kohya" in formats else (None, True)
    if why is not None and cfg.save_format:
        raise TrainError(f"save_format = {','.join(formats)}: {why}.")
    if why is not None:
        formats.remove("kohya")
        if echo is not None and not quiet:
            echo(f"no kohya/ComfyUI file: {why}")
    return formats


def _kohya_refusal(cfg: TrainConfig, family: str, layers) -> tuple[str | None, bool]:
    """Why this run's LoRA has no kohya/ComfyUI file (None if it has one), and whether that goes without saying
    (DoRA, a family without a layout: the default never had one)."""
    if cfg.use_dora:
        return ("the kohya/ComfyUI layout has no DoRA that kohya and ComfyUI read alike (use_dora); use "
                "--save-format diffusers"), True
    try:
        layout = layout_for(family, "this slab's LoRA")
        for layer in layers:
            if cfg.lora_type == "lokr":
                lokr_key(layer, layout)
            else:
                layout.module_of(layer)
    except LoraFileError as exc:
        return str(exc).rstrip("."), family not in LAYOUTS
    return None, True


def _check_variant(cfg: TrainConfig, out: Path, world: int) -> None:
    """Before anything loads: peft is there for a variant; a resumed run keeps its checkpoint's DoRA and rsLoRA (a
    LoRA cannot change kind halfway); dropout runs in one process (its masks come from each process's CUDA random
    state, which checkpoints keep for one process only, so a resume would not be exact)."""
    if not cfg.lora_variant.plain:
        runtime.require_peft()
    if cfg.lora_dropout and world > 1:
        raise TrainError(f"lora_dropout = {cfg.lora_dropout} with {world} processes: a resumed run would draw other "
                         "dropout masks than an unbroken one; train with lora_dropout = 0, or in one process.")
    path = resume_path(cfg, out)
    saved = checkpoint_config(path) if path is not None else {}
    for key, flag in (("use_dora", "--use-dora"), ("use_rslora", "--use-rslora")):
        if key in saved and bool(saved[key]) != getattr(cfg, key):
            raise TrainError(f"{path} was trained with {key} = {str(bool(saved[key])).lower()}; resume with the same "
                             f"setting ({flag} {'on' if saved[key] else 'off'}), or start a new run in a new -o "
                             "folder.")
    for key in ("lora_type", "lokr_factor"):
        if key in saved and saved[key] != getattr(cfg, key):
            raise TrainError(f"{path} was trained with {key} = {saved[key]}; resume with the same setting "
                             f"(--{key.replace('_', '-')} {saved[key]}), or start a new run in a new -o folder.")


def _check_targets(targets: list[str], layers: list[str], given: bool) -> None:
    """Refuse, before the cache fills, LoRA targets that match no layer of the slab; with ``given`` targets (the
    config's or a resumed run's, not the family's default), also one target that matches none (a typo would train
    less than asked, silently)."""
    unmatched = [t for t in targets if not any(lora_matches(name, (t,)) for name in layers)]
    if len(unmatched) < len(targets) and not (given and unmatched):
        return
    ends = {".".join(name.split(".")[-2:]) if name.split(".")[-1].isdigit() else name.split(".")[-1]
            for name in layers}
    which = "match no layer" if len(unmatched) == len(targets) else \
        f"include {', '.join(unmatched)}, which {'match' if len(unmatched) > 1 else 'matches'} no layer"
    raise TrainError(f"targets {', '.join(targets)} {which} of this slab's {len(layers)} quantized layers; name "
                     f"layers as PEFT's target_modules do, by a name's last parts (this slab's end in "
                     f"{', '.join(sorted(ends)[:8])}, ...; `squareq inspect SLAB` lists them).")


def _resumed_targets(cfg: TrainConfig, out: Path) -> TrainConfig:
    """A resumed run without --targets trains the layers its checkpoint has (a run started before the family's
    default changed keeps its own), not the current default."""
    if not cfg.resume or cfg.targets is not None:
        return cfg
    path = resume_path(cfg, out)
    saved = checkpoint_config(path).get("targets") if path is not None else None
    return dataclasses.replace(cfg, targets=list(saved)) if isinstance(saved, list) and saved else cfg
