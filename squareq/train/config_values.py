"""The values each `squareq train` key may take: the choice lists (which kohya_keys and the CLI use too), the limits,
and the checks :meth:`TrainConfig.validate <squareq.train.config.TrainConfig.validate>` runs over a configuration.

Each check takes the configuration and ``bad(key, why)``, which builds the error naming the key; the first value that
cannot work raises it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

from ..runtime.attention_choice import MODES as ATTENTION_MODES
from ..runtime.block_compile import MODES as COMPILE_MODES
from ..runtime.compute import DTYPES
from ..runtime.compute import MODES as COMPUTE_MODES
from ..runtime.peft_lora import KINDS
from .data import refused_character
from .objective import LOSS_WEIGHTINGS, TIMESTEP_MODES
from .prompt_options import MAX_GUIDANCE, MAX_STEPS, PromptError, parse_prompt

log = logging.getLogger("squareq.train")

OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adafactor")
# diffusers' get_scheduler names (kohya's lr_scheduler values); "constant" with a warm-up is constant_with_warmup
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
TIMESTEP_SAMPLING = TIMESTEP_MODES
HOSTS = ("auto", "pinned", "shared", "disk")
DTYPE_CHOICES = (*DTYPES, "auto")
OFFLOAD_MODES = ("auto", "on", "off")
CUDA_GRAPHS = ("auto", "on", "off")
LOGGERS = ("jsonl", "tensorboard", "wandb")
SAVE_FORMATS = ("diffusers", "kohya", "peft")
# seeds go to numpy's legacy seeding and kohya's set_seed as well as torch's, which take 0 to 2**32 - 1
MAX_SEED = 2**32 - 1
# the LoRA's scale alpha/rank: kohya and PEFT users pick 1/rank to 2, so 1024 is far beyond any recipe, and far above
# it the gradients of the B factors (scaled by alpha/rank) overflow float32
MAX_ALPHA_PER_RANK = 1024
# the time shift: 1 is uniform, FLUX's and kohya's default 3, Wan's and HunyuanVideo's recipes 5 to 7; at 100 half
# the drawn times are above 0.99, nearly pure noise, and far above it the shifted time is inf/inf in float32
MAX_SHIFT = 100.0

# builds the error for a key and why its value cannot work (TrainConfig.validate's, which names the file or flag)
Bad = Callable[[str, str], Exception]


def check_numbers(cfg, bad: Bad) -> None:
    """Choices, counts and numeric ranges."""
    for key, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("host", HOSTS),
                         ("compute", COMPUTE_MODES), ("dtype", DTYPE_CHOICES), ("cuda_graphs", CUDA_GRAPHS),
                         ("compile", COMPILE_MODES), ("attention", ATTENTION_MODES),
                         ("loss_weighting", LOSS_WEIGHTINGS), ("timestep_sampling", TIMESTEP_SAMPLING),
                         ("log", LOGGERS), ("offload_activations", OFFLOAD_MODES)):
        if getattr(cfg, key) not in choices:
            raise bad(key, f"is not one of {', '.join(choices)}")
    if cfg.prefetch != "auto" and (not isinstance(cfg.prefetch, int) or isinstance(cfg.prefetch, bool)
                                   or cfg.prefetch < 1):
        raise bad("prefetch", "must be auto or a whole number of at least 1")
    if cfg.resident_blocks != "auto" and (not isinstance(cfg.resident_blocks, int)
                                          or isinstance(cfg.resident_blocks, bool) or cfg.resident_blocks < 0):
        raise bad("resident_blocks", "must be auto or a whole number of at least 0")
    if cfg.dtype == "fp16" and cfg.compute == "fp8":
        raise bad("compute", "with dtype = fp16: FP8 compute runs in bf16 runs only (GPUs with FP8 tensor cores "
                             "have bf16 too); choose compute = auto or bf16, or dtype = bf16")
    for key in ("rank", "batch_size", "grad_accum", "nan_patience", "sample_steps",
                "max_sequence_length", "keep_last", "schedule_cycles"):
        if not isinstance(getattr(cfg, key), int) or getattr(cfg, key) < 1:
            raise bad(key, "must be a whole number of at least 1")
    if cfg.sample_steps > MAX_STEPS:  # the bound of a prompt's --s and squareq sample --steps
        raise bad("sample_steps", f"must be at most {MAX_STEPS} (20-50 is usual)")
    for key in ("warmup", "save_every", "sample_every", "seed", "keep_tokens", "validate_every"):
        if not isinstance(getattr(cfg, key), int) or getattr(cfg, key) < 0:
            raise bad(key, "must be a whole number of at least 0")
    if cfg.steps is None and cfg.epochs is None:
        raise bad("steps", "is unset and so is epochs; give one of them")
    for key in ("steps", "epochs"):
        value = getattr(cfg, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise bad(key, "must be a whole number of at least 1")
    for key, low, strict in (("alpha", 0.0, True), ("shift", 0.0, True), ("schedule_power", 0.0, True),
                             ("weight_decay", 0.0, False),
                             ("max_grad_norm", 0.0, False), ("guidance", 0.0, False),
                             ("sample_guidance", 0.0, False), ("caption_dropout", 0.0, False)):
        value = getattr(cfg, key)
        if value is None and key == "alpha":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or value < low or (strict and value == low):
            raise bad(key, f"must be a finite number {'above' if strict else 'of at least'} {low:g}")
    for key in ("guidance", "sample_guidance"):
        if getattr(cfg, key) > MAX_GUIDANCE:
            raise bad(key, f"must be at most {MAX_GUIDANCE:g} (3.5 is usual for FLUX.1-dev, about 7 for CFG "
                           "models)")
    if not isinstance(cfg.ema_decay, (int, float)) or isinstance(cfg.ema_decay, bool) \
            or not 0.0 <= cfg.ema_decay < 1.0:
        raise bad("ema_decay", "must be in [0, 1): 0 turns the average off, 0.999 is usual")
    if not 0.0 <= cfg.caption_dropout < 1.0:
        raise bad("caption_dropout", "must be in [0, 1)")
    if not isinstance(cfg.lora_dropout, (int, float)) or isinstance(cfg.lora_dropout, bool) \
            or not 0.0 <= cfg.lora_dropout < 1.0:
        raise bad("lora_dropout", "must be in [0, 1), e.g. 0.1")
    if not isinstance(cfg.lr, (int, float)) or isinstance(cfg.lr, bool) or not math.isfinite(cfg.lr) \
            or cfg.lr <= 0:
        raise bad("lr", "must be a finite positive number, e.g. 1e-4")


def check_limits(cfg, bad: Bad) -> None:
    """Upper limits a finite value can still break: seeds, alpha, shift and weight decay."""
    for key in ("seed", "sample_seed"):
        value = getattr(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
            raise bad(key, f"must be a whole number from 0 to {MAX_SEED} (2**32 - 1, the seeds numpy and kohya "
                           "take)")
    if cfg.alpha is not None and cfg.alpha > MAX_ALPHA_PER_RANK * cfg.rank:
        raise bad("alpha", f"must be at most {MAX_ALPHA_PER_RANK} × rank ({MAX_ALPHA_PER_RANK * cfg.rank} "
                           "here): the LoRA is scaled by alpha/rank, 1 when alpha = rank")
    if cfg.shift > MAX_SHIFT:
        raise bad("shift", f"must be at most {MAX_SHIFT:g} (3 is FLUX's and kohya's default, 1 is uniform)")
    # each step multiplies the weights by 1 - lr × weight_decay; once that is below -1 they grow without end
    if cfg.weight_decay > 1:
        raise bad("weight_decay", "must be at most 1 (AdamW's usual values are 1e-4 to 0.1)")


def check_texts(cfg, bad: Bad) -> None:
    """Sample prompts that can be drawn, and no control character in a trigger word or prompt."""
    for prompt in cfg.sample_prompts or []:
        try:
            parse_prompt(prompt, true_cfg_only=False)  # the family's rule on --n is checked when the slab opens
        except PromptError as exc:
            raise bad("sample_prompts", f"cannot be drawn: {exc}") from None
    for key in ("trigger", "sample_prompts"):
        value = getattr(cfg, key)
        texts = [value] if isinstance(value, str) else value or []
        char = next(filter(None, map(refused_character, texts)), None)
        if char:
            raise bad(key, f"holds the control character {char}; write it as plain text (tabs and line breaks "
                           "are fine)")


def check_data(cfg, bad: Bad) -> None:
    """The data keys: resolutions, captions, shuffling and validation images; then masks and the adapter."""
    if not isinstance(cfg.resolution, list) or not cfg.resolution \
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in cfg.resolution):
        raise bad("resolution", "must be a whole number of pixels, or several, e.g. [512, 1024]")
    if min(cfg.resolution) < 64:
        raise bad("resolution", "must be at least 64 (aspect-ratio buckets have sides in steps of 64)")
    if any(r % 16 for r in cfg.resolution):
        raise bad("resolution", "must be a multiple of 16 (FLUX packs 2x2 latent patches of an 8x VAE)")
    if len(set(cfg.resolution)) != len(cfg.resolution):
        raise bad("resolution", "names a size twice; list each once")
    if cfg.targets is not None and (not cfg.targets or not all(isinstance(t, str) and t for t in cfg.targets)):
        raise bad("targets", "must be a non-empty list of layer name patterns, e.g. [\"to_q\", \"to_k\"]")
    if not isinstance(cfg.caption_ext, str) or len(cfg.caption_ext) < 2 or "/" in cfg.caption_ext \
            or "\\" in cfg.caption_ext:
        raise bad("caption_ext", "is not a file extension; give one such as .txt or .caption")
    for key in ("no_upscale", "shuffle_caption", "use_dora", "use_rslora", "flip_aug", "masked_loss", "alpha_mask"):
        if not isinstance(getattr(cfg, key), bool):
            raise bad(key, "must be true or false")
    _check_masks(cfg, bad)
    _check_controls(cfg, bad)
    _check_adapter(cfg, bad)
    if cfg.wandb_project != "squareq" and cfg.log != "wandb":
        raise bad("wandb_project", "names a Weights & Biases project, and log is not wandb; set log = \"wandb\" "
                                   "(--log wandb) or remove wandb_project")
    if not isinstance(cfg.prior_loss_weight, (int, float)) or isinstance(cfg.prior_loss_weight, bool) \
            or not 0.0 <= cfg.prior_loss_weight < math.inf:
        raise bad("prior_loss_weight", "must be a number of at least 0, e.g. 1.0")
    if cfg.prior_loss_weight != 1.0 and not cfg.reg_data:
        raise bad("prior_loss_weight", "weighs regularisation images, and reg_data names none; set reg_data "
                                       "(--reg-data FOLDER) or remove prior_loss_weight")
    if not isinstance(cfg.caption_orders, int) or isinstance(cfg.caption_orders, bool) \
            or not 1 <= cfg.caption_orders <= 64:
        raise bad("caption_orders", "must be a whole number from 1 to 64")
    if not isinstance(cfg.validation_split, (int, float)) or isinstance(cfg.validation_split, bool) \
            or not 0.0 <= cfg.validation_split < 1.0:
        raise bad("validation_split", "must be in [0, 1): the fraction of images held out, e.g. 0.1")
    if cfg.validation_split and cfg.validation_data:
        raise bad("validation_split", "and validation_data both choose validation images; keep one")
    if cfg.keep_tokens and not cfg.shuffle_caption:
        raise bad("keep_tokens", "only applies with shuffle_caption; set shuffle_caption = true "
                                 "(--shuffle-caption) or remove keep_tokens")


def _check_masks(cfg, bad: Bad) -> None:
    """masked_loss with exactly one source of masks, and a source only with masked_loss (kohya's rule: nothing
    set here is silently unused)."""
    sources = [k for k in ("alpha_mask", "mask_dir") if getattr(cfg, k)]
    if cfg.masked_loss and not sources:
        raise bad("masked_loss", "needs masks: set alpha_mask = true (--alpha-mask) to use each image's alpha "
                                 "channel, or mask_dir = FOLDER (--mask-dir) for mask images")
    if sources and not cfg.masked_loss:
        raise bad(sources[0], "only takes effect with masked_loss = true; set it (--masked-loss) or remove "
                              f"{sources[0]}")
    if len(sources) > 1:
        raise bad("mask_dir", "and alpha_mask both give masks; keep one")
    if cfg.mask_dir is not None and not Path(cfg.mask_dir).expanduser().is_dir():
        raise bad("mask_dir", "is not a folder; give the folder that holds the masks")


def _check_controls(cfg, bad: Bad) -> None:
    """The edit-pair keys (train/controls.py): folders that exist, a control area of at least 64², and none of the
    keys whose images would have no controls or lose their pairing (flipped targets, regularisation and validation
    folders)."""
    if cfg.control_dir is not None:
        if not cfg.control_dir or not all(isinstance(f, str) and f.strip() for f in cfg.control_dir):
            raise bad("control_dir", "must name a folder of control images, or a list of them")
        missing = next((f for f in cfg.control_dir if not Path(f).expanduser().is_dir()), None)
        if missing is not None:
            raise bad("control_dir", f"names {missing}, which is not a folder; give the folder that holds the control "
                                     "images")
    value = cfg.control_resolution
    if value is not None and (len(value) not in (1, 2) or min(value) < 16 or math.prod(value) < 64 * 64):
        raise bad("control_resolution", "must be [width, height] or one side, of an area of at least 64x64 pixels, "
                                        "e.g. [1024, 1024]")
    if not isinstance(cfg.no_resize_control, bool):
        raise bad("no_resize_control", "must be true or false")
    if not cfg.control_dir:
        return
    for key, why in (("flip_aug", "would flip the target and not its control"),
                     ("reg_data", "mixes in images without controls"),
                     ("validation_data", "holds images without controls; hold out pairs with validation_split")):
        if getattr(cfg, key):
            raise bad(key, f"with control_dir (edit pairs) {why}; remove {key}")


def warn_ignored(cfg) -> None:
    """Options set away from their default whose setting the run would ignore: one warning each (the fourth audit:
    they were ignored silently), said once where a command reads its configuration (config.load_config), not at
    each validation (the fifth audit saw each three times). Not refused, unlike lokr_factor: kohya's configs carry
    them whatever the schedule (lr_scheduler_power, discrete_flow_shift), and kohya ignores them too."""
    from ..models.noising import DEFAULT_SHIFT

    for key, default, applies, when in (
            ("schedule_cycles", 1, cfg.schedule == "cosine_with_restarts", "schedule = \"cosine_with_restarts\""),
            ("schedule_power", 1.0, cfg.schedule == "polynomial", "schedule = \"polynomial\""),
            ("shift", DEFAULT_SHIFT, cfg.timestep_sampling == "shift", "timestep_sampling = \"shift\""),
            ("caption_orders", 8, cfg.shuffle_caption, "shuffle_caption = true")):
        if getattr(cfg, key) != default and not applies:
            log.warning("%s = %s only applies with %s, so this run ignores it.", key, getattr(cfg, key), when)


def _check_adapter(cfg, bad: Bad) -> None:
    """lora_type and what goes with it."""
    if cfg.lora_type not in KINDS:
        raise bad("lora_type", f"is not one of {', '.join(KINDS)}")
    if not isinstance(cfg.lokr_factor, int) or isinstance(cfg.lokr_factor, bool) \
            or not (cfg.lokr_factor == -1 or cfg.lokr_factor >= 1):
        raise bad("lokr_factor", "must be -1 (balanced) or a whole number of at least 1")
    if cfg.lokr_factor != -1 and cfg.lora_type != "lokr":  # ignored, it would train another adapter than asked
        raise bad("lokr_factor", f"sets LoKr's Kronecker factor, and lora_type is {cfg.lora_type}; set lora_type = "
                                 "\"lokr\" or remove lokr_factor")
    if cfg.lora_type == "lora":
        if cfg.save_format is not None and "peft" in cfg.save_format:
            raise bad("save_format", "names peft, the folder LoKr and LoHa are written as; a LoRA is written as "
                                     "diffusers and kohya files")
        return
    given = [k for k in ("use_dora", "use_rslora") if getattr(cfg, k)] + (["lora_dropout"] if cfg.lora_dropout
                                                                           else [])
    if given:
        raise bad("lora_type", f"is a LyCORIS adapter, and {', '.join(given)} {'is' if len(given) == 1 else 'are'} "
                               "LoRA's only; remove it or set lora_type = \"lora\"")
    if cfg.save_format is not None and set(cfg.save_format) - {"peft", "kohya"}:
        raise bad("save_format", f"names {', '.join(f for f in cfg.save_format if f not in ('peft', 'kohya'))}, "
                                 f"which holds LoRA factors only; a {cfg.lora_type} adapter is written as a PEFT "
                                 "folder and a LyCORIS file: save_format = peft, kohya or both")
