"""`squareq train`'s configuration: one dataclass, read from TOML, overridden flag by flag, printed back.

Precedence: built-in defaults < ``--config train.toml`` < command-line flags. ``squareq train
--print-config`` prints the resolved configuration as TOML that ``--config`` reads back unchanged.
Defaults follow what users of kohya sd-scripts, ai-toolkit and SimpleTuner expect for a FLUX LoRA
(docs/train.md lists each choice).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..models import ADAPTERS
from ..runtime.attention_choice import MODES as ATTENTION_MODES
from ..runtime.block_compile import MODES as COMPILE_MODES
from ..runtime.compute import DTYPES
from ..runtime.compute import MODES as COMPUTE_MODES
from ..runtime.lora import DEFAULT_TARGETS
from ..runtime.peft_lora import KINDS, LoraVariant
from ..sizes import SizeError, parse_size
from .data import refused_character
from .encoder_source import SINGLE_FILE_FLAGS
from .kohya_keys import KohyaKeyError
from .kohya_keys import translate as translate_kohya_keys
from .objective import DEFAULT_GUIDANCE, DEFAULT_SHIFT, LOSS_WEIGHTINGS, TIMESTEP_MODES
from .prompt_options import MAX_GUIDANCE, MAX_STEPS, PromptError, parse_prompt, read_prompt_file

OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adafactor")
# diffusers' get_scheduler names (kohya's lr_scheduler values); "constant" with a warm-up is constant_with_warmup
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
TIMESTEP_SAMPLING = TIMESTEP_MODES
HOSTS = ("auto", "pinned", "shared", "disk")
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
# the title names OUT/<title>_kohya.safetensors: 200 bytes, the suffix (18) and a temporary name's (14) stay within
# the 255 bytes a file name may have
MAX_TITLE_BYTES = 200
# the largest guidance (embedded, or a CFG scale) a run or a sample image takes: FLUX.1-dev's usual is 3.5 and CFG
# models' about 7, while a value like 1e300 overflows the pipeline's float32 guidance tensor (a traceback, not an image)


# One line per key for `squareq train --help` and docs/cli.md (the CLI makes a flag of every key).
HELP = {
    "model": "The pipeline with the VAE and text encoders: a diffusers folder or a Hugging Face Hub ID (default: what "
             "the slab records, the encoders it was compiled with).",
    "revision": "The branch, tag or commit of a Hub ID given as model.",
    "clip_l": "CLIP-L text encoder as a single file (ComfyUI's clip_l.safetensors), in place of the pipeline's, whose "
              "configs and tokenizers still come from the pipeline (for a FLUX.1 file with no pipeline: "
              "black-forest-labs/FLUX.1-dev's, a few MB).",
    "clip_g": "CLIP-G text encoder as a single file (SD3/SDXL's second CLIP), in place of the pipeline's.",
    "t5": "T5 text encoder as a single file (ComfyUI's t5xxl_fp16.safetensors, or t5xxl_fp8_e4m3fn.safetensors, "
          "upcast on load), in place of the pipeline's.",
    "vae": "VAE as a single file (BFL's ae.safetensors for FLUX.1), in place of the pipeline's.",
    "cache_dir": "Where cached latents and text embeddings go (default: OUT/cache).",
    "rank": "LoRA rank.",
    "alpha": "LoRA alpha; the update is scaled by alpha/rank (default: alpha = rank).",
    "targets": "Comma-separated layer name patterns for LoRA, matched like PEFT target_modules (default: the "
               "family's; FLUX.1: every attention and MLP linear of both streams, as kohya's FLUX default; other "
               "families: to_q,to_k,to_v,to_out.0).",
    "use_dora": "Train DoRA (weight-decomposed LoRA: a trained magnitude per output row) through PEFT's layers; "
                "written in the diffusers file only.",
    "use_rslora": "Scale the LoRA by alpha/sqrt(rank) instead of alpha/rank (rank-stabilised LoRA, through PEFT's "
                  "layers).",
    "lora_dropout": "Dropout on the LoRA's input while training (through PEFT's layers), e.g. 0.1.",
    "lora_type": "The adapter: lora; lokr (LyCORIS' Kronecker-product adapter, rank is its low-rank factor's rank) "
                 "or loha (LyCORIS' Hadamard product of two rank-r pairs), both through PEFT's layers and written "
                 "as a PEFT adapter folder (OUT/<title>_peft, PeftModel.from_pretrained loads it); ai-toolkit's "
                 "network type, kohya's LyCORIS algo.",
    "lokr_factor": "LoKr's decompose factor (ai-toolkit's lokr_factor, PEFT's decompose_factor): -1 splits each "
                   "layer's sides as evenly as they factor, N makes the Kronecker product's first factor at most "
                   "N x N.",
    "lr": "Learning rate.",
    "optimizer": "adamw, adamw8bit (needs bitsandbytes), prodigy (needs prodigyopt; use lr 1.0) or adafactor.",
    "weight_decay": "AdamW weight decay.",
    "schedule": "Learning-rate schedule after --warmup, by diffusers' names: constant (constant_with_warmup is the "
                "same), linear (to 0), cosine (a half cosine to 0), cosine_with_restarts (--schedule-cycles half "
                "cosines) or polynomial (to 0 with --schedule-power).",
    "schedule_cycles": "cosine_with_restarts: how many times the learning rate falls to 0 and starts again (kohya's "
                       "lr_scheduler_num_cycles).",
    "schedule_power": "polynomial: the power of the decay, 1 is linear (kohya's lr_scheduler_power).",
    "warmup": "Steps of linear learning-rate warm-up.",
    "steps": "Optimizer steps to train.",
    "epochs": "Passes over the data; when given, decides the length instead of --steps.",
    "batch_size": "Images per step (per GPU).",
    "grad_accum": "Batches whose gradients are summed before each optimizer step.",
    "max_grad_norm": "Clip the LoRA gradient norm to this (0: no clipping).",
    "ema_decay": "Keep an exponential moving average of the LoRA weights with this decay, e.g. 0.999, and write it as "
                 "the final LoRA (0: off).",
    "resolution": "Training side in pixels; images go to aspect-ratio buckets of about resolution² pixels. Several, "
                  "comma-separated (512,768,1024), train every image at each.",
    "caption_dropout": "Probability of training a step with an empty caption (the trigger word is kept).",
    "trigger": "Trigger word put in front of every caption, or in place of [trigger] where a caption has it.",
    "shuffle_caption": "Shuffle each caption's comma-separated tags (kohya's shuffle_caption): caption_orders shuffles "
                       "of every caption are encoded into the cache, and each epoch trains an image with the next.",
    "keep_tokens": "With shuffle_caption, the leading tags that stay in place (the trigger word stays first "
                   "without being counted).",
    "caption_orders": "With shuffle_caption, how many shuffled orders of each caption are encoded (more orders, more "
                      "variety and more cache space: 8 MB each with FLUX's 512 T5 tokens).",
    "caption_ext": "Extension of the caption files next to the images: .txt, or e.g. .caption (kohya's).",
    "flip_aug": "Also cache each training image's horizontally flipped latents and train on them half of the time "
                "(seeded per image and epoch, so a resumed run makes the same choices); kohya's flip_aug. Leave it "
                "off for subjects whose sides differ (text, logos, asymmetric faces).",
    "masked_loss": "Weight each training image's loss by a mask (kohya's masked_loss): white or opaque trains, black "
                   "or transparent is ignored. The masks come from alpha_mask or mask_dir.",
    "alpha_mask": "With masked_loss: each image's alpha channel is its mask (kohya's alpha_mask).",
    "mask_dir": "With masked_loss: a folder of grey-level masks named like the training images (same path below it, "
                "any image extension; kohya's conditioning_data_dir, ai-toolkit's mask_path). An image without one "
                "trains unmasked, with a warning.",
    "no_upscale": "Train an image smaller than its bucket at its own size (in steps of 64, center-cropped) instead "
                  "of enlarging it, like kohya's --bucket_no_upscale.",
    "reg_data": "A folder of regularisation (prior) images with captions, read like --data (kohya's reg_data_dir): "
                "each epoch mixes in as many of their entries as it has training entries, their loss weighted by "
                "prior_loss_weight.",
    "prior_loss_weight": "Weight of the regularisation images' loss against the training images' (kohya's "
                         "prior_loss_weight).",
    "validation_data": "A folder of held-out images with captions (read like --data) whose loss is measured during "
                       "training at fixed timesteps and noise.",
    "validation_split": "Hold this fraction of --data's images out of training and measure their loss instead (kohya's "
                        "validation_split), e.g. 0.1.",
    "validate_every": "Measure the validation loss every N steps (0: with every checkpoint); always at step 0 and "
                      "at the end.",
    "seed": "Seed for LoRA init, batch order, noise and timesteps.",
    "timestep_sampling": "shift, logit_normal, uniform, or flux_shift (FLUX.1's resolution-dependent shift of a "
                         "logit-normal draw, kohya's flux_shift).",
    "loss_weighting": "Per-sample loss weights of flow matching: none, sigma_sqrt or cosmap (diffusers' SD3/FLUX "
                      "schemes).",
    "shift": "Time shift for timestep_sampling = shift.",
    "guidance": "Embedded guidance value given to guidance-distilled models during training.",
    "max_sequence_length": "Text-encoder tokens per caption (T5, UMT5, Mistral, Qwen, LLaMA); SD 1.5/SDXL's CLIP "
                           "always takes 77.",
    "save_every": "Write a checkpoint every N steps (0: only at the end).",
    "keep_last": "Checkpoints to keep.",
    "sample_every": "Sample images every N steps (0: never).",
    "sample_prompts": "A prompt to sample (repeat the flag for several), with kohya's per-prompt options if wanted "
                      "(\"a fox --w 768 --h 1024 --s 28 --g 3.5 --d 7 --n blurry --l 4\"); in a config file also the "
                      "path of a prompt file, one prompt a line (kohya's sample_prompts).",
    "sample_seed": "Seed for sample images.",
    "sample_steps": "Denoising steps per sample image, 1 to 1000.",
    "sample_guidance": "Guidance scale for sample images.",
    "sample_prior": "Würstchen: the prior's pipeline folder or Hub ID (warp-ai/wuerstchen-prior) for sample images: "
                    "its text encoder and scheduler beside a prior slab being trained, or the whole prior beside a "
                    "decoder slab.",
    "sample_decoder": "Würstchen: the decoder's pipeline folder or Hub ID (warp-ai/wuerstchen) for sample images: its "
                      "text encoder, scheduler and VQGAN beside a decoder slab being trained, or the whole decoder "
                      "beside a prior slab.",
    "log": "Metrics: jsonl (always written), tensorboard, or wandb (Weights & Biases; pip install 'squareq[wandb]'; "
           "WANDB_MODE=offline logs without an account, a resumed run continues the same W&B run).",
    "wandb_project": "The Weights & Biases project of --log wandb (kohya's log_tracker_name).",
    "resume": "Continue from a checkpoint: latest, or a checkpoint folder.",
    "nan_patience": "Stop after this many steps in a row with NaN/Inf losses or gradients.",
    "prefetch": "Block slots on the GPU (the runtime's ring size): auto (measure the second step and add slots until "
                "the block copies hide behind compute, as squareq sample does; within vram_budget when set), or a "
                "whole number.",
    "resident_blocks": "Blocks kept on the GPU for the whole run after the second step, the ones whose copies cost the "
                       "step most first (the inverse of kohya/musubi's blocks_to_swap): 0 (stream every block, the "
                       "least memory), a count, or auto (as many as shorten the step, within vram_budget when set, "
                       "else what the GPU has free less a margin). Results do not change, only speed and memory.",
    "dtype": "The activations' 16-bit type (kohya's mixed_precision): bf16; fp16, for GPUs without bf16 (T4, V100, "
             "RTX 20xx: the base in fp16, the LoRA in fp32, the loss scaled as torch.amp.GradScaler does, no FP8); "
             "or auto: fp16 on GPUs older than Ampere, bf16 elsewhere. The run says when it chose fp16 and why.",
    "compute": "The frozen base layers' arithmetic: bf16; fp8 (E4M3 forward and recompute with per-token and "
               "per-channel scales on GPUs with FP8 tensor cores, Ada and Hopper; input gradients and the LoRA stay "
               "bf16/fp32); or auto: fp8 on GPUs with FP8 tensor cores, bf16 elsewhere. "
               "docs/tuning.md says when to choose which.",
    "host": "Where block blobs wait: auto (pinned when they fit in the host memory available with room to spare, "
            "else disk; the run says which), pinned (RAM; shared by the ranks of a host when several run), shared "
            "(one RAM copy per host, in /dev/shm), or disk.",
    "cuda_graphs": "Capture each streamed block's forward and its recompute + backward as CUDA graphs once (the first "
                   "steps run eagerly while they are captured) and replay them, which takes the host's kernel launches "
                   "out of the step: auto (on with a CUDA GPU, unless lora_dropout is set), on, or off. "
                   "docs/tuning.md says when it pays.",
    "compile": "Run each block's forward under torch.compile (one compiled forward per block kind; the quantized "
               "layers keep their own kernels), which fuses the norms, modulation, rotary embedding and activations "
               "between them: auto (on for FLUX.1 with CUDA GPUs of compute capability 9.0 and up, where it measured "
               "faster; the run says why), on, or off. The first steps compile, about a minute for FLUX.1; "
               "docs/tuning.md.",
    "attention": "Which attention kernels the blocks prefer: auto (cuDNN's first on CUDA GPUs of compute capability "
                 "9.0 and up for heads of 128, FLUX.1's, where they measured twice as fast as flash; torch's order "
                 "elsewhere), cudnn (first on any CUDA GPU), or default (torch's order, flash first). A cuDNN "
                 "failure turns it off for the run and redoes the step; docs/tuning.md.",
    "vram_budget": "Refuse to start if the expected peak GPU memory exceeds this, e.g. 12GB.",
    "save_format": "LoRA files to write: diffusers (pytorch_lora_weights.safetensors), kohya (OUT/<title>_kohya"
                   ".safetensors, with the .alpha tensors ComfyUI reads; FLUX.1 only), or both, comma-separated "
                   "(default: both for FLUX.1, diffusers otherwise); peft (OUT/<title>_peft/, the only one for "
                   "lora_type lokr and loha).",
    "title": "The LoRA's title in its metadata (modelspec.title) and the kohya file's name (default: the output "
             "folder's name).",
}


log = logging.getLogger("squareq.train")


class ConfigError(ValueError):
    """A configuration value cannot be used; the message names the file or flag."""


@dataclass
class TrainConfig:
    """Everything one training run needs. ``None`` means "not set" where a default is derived."""

    slab: str = ""
    data: str = ""
    output: str = ""
    model: str | None = None  # pipeline folder or Hub ID with the VAE and text encoders (default: the slab's record)
    revision: str | None = None  # of a Hub ID given as model
    clip_l: str | None = None  # encoders as single files (ComfyUI's), in place of the pipeline's own
    clip_g: str | None = None
    t5: str | None = None
    vae: str | None = None
    cache_dir: str | None = None  # default: <output>/cache
    # LoRA
    rank: int = 16
    alpha: float | None = None  # default: rank (scale 1)
    targets: list[str] | None = None  # default: the family's (with_family_defaults)
    use_dora: bool = False
    use_rslora: bool = False
    lora_dropout: float = 0.0
    lora_type: str = "lora"
    lokr_factor: int = -1
    # optimization
    lr: float = 1e-4
    optimizer: str = "adamw"
    weight_decay: float = 1e-4
    schedule: str = "constant"
    schedule_cycles: int = 1
    schedule_power: float = 1.0
    warmup: int = 0  # steps of linear warm-up
    steps: int | None = 1000
    epochs: int | None = None  # when set, overrides steps
    batch_size: int = 1
    grad_accum: int = 1
    max_grad_norm: float = 1.0  # 0 turns clipping off
    ema_decay: float = 0.0  # 0: no moving average
    # data
    resolution: list[int] = field(default_factory=lambda: [1024])  # several: every image at each
    caption_dropout: float = 0.0
    trigger: str | None = None
    caption_ext: str = ".txt"
    shuffle_caption: bool = False
    keep_tokens: int = 0
    caption_orders: int = 8
    no_upscale: bool = False
    flip_aug: bool = False
    masked_loss: bool = False
    alpha_mask: bool = False
    mask_dir: str | None = None
    reg_data: str | None = None
    prior_loss_weight: float = 1.0
    validation_data: str | None = None
    validation_split: float = 0.0
    validate_every: int = 0  # 0: with every checkpoint
    seed: int = 42
    # objective
    timestep_sampling: str = "shift"
    loss_weighting: str = "none"
    shift: float = DEFAULT_SHIFT
    guidance: float = DEFAULT_GUIDANCE
    max_sequence_length: int = 512  # text-encoder tokens per caption (FLUX.1-dev's T5 maximum)
    # checkpoints, samples, logs
    save_every: int = 250
    keep_last: int = 3
    sample_every: int = 0  # 0: no samples during training
    sample_prompts: list[str] = field(default_factory=list)
    sample_seed: int = 42
    sample_steps: int = 20
    sample_guidance: float = 3.5
    sample_prior: str | None = None  # Würstchen: the prior's pipeline folder or Hub ID for sample images
    sample_decoder: str | None = None  # Würstchen: the decoder's
    log: str = "jsonl"
    wandb_project: str = "squareq"
    resume: str | None = None  # "latest" or a checkpoint folder
    nan_patience: int = 5  # consecutive skipped steps (NaN/Inf) before the run stops
    # runtime
    prefetch: int | str = "auto"
    resident_blocks: int | str = 0
    host: str = "auto"
    dtype: str = "auto"
    compute: str = "auto"
    cuda_graphs: str = "auto"
    compile: str = "auto"
    attention: str = "auto"
    vram_budget: str | None = None  # e.g. "12GB"; refused before training if the plan exceeds it
    # files
    save_format: list[str] | None = None  # default: diffusers and kohya for FLUX.1, diffusers for other families
    title: str | None = None  # default: the output folder's name

    def __post_init__(self) -> None:
        if isinstance(self.resolution, int) and not isinstance(self.resolution, bool):
            self.resolution = [self.resolution]
        if isinstance(self.caption_ext, str) and self.caption_ext and not self.caption_ext.startswith("."):
            self.caption_ext = "." + self.caption_ext  # ai-toolkit writes caption_ext = "txt"
        self.cuda_graphs = _graphs_word(self.cuda_graphs)
        self.validate()

    def validate(self, where: str = "the configuration") -> None:
        """Raise :class:`ConfigError` with one sentence naming the key if a value cannot work."""
        def bad(key: str, why: str) -> ConfigError:
            error = ConfigError(f"{where}: {key} = {_shown(getattr(self, key))} {why}.")
            error.key = key
            return error

        self._check_numbers(bad)
        self._check_limits(bad)
        self._check_data(bad)
        if self.save_format is not None and (not self.save_format
                                             or not set(self.save_format) <= set(SAVE_FORMATS)):
            raise bad("save_format", f"must name one or both of {', '.join(SAVE_FORMATS)}")
        if self.title is not None and not self.title.strip():
            raise bad("title", "is empty; give the LoRA a name or leave title unset")
        if self.vram_budget is not None:
            try:
                parse_size(self.vram_budget)
            except SizeError as exc:
                raise ConfigError(f"{where}: vram_budget: {exc}") from None

    def _check_adapter(self, bad) -> None:
        """lora_type and what goes with it (:meth:`validate`'s ``bad`` builds the error)."""
        if self.lora_type not in KINDS:
            raise bad("lora_type", f"is not one of {', '.join(KINDS)}")
        if not isinstance(self.lokr_factor, int) or isinstance(self.lokr_factor, bool) \
                or not (self.lokr_factor == -1 or self.lokr_factor >= 1):
            raise bad("lokr_factor", "must be -1 (balanced) or a whole number of at least 1")
        if self.lora_type == "lora":
            if self.save_format is not None and "peft" in self.save_format:
                raise bad("save_format", "names peft, the folder LoKr and LoHa are written as; a LoRA is written as "
                                         "diffusers and kohya files")
            return
        given = [k for k in ("use_dora", "use_rslora") if getattr(self, k)] + (["lora_dropout"] if self.lora_dropout
                                                                                else [])
        if given:
            raise bad("lora_type", f"is {self.lora_type}, which takes none of {', '.join(given)} (they are LoRA's); "
                                   "remove them or set lora_type = \"lora\"")
        if self.save_format is not None and set(self.save_format) != {"peft"}:
            raise bad("save_format", f"names {', '.join(f for f in self.save_format if f != 'peft')}, which hold "
                                     f"LoRA factors only; a {self.lora_type} adapter is written as a PEFT folder: "
                                     "save_format = peft")

    def _check_numbers(self, bad) -> None:
        """Choices, counts and numeric ranges (:meth:`validate`'s ``bad`` builds the error)."""
        for key, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("host", HOSTS),
                             ("compute", COMPUTE_MODES), ("dtype", (*DTYPES, "auto")), ("cuda_graphs", CUDA_GRAPHS),
                             ("compile", COMPILE_MODES), ("attention", ATTENTION_MODES),
                             ("loss_weighting", LOSS_WEIGHTINGS), ("timestep_sampling", TIMESTEP_SAMPLING),
                             ("log", LOGGERS)):
            if getattr(self, key) not in choices:
                raise bad(key, f"is not one of {', '.join(choices)}")
        if self.prefetch != "auto" and (not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool)
                                        or self.prefetch < 1):
            raise bad("prefetch", "must be auto or a whole number of at least 1")
        if self.resident_blocks != "auto" and (not isinstance(self.resident_blocks, int)
                                               or isinstance(self.resident_blocks, bool) or self.resident_blocks < 0):
            raise bad("resident_blocks", "must be auto or a whole number of at least 0")
        if self.dtype == "fp16" and self.compute == "fp8":
            raise bad("compute", "with dtype = fp16: FP8 compute runs in bf16 runs only (GPUs with FP8 tensor cores "
                                 "have bf16 too); choose compute = auto or bf16, or dtype = bf16")
        for key in ("rank", "batch_size", "grad_accum", "nan_patience", "sample_steps",
                    "max_sequence_length", "keep_last", "schedule_cycles"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "must be a whole number of at least 1")
        if self.sample_steps > MAX_STEPS:  # the bound of a prompt's --s and squareq sample --steps
            raise bad("sample_steps", f"must be at most {MAX_STEPS} (20-50 is usual)")
        for key in ("warmup", "save_every", "sample_every", "seed", "keep_tokens", "validate_every"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise bad(key, "must be a whole number of at least 0")
        if self.steps is None and self.epochs is None:
            raise bad("steps", "is unset and so is epochs; give one of them")
        for key in ("steps", "epochs"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(key, "must be a whole number of at least 1")
        for key, low, strict in (("alpha", 0.0, True), ("shift", 0.0, True), ("schedule_power", 0.0, True),
                                 ("weight_decay", 0.0, False),
                                 ("max_grad_norm", 0.0, False), ("guidance", 0.0, False),
                                 ("sample_guidance", 0.0, False), ("caption_dropout", 0.0, False)):
            value = getattr(self, key)
            if value is None and key == "alpha":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < low or (strict and value == low):
                raise bad(key, f"must be a finite number {'above' if strict else 'of at least'} {low:g}")
        for key in ("guidance", "sample_guidance"):
            if getattr(self, key) > MAX_GUIDANCE:
                raise bad(key, f"must be at most {MAX_GUIDANCE:g} (3.5 is usual for FLUX.1-dev, about 7 for CFG "
                               "models)")
        if not isinstance(self.ema_decay, (int, float)) or isinstance(self.ema_decay, bool) \
                or not 0.0 <= self.ema_decay < 1.0:
            raise bad("ema_decay", "must be in [0, 1): 0 turns the average off, 0.999 is usual")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise bad("caption_dropout", "must be in [0, 1)")
        if not isinstance(self.lora_dropout, (int, float)) or isinstance(self.lora_dropout, bool) \
                or not 0.0 <= self.lora_dropout < 1.0:
            raise bad("lora_dropout", "must be in [0, 1), e.g. 0.1")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not math.isfinite(self.lr) \
                or self.lr <= 0:
            raise bad("lr", "must be a finite positive number, e.g. 1e-4")

    def _check_limits(self, bad) -> None:
        """Upper limits a finite value can still break (seeds, alpha, shift, weight decay, the title's length) and
        the control characters no trigger word or prompt holds."""
        for key in ("seed", "sample_seed"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
                raise bad(key, f"must be a whole number from 0 to {MAX_SEED} (2**32 - 1, the seeds numpy and kohya "
                               "take)")
        if self.alpha is not None and self.alpha > MAX_ALPHA_PER_RANK * self.rank:
            raise bad("alpha", f"must be at most {MAX_ALPHA_PER_RANK} × rank ({MAX_ALPHA_PER_RANK * self.rank} "
                               "here): the LoRA is scaled by alpha/rank, 1 when alpha = rank")
        if self.shift > MAX_SHIFT:
            raise bad("shift", f"must be at most {MAX_SHIFT:g} (3 is FLUX's and kohya's default, 1 is uniform)")
        # each step multiplies the weights by 1 - lr × weight_decay; once that is below -1 they grow without end
        if self.weight_decay > 1:
            raise bad("weight_decay", "must be at most 1 (AdamW's usual values are 1e-4 to 0.1)")
        size = len(self.title.encode("utf-8", "surrogatepass")) if self.title is not None else 0
        if size > MAX_TITLE_BYTES:
            raise bad("title", f"is {size} bytes long in UTF-8; it names the file OUT/<title>_kohya.safetensors, so "
                               f"keep it to {MAX_TITLE_BYTES} bytes ({MAX_TITLE_BYTES} ASCII characters)")
        for prompt in self.sample_prompts or []:
            try:
                parse_prompt(prompt, true_cfg_only=False)  # the family's rule on --n is checked when the slab opens
            except PromptError as exc:
                raise bad("sample_prompts", f"cannot be drawn: {exc}") from None
        for key in ("trigger", "sample_prompts"):
            value = getattr(self, key)
            texts = [value] if isinstance(value, str) else value or []
            char = next(filter(None, map(refused_character, texts)), None)
            if char:
                raise bad(key, f"holds the control character {char}; write it as plain text (tabs and line breaks "
                               "are fine)")

    def _check_data(self, bad) -> None:
        """The data keys: resolutions, captions, shuffling and validation images."""
        if not isinstance(self.resolution, list) or not self.resolution \
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in self.resolution):
            raise bad("resolution", "must be a whole number of pixels, or several, e.g. [512, 1024]")
        if min(self.resolution) < 64:
            raise bad("resolution", "must be at least 64 (aspect-ratio buckets have sides in steps of 64)")
        if any(r % 16 for r in self.resolution):
            raise bad("resolution", "must be a multiple of 16 (FLUX packs 2x2 latent patches of an 8x VAE)")
        if len(set(self.resolution)) != len(self.resolution):
            raise bad("resolution", "names a size twice; list each once")
        if self.targets is not None and (not self.targets or not all(isinstance(t, str) and t for t in self.targets)):
            raise bad("targets", "must be a non-empty list of layer name patterns, e.g. [\"to_q\", \"to_k\"]")
        if not isinstance(self.caption_ext, str) or len(self.caption_ext) < 2 or "/" in self.caption_ext \
                or "\\" in self.caption_ext:
            raise bad("caption_ext", "is not a file extension; give one such as .txt or .caption")
        for key in ("no_upscale", "shuffle_caption", "use_dora", "use_rslora", "flip_aug", "masked_loss", "alpha_mask"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false")
        self._check_masks(bad)
        self._check_adapter(bad)
        if self.wandb_project != "squareq" and self.log != "wandb":
            raise bad("wandb_project", "names a Weights & Biases project, and log is not wandb; set log = \"wandb\" "
                                       "(--log wandb) or remove wandb_project")
        if not isinstance(self.prior_loss_weight, (int, float)) or isinstance(self.prior_loss_weight, bool) \
                or not 0.0 <= self.prior_loss_weight < math.inf:
            raise bad("prior_loss_weight", "must be a number of at least 0, e.g. 1.0")
        if self.prior_loss_weight != 1.0 and not self.reg_data:
            raise bad("prior_loss_weight", "weighs regularisation images, and reg_data names none; set reg_data "
                                           "(--reg-data FOLDER) or remove prior_loss_weight")
        if not isinstance(self.caption_orders, int) or isinstance(self.caption_orders, bool) \
                or not 1 <= self.caption_orders <= 64:
            raise bad("caption_orders", "must be a whole number from 1 to 64")
        if not isinstance(self.validation_split, (int, float)) or isinstance(self.validation_split, bool) \
                or not 0.0 <= self.validation_split < 1.0:
            raise bad("validation_split", "must be in [0, 1): the fraction of images held out, e.g. 0.1")
        if self.validation_split and self.validation_data:
            raise bad("validation_split", "and validation_data both choose validation images; keep one")
        if self.keep_tokens and not self.shuffle_caption:
            raise bad("keep_tokens", "only applies with shuffle_caption; set shuffle_caption = true "
                                     "(--shuffle-caption) or remove keep_tokens")

    def _check_masks(self, bad) -> None:
        """masked_loss with exactly one source of masks, and a source only with masked_loss (kohya's rule: nothing
        set here is silently unused)."""
        sources = [k for k in ("alpha_mask", "mask_dir") if getattr(self, k)]
        if self.masked_loss and not sources:
            raise bad("masked_loss", "needs masks: set alpha_mask = true (--alpha-mask) to use each image's alpha "
                                     "channel, or mask_dir = FOLDER (--mask-dir) for mask images")
        if sources and not self.masked_loss:
            raise bad(sources[0], "only takes effect with masked_loss = true; set it (--masked-loss) or remove "
                                  f"{sources[0]}")
        if len(sources) > 1:
            raise bad("mask_dir", "and alpha_mask both give masks; keep one")
        if self.mask_dir is not None and not Path(self.mask_dir).expanduser().is_dir():
            raise bad("mask_dir", "is not a folder; give the folder that holds the masks")

    def with_family_defaults(self, family: str) -> TrainConfig:
        """This configuration with what depends on the model's family filled in: the LoRA targets."""
        if self.targets is not None:
            return self
        adapter = ADAPTERS.get(family)
        targets = adapter.lora_targets if adapter is not None and adapter.lora_targets else DEFAULT_TARGETS
        return dataclasses.replace(self, targets=list(targets))

    @property
    def start_prefetch(self) -> int:
        """The ring a model is loaded with: ``prefetch``, or for ``auto`` two slots until a step is measured."""
        return 2 if self.prefetch == "auto" else self.prefetch

    @property
    def largest_resolution(self) -> int:
        """The largest training side: what memory plans and sample images use."""
        return max(self.resolution)

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)

    @property
    def lora_variant(self) -> LoraVariant:
        """DoRA, rsLoRA and dropout as the runtime takes them (any of them: PEFT's layers)."""
        return LoraVariant(dora=self.use_dora, rslora=self.use_rslora, dropout=float(self.lora_dropout),
                           kind=self.lora_type, factor=self.lokr_factor)

    @property
    def encoder_files(self) -> dict[str, str | None]:
        """The encoders given as single files, by key (None: the pipeline's own)."""
        return {key: getattr(self, key) for key in SINGLE_FILE_FLAGS}

    @property
    def vram_budget_bytes(self) -> int | None:
        return parse_size(self.vram_budget) if self.vram_budget is not None else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML (keys left unset are written as comments, since TOML has no null)."""
        lines = ["# squareq train configuration (squareq train --print-config)"]
        for f in fields(self):
            value = getattr(self, f.name)
            lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _graphs_word(value: Any) -> Any:
    """``cuda_graphs`` as a word: true and false (a config file of the days when it was a switch) are on and off."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def _coerce(name: str, value: Any, where: str) -> Any:
    """Values from TOML or flags into the field's type (ints stay ints, a float field accepts an int)."""
    kind = _FIELD_TYPES[name]
    if value is None:
        return None
    if name == "cuda_graphs":
        value = _graphs_word(value)
    try:
        if kind == "int | str":  # a count or a word (prefetch: "auto")
            if isinstance(value, (bool, dict, list)) or isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if isinstance(value, (int, float)) or str(value).strip().isdigit() else str(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError
        if "list[int]" in kind:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()) for v in values):
                raise ValueError
            return [int(v) for v in values]
        if name == "sample_prompts" and isinstance(value, str):  # kohya's prompt file, or one prompt (commas and all)
            path = Path(value).expanduser()
            if path.suffix != ".txt" or not path.is_file():
                return [value]
            try:
                return read_prompt_file(path)
            except PromptError as exc:
                raise ConfigError(f"{where}: sample_prompts: {exc}") from None
        if "list" in kind:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError  # a table or a number is no list of names, and iterating it would make one up
            return list(value)
        if "float" in kind and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # a TOML integer of 400 digits: infinite, which the range checks name
                return math.inf if value > 0 else -math.inf
        if "int" in kind and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if "str" in kind and not isinstance(value, (bool, dict, list)):
            return str(value)
    except (TypeError, ValueError):
        pass
    words = _KIND_WORDS[kind.replace(" | None", "")]
    raise ConfigError(f"{where}: {name} = {_shown(value)} must be {words}.") from None


_KIND_WORDS = {"int": "a whole number, e.g. 8", "float": "a number, e.g. 0.5", "bool": "a bool, true or false",
               "str": 'text in quotes, e.g. "sks"', "int | str": "auto or a whole number, e.g. 3",
               "list[str]": 'a list of text, e.g. ["to_q", "to_k"]',
               "list[int]": "a whole number or a list of them, e.g. [512, 1024]"}


def _shown(value: Any) -> str:
    """``value`` as an error message quotes it: its repr, cut short where it would fill the line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "…"


_FIELD_TYPES = {f.name: str(f.type) for f in fields(TrainConfig)}


def _keep_scale(values: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    """A --rank flag over a file that sets alpha keeps the file's scale alpha/rank (alpha moves with the rank), as
    if the file had been written for that rank; --alpha beside it decides instead. Said in a warning, since the
    file's alpha no longer holds."""
    rank = overrides.get("rank")
    if rank is None or overrides.get("alpha") is not None or values.get("alpha") is None:
        return
    try:
        before, alpha, rank = int(values.get("rank", TrainConfig.rank)), float(values["alpha"]), int(rank)
    except (TypeError, ValueError):
        return  # validation names the bad value
    if rank == before or before < 1:
        return
    values["alpha"] = alpha * rank / before
    log.warning("--rank %d over %s's rank %d and alpha %g: alpha set to %g to keep the scale alpha/rank = %g; "
                "pass --alpha to choose it yourself.", rank, where, before, alpha, values["alpha"], alpha / before)


def _read_table(path: str | Path) -> dict[str, Any]:
    """The training keys of the TOML file ``path`` (its ``[train]`` table, or its top level without one), kohya's
    names translated; anything else in the file is refused, since ignoring it would train with a setting unmade."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass an existing TOML file to --config.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}); fix the file.") from None
    except RecursionError:
        raise ConfigError(f"{path} is not valid TOML (its arrays or tables nest too deeply to read); fix the "
                          "file.") from None
    table = data.get("train", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: train = {_shown(table)} is not a table; put the training keys under a [train] "
                          "header, or at the top level without one.")
    outside = sorted(set(data) - {"train"}) if table is not data else []
    if outside:
        them = "it" if len(outside) == 1 else "them"
        raise ConfigError(f"{path}: {_names(data, outside)} outside the [train] table would be ignored; move {them} "
                          f"into [train] or remove {them}.")
    try:
        table = translate_kohya_keys(table, str(path), set(_FIELD_TYPES))
    except KohyaKeyError as exc:
        raise ConfigError(str(exc)) from None
    unknown = sorted(set(table) - set(_FIELD_TYPES))
    if unknown:
        raise ConfigError(f"{path}: unknown key{'s' if len(unknown) > 1 else ''} {_names(table, unknown, True)}; "
                          "`squareq train --print-config` lists every key.")
    return table


def _names(table: dict[str, Any], keys: list[str], suggest: bool = False) -> str:
    """``keys`` of ``table`` for a message: a table as ``[name]``, with the closest training key when asked."""
    named = []
    for key in keys:
        close = difflib.get_close_matches(key, _FIELD_TYPES, n=1) if suggest else []
        named.append((f"[{key}]" if isinstance(table[key], dict) else key)
                     + (f" (did you mean {close[0]}?)" if close else ""))
    return ", ".join(named)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path`` (a ``[train]`` table or top-level keys), then ``overrides``
    (flag values; ``None`` means the flag was not given)."""
    values: dict[str, Any] = {}
    where = "the configuration"
    if path is not None:
        where = str(path)
        values.update({k: _coerce(k, v, where) for k, v in _read_table(path).items()})
    overrides = dict(overrides or {})
    if overrides.get("steps") is not None and overrides.get("epochs") is None:
        values.pop("epochs", None)  # a --steps flag decides the length even where the file sets epochs
    _keep_scale(values, overrides, where)
    for key, value in overrides.items():
        if key not in _FIELD_TYPES:
            raise ConfigError(f"--{key.replace('_', '-')} is not a training option.")
        if value is not None:
            values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        key = getattr(exc, "key", None)
        source = f"--{key.replace('_', '-')}" if key and overrides.get(key) is not None else where
        raise ConfigError(str(exc).replace("the configuration", source, 1)) from None
