"""kohya sd-scripts' training keys in a ``--config`` file: read as SquareQ's where they mean the same, and a sentence
for each one that does not.

A kohya user's ``flux_train_network.py`` TOML (``network_dim``, ``learning_rate``, ``train_data_dir``, ...) works as
a SquareQ config for what both trainers share. Keys whose behaviour SquareQ always has (gradient checkpointing,
cached latents, bf16) are dropped with a warning; keys naming something SquareQ does differently or not at all are
refused, each with its own sentence, so nothing is silently ignored. musubi-tuner's and ai-toolkit's control keys
(``control_directory``, ``control_path``, train/controls.py) are read the same way beside ``data``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config_values import SCHEDULES
from .controls import ALIASES as CONTROL_ALIASES
from .controls import unsupported_key

log = logging.getLogger("squareq.train")


class KohyaKeyError(ValueError):
    """kohya keys that SquareQ cannot take; the message has one sentence per key."""


def _resolution(value: Any, kohya: bool) -> Any:
    """kohya's ``"W,H"`` as one size when square; in a kohya file a non-square one is refused (SquareQ's comma list
    means several square sizes, each trained, which is not what it says there)."""
    if isinstance(value, str) and "," in value:
        parts = [p.strip() for p in value.split(",")]
        if len(parts) == 2 and parts[0] == parts[1] and parts[0].isdigit():
            return int(parts[0])
        if kohya and len(parts) == 2:
            raise KohyaKeyError(f"resolution = {value!r}: kohya's \"W,H\" is one bucket area, while SquareQ reads a "
                                "comma list as several sizes; give one side, e.g. resolution = 1024, or a list such "
                                "as [512, 1024].")
    return value


def _optimizer(value: Any) -> Any:
    names = {"adamw": "adamw", "adamw8bit": "adamw8bit", "bitsandbytes.optim.adamw8bit": "adamw8bit",
             "prodigy": "prodigy", "prodigyopt.prodigy": "prodigy", "adafactor": "adafactor",
             "transformers.optimization.adafactor": "adafactor"}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise KohyaKeyError(f"optimizer_type = {value!r}: SquareQ trains with adamw, adamw8bit, prodigy or adafactor; set "
                        "optimizer to one of them.")


def _schedule(value: Any) -> Any:
    if value in SCHEDULES:
        return value
    raise KohyaKeyError(f"lr_scheduler = {value!r}: SquareQ's schedules are {', '.join(SCHEDULES)} (all after "
                        "--warmup); set schedule to one of them.")


def _weighting(value: Any) -> Any:
    if value in ("none", "sigma_sqrt", "cosmap"):
        return value
    raise KohyaKeyError(f"weighting_scheme = {value!r}: SquareQ's loss weightings are none, sigma_sqrt and cosmap (its "
                        "timesteps are drawn by timestep_sampling instead); set loss_weighting to one of them.")


def _tracker(value: Any) -> Any:
    if value in ("tensorboard", "wandb"):
        return value
    raise KohyaKeyError(f"log_with = {value!r}: SquareQ logs to one tracker besides its metrics.jsonl, tensorboard or "
                        "wandb; set log to one of them.")


def _mixed_precision(value: Any) -> Any:
    if value in ("bf16", "fp16"):
        return value
    raise KohyaKeyError(f"mixed_precision = {value!r}: SquareQ trains the LoRA in fp32 under bf16 or fp16 autocast; "
                        "set dtype to bf16, fp16 or auto (fp16 only on GPUs without bf16).")


def _network_module(value: Any) -> Any:
    if value != "networks.lora_flux":
        raise KohyaKeyError(f"network_module = {value!r}: SquareQ trains a plain LoRA (networks.lora_flux); remove "
                            "the key or set it to networks.lora_flux.")
    return None


# kohya key -> (SquareQ key, value conversion); None: same value
RENAMED: dict[str, tuple[str | None, Callable[[Any], Any] | None]] = {
    "network_dim": ("rank", None),
    "network_alpha": ("alpha", None),
    "learning_rate": ("lr", None),
    "unet_lr": ("lr", None),
    "max_train_steps": ("steps", None),
    "max_train_epochs": ("epochs", None),
    "train_batch_size": ("batch_size", None),
    "gradient_accumulation_steps": ("grad_accum", None),
    "lr_scheduler": ("schedule", _schedule),
    "lr_warmup_steps": ("warmup", None),
    "lr_scheduler_num_cycles": ("schedule_cycles", None),
    "lr_scheduler_power": ("schedule_power", None),
    "optimizer_type": ("optimizer", _optimizer),
    "caption_extension": ("caption_ext", None),
    "caption_dropout_rate": ("caption_dropout", None),
    "bucket_no_upscale": ("no_upscale", None),
    "save_every_n_steps": ("save_every", None),
    "sample_every_n_steps": ("sample_every", None),
    "output_name": ("title", None),
    "metadata_title": ("title", None),
    "discrete_flow_shift": ("shift", None),
    "guidance_scale": ("guidance", None),
    "t5xxl_max_token_length": ("max_sequence_length", None),
    "train_data_dir": ("data", None),
    "output_dir": ("output", None),
    "network_module": (None, _network_module),
    "weighting_scheme": ("loss_weighting", _weighting),
    "validate_every_n_steps": ("validate_every", None),
    "conditioning_data_dir": ("mask_dir", None),
    "reg_data_dir": ("reg_data", None),
    "log_with": ("log", _tracker),
    "mixed_precision": ("dtype", _mixed_precision),
    "log_tracker_name": ("wandb_project", None),
    "t5xxl": ("t5", None),
    "ae": ("vae", None),
}

# what SquareQ always does: dropped with this sentence as a warning
ALWAYS = {
    "gradient_checkpointing": "SquareQ always checkpoints its streamed blocks",
    "cache_latents": "SquareQ always caches latents (and text embeddings)",
    "cache_latents_to_disk": "SquareQ's cache is always on disk",
    "cache_text_encoder_outputs": "SquareQ always caches text embeddings",
    "cache_text_encoder_outputs_to_disk": "SquareQ's cache is always on disk",
    "save_precision": "SquareQ saves LoRA factors in bf16",
    "sdpa": "SquareQ uses PyTorch's scaled-dot-product attention",
    "enable_bucket": "SquareQ always buckets by aspect ratio",
    "persistent_data_loader_workers": "SquareQ reads the cache on its own thread",
    "max_data_loader_n_workers": "SquareQ reads the cache on its own thread",
    "save_model_as": "SquareQ writes safetensors",
    "network_train_unet_only": "SquareQ trains the denoiser's LoRA only",
    "fp8_base": "SquareQ's slab already holds the weights at 4-8 bits",
    "highvram": "SquareQ streams blocks whatever the card",
    "lowvram": "SquareQ streams blocks whatever the card",
    "validation_seed": "SquareQ's validation noise and timesteps are fixed by seed",
}

# kohya keys SquareQ has no counterpart for: refused with this sentence
UNSUPPORTED = {
    "pretrained_model_name_or_path": "the model is the slab: give it as `squareq train SLAB` (compile it first with "
                                     "`squareq compile`), and the encoders' pipeline folder or Hub ID as model",
    "network_args": "SquareQ's LoRA takes no network_args; choose layers with targets",
    "network_dropout": "kohya drops the LoRA's rank activations (lora_down's output), SquareQ's lora_dropout (PEFT's) "
                       "drops the layer's input; set lora_dropout if that is what you want, and remove network_dropout",
    "model_prediction_type": "SquareQ trains FLUX.1 on the flow-matching velocity (kohya's raw); remove the key",
}


def translate(table: dict[str, Any], where: str, known: set[str]) -> dict[str, Any]:
    """``table`` with kohya's keys renamed to SquareQ's (``known``); the rest untouched. Raises
    :class:`KohyaKeyError` naming ``where`` with one sentence per kohya key it cannot take."""
    out: dict[str, Any] = {}
    problems = []
    kohya = any(k in RENAMED or k in ALWAYS or k in UNSUPPORTED for k in table)
    if "unet_lr" in table:  # kohya trains the denoiser at unet_lr where both are given
        table = {k: v for k, v in table.items() if k != "learning_rate"}
    for key, value in table.items():
        if key == "resolution":
            try:
                out[key] = _resolution(value, kohya)
            except KohyaKeyError as exc:
                problems.append(str(exc))
        elif key == "timestep_sampling" and value == "sigmoid":
            out[key] = "logit_normal"  # kohya's sigmoid(N(0, 1)) is the logit-normal density
        elif kohya and key == "timestep_sampling" and value == "shift":
            log.warning("%s: timestep_sampling = shift: kohya shifts a sigmoid(N(0, 1)) draw, SquareQ's shift a "
                        "uniform one (diffusers' scheduler map); flux_shift is kohya's flux_shift exactly.", where)
            out[key] = value
        elif kohya and key == "sample_prompts" and isinstance(value, str):
            path = Path(value).expanduser()
            if path.suffix == ".txt" and path.is_file():
                out[key] = value  # read as kohya's prompt file, options and all (train/prompt_options.py)
            else:
                problems.append(f"sample_prompts = {value!r}: kohya's is a file of prompts, and SquareQ reads a .txt "
                                "one (one prompt a line, with --w --h --s --g --d --n --l) that exists; give such a "
                                "file, or the prompts themselves, e.g. sample_prompts = [\"a photo of sks\"].")
        elif key in known:
            out[key] = value
        elif key in CONTROL_ALIASES or unsupported_key(key):  # musubi-tuner's and ai-toolkit's control keys
            if unsupported_key(key):
                problems.append(unsupported_key(key))
            elif CONTROL_ALIASES[key] in table or CONTROL_ALIASES[key] in out:
                problems.append(f"{key} and {CONTROL_ALIASES[key]} both set {CONTROL_ALIASES[key]}; keep one.")
            else:
                out[CONTROL_ALIASES[key]] = value
        elif key in RENAMED:
            ours, convert = RENAMED[key]
            try:
                value = convert(value) if convert else value
            except KohyaKeyError as exc:
                problems.append(str(exc))
                continue
            if ours is None:
                continue
            if ours in table or ours in out:
                problems.append(f"{key} and {ours} both set {ours}; keep one.")
                continue
            out[ours] = value
        elif key in ALWAYS:
            log.warning("%s: %s = %r ignored: %s.", where, key, value, ALWAYS[key])
        elif key in UNSUPPORTED:
            problems.append(f"{key}: {UNSUPPORTED[key]}.")
        else:
            out[key] = value  # the caller names unknown keys
    if problems:
        raise KohyaKeyError(f"{where}: " + " ".join(problems))
    return out
