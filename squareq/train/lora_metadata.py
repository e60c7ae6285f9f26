"""The header a trained LoRA carries for the tools people load and share it with.

* ``modelspec.*``: Stability AI's model spec (github.com/Stability-AI/ModelSpec), which ComfyUI, Civitai and LoRA
  info tools read: the base architecture with ``/lora`` (``flux-1-dev/lora``), the implementation, a title, the
  date, the training resolution and the trigger phrase. Architecture IDs are sd-scripts' where it has one
  (``library/sai_model_spec.py``: ``flux-1-dev``, ``chroma``, ``stable-diffusion-3``, ``stable-diffusion-v1``,
  ``stable-diffusion-xl-v1-base``); other families use their SquareQ family name.
* ``ss_*``: sd-scripts' training parameters (``ss_base_model_version``, ``ss_sd_model_name``, learning rate,
  steps, optimizer, seed, network dim and alpha, ...) and its dataset summary: ``ss_dataset_dirs`` (each folder's
  image count and repeats) and ``ss_tag_frequency`` (each folder's comma-separated caption tags and how often they
  occur), which Civitai shows as a LoRA's tags.

Every value is a string (safetensors headers are str -> str); dicts are JSON, as sd-scripts writes them.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from .lora_factors import plain_number

MODELSPEC_VERSION = "1.0.0"
_LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z, the last time modelspec.date's ISO form can write


def _text(x: float) -> str:
    return str(plain_number(x))  # "16", not "16.0", as the LoRA's own keys write it
_ARCHITECTURES = {"flux": "flux-1-dev", "chroma": "chroma", "sd3": "stable-diffusion-3"}
# sd-scripts' ss_base_model_version of the families it trains
_BASE_VERSIONS = {"flux": "flux1", "chroma": "chroma", "sd3": "sd3"}
_IMPLEMENTATIONS = {"diffusers": "diffusers", "kohya": "https://github.com/black-forest-labs/flux", "peft": "peft"}


def architecture(family: str, config: Mapping | None = None) -> tuple[str, str]:
    """(modelspec architecture, ss_base_model_version) of a family's base model; SD 1.x and SDXL UNets are told
    apart by their cross-attention width (SDXL's is 2048)."""
    if family == "sd-unet":
        sdxl = (config or {}).get("cross_attention_dim") == 2048
        return ("stable-diffusion-xl-v1-base", "sdxl_base_v1-0") if sdxl else ("stable-diffusion-v1", "sd_v1")
    return _ARCHITECTURES.get(family, family), _BASE_VERSIONS.get(family, family)


def family_of(architecture_id: str | None) -> str | None:
    """The family a ``modelspec.architecture`` (``flux-1-dev/lora``, ``wan/lokr``) names, or None."""
    from ..models import ADAPTERS

    base = (architecture_id or "").partition("/")[0]
    named = {arch: family for family, arch in _ARCHITECTURES.items()}
    named.update({"stable-diffusion-v1": "sd-unet", "stable-diffusion-xl-v1-base": "sd-unet"})
    return named.get(base) or (base if base in ADAPTERS else None)


def dataset_summary(root: Path, items: Iterable) -> tuple[dict, dict]:
    """(``ss_dataset_dirs``, ``ss_tag_frequency``) of the images trained on: per folder (relative to the data
    folder, ``.`` for the folder itself), the image count and repeats, and each comma-separated tag's count."""
    dirs: dict[str, dict[str, int]] = {}
    tags: dict[str, Counter] = {}
    for item in items:
        folder = item.path.parent.relative_to(root).as_posix()
        entry = dirs.setdefault(folder, {"n_repeats": item.repeats, "img_count": 0})
        entry["img_count"] += 1
        tags.setdefault(folder, Counter()).update(t.strip() for t in item.caption.split(",") if t.strip())
    return dirs, {folder: dict(counts) for folder, counts in tags.items()}


def source_date_epoch() -> int | None:
    """``SOURCE_DATE_EPOCH`` (reproducible-builds.org's convention): the Unix time to record instead of the clock's,
    or None when it is unset or empty. :class:`ValueError` with one sentence when it is not a whole number of seconds
    up to the year 9999."""
    text = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not text:
        return None
    if not re.fullmatch(r"[0-9]+", text) or int(text) > _LAST_SECOND:
        raise ValueError(f"SOURCE_DATE_EPOCH={text[:40]!r} is not a whole number of seconds since 1970-01-01 UTC; set "
                         "it to one (e.g. $(git log -1 --format=%ct)) for fixed times in the LoRA's header, or unset "
                         "it for the run's own.")
    return int(text)


def lora_header(cfg, *, family: str, layout: str, base_model: str, base_config: Mapping | None, rank: int,
                alpha: float, steps: int, images: int, dirs: Mapping, tags: Mapping, started: float,
                finished: float) -> dict[str, str]:
    """The ``modelspec.*`` and ``ss_*`` keys of a LoRA trained with ``cfg`` (a TrainConfig) and saved in ``layout``
    (``diffusers`` or ``kohya``). ``started``/``finished``: Unix times of the run, both replaced by
    ``SOURCE_DATE_EPOCH`` when it is set (then identical runs write identical bytes)."""
    epoch = source_date_epoch()
    if epoch is not None:
        started = finished = float(epoch)
    arch, base_version = architecture(family, base_config)
    title = cfg.title or Path(cfg.output).name
    header = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": f"{arch}/{getattr(cfg, 'lora_type', 'lora')}",
        "modelspec.implementation": _IMPLEMENTATIONS[layout],
        "modelspec.title": title,
        "modelspec.date": datetime.datetime.fromtimestamp(finished, datetime.UTC).isoformat(
            timespec="seconds"),
        "modelspec.resolution": f"{cfg.largest_resolution}x{cfg.largest_resolution}",
        "ss_base_model_version": base_version,
        "ss_sd_model_name": base_model,
        "ss_output_name": title,
        "ss_network_dim": str(int(rank)),
        "ss_network_alpha": _text(alpha),
        "ss_learning_rate": _text(cfg.lr),
        "ss_optimizer": cfg.optimizer,
        "ss_lr_scheduler": cfg.schedule,
        "ss_lr_warmup_steps": str(cfg.warmup),
        "ss_max_train_steps": str(steps),
        "ss_batch_size_per_device": str(cfg.batch_size),
        "ss_gradient_accumulation_steps": str(cfg.grad_accum),
        "ss_max_grad_norm": _text(cfg.max_grad_norm),
        "ss_seed": str(cfg.seed),
        "ss_resolution": ", ".join(f"({r}, {r})" for r in cfg.resolution),
        "ss_caption_dropout_rate": _text(cfg.caption_dropout),
        "ss_timestep_sampling": cfg.timestep_sampling,
        "ss_discrete_flow_shift": _text(cfg.shift),
        "ss_guidance_scale": _text(cfg.guidance),
        "ss_num_train_images": str(images),
        "ss_dataset_dirs": json.dumps(dirs, sort_keys=True),
        "ss_tag_frequency": json.dumps(tags, sort_keys=True),
        "ss_training_started_at": _text(round(started, 3)),
        "ss_training_finished_at": _text(round(finished, 3)),
    }
    if cfg.trigger:
        header["modelspec.trigger_phrase"] = cfg.trigger
    if cfg.ema_decay:
        header["ss_ema_decay"] = _text(cfg.ema_decay)  # the file holds the moving average
    if cfg.lora_dropout:
        header["ss_network_dropout"] = _text(cfg.lora_dropout)
    if cfg.use_dora or cfg.use_rslora:
        header["ss_network_args"] = json.dumps({k: True for k in ("use_dora", "use_rslora") if getattr(cfg, k)})
    if getattr(cfg, "lora_type", "lora") != "lora":  # as kohya's LyCORIS runs record theirs
        header["ss_network_module"] = "lycoris.kohya"
        header["ss_network_args"] = json.dumps({"algo": cfg.lora_type, **({"factor": cfg.lokr_factor}
                                                                          if cfg.lora_type == "lokr" else {})})
    return header

