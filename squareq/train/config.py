"""`squareq train`'s configuration: the :class:`TrainConfig` dataclass (its keys, defaults and what is derived from
them), its validation, and :func:`load_config`, which resolves one.

Precedence: built-in defaults < ``--config train.toml`` < command-line flags. ``squareq train
--print-config`` prints the resolved configuration as TOML that ``--config`` reads back unchanged.
Defaults follow what users of kohya sd-scripts, ai-toolkit and SimpleTuner expect for a FLUX LoRA
(docs/train.md lists each choice). Reading and writing the TOML: config_file.py; the keys' choices, limits and
value checks: config_values.py; each key's help text: config_help.py.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..models import ADAPTERS
from ..runtime.lora import DEFAULT_TARGETS
from ..runtime.peft_lora import LoraVariant
from ..sizes import SizeError, parse_size
from ..sources.encoder_source import SINGLE_FILE_FLAGS
from .clips import ClipError, FrameSettings
from .config_file import ConfigError, coerce, graphs_word, read_table, shown, toml_text
from .config_values import SAVE_FORMATS, check_data, check_limits, check_numbers, check_texts, warn_ignored
from .datasets import DATASET_KEYS, HOW, dataset_tables, read_dataset_file
from .objective import DEFAULT_GUIDANCE, DEFAULT_SHIFT

# the title names OUT/<title>_kohya.safetensors: 200 bytes, the suffix (18) and a temporary name's (14) stay within
# the 255 bytes a file name may have
MAX_TITLE_BYTES = 200

log = logging.getLogger("squareq.train")


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
    control_dir: list[str] | None = None  # edit pairs (train/controls.py): the control images' folder, or several
    control_resolution: list[int] | None = None  # musubi-tuner's: the controls' area, [width, height] or one side
    no_resize_control: bool = False  # musubi-tuner's: controls keep their size, cropped to a multiple of 16
    reg_data: str | None = None
    prior_loss_weight: float = 1.0
    num_repeats: int = 1  # each image (a clip's window) this many times an epoch, times its repeat folder's count
    dataset_config: str | None = None  # a TOML file of [[datasets]] tables (kohya's and musubi's --dataset_config)
    datasets: list[dict[str, Any]] | None = None  # [[datasets]] tables (train/datasets.py): each its own data keys
    validation_data: str | None = None
    validation_split: float = 0.0
    validate_every: int = 0  # 0: with every checkpoint
    # clips (train/clips.py): musubi-tuner's frame keys and meanings
    target_frames: list[int] = field(default_factory=lambda: [1])
    frame_extraction: str = "head"
    frame_stride: int = 1
    frame_sample: int = 1
    max_frames: int = 129
    source_fps: float | None = None
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
    host_budget: str = "auto"  # host RAM the run may hold, e.g. "24GB"; auto: the machine's available, less a margin
    offload_activations: str = "auto"  # the checkpointed block inputs in host memory: auto (where vram_budget needs it)
    # files
    save_format: list[str] | None = None  # default: diffusers and kohya for FLUX.1, diffusers for other families
    title: str | None = None  # default: the output folder's name

    def __post_init__(self) -> None:
        for key in ("resolution", "target_frames"):  # one number for a list of one
            value = getattr(self, key)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, key, [value])
        if isinstance(self.caption_ext, str) and self.caption_ext and not self.caption_ext.startswith("."):
            self.caption_ext = "." + self.caption_ext  # ai-toolkit writes caption_ext = "txt"
        self.cuda_graphs = graphs_word(self.cuda_graphs)
        self.validate()

    def validate(self, where: str = "the configuration") -> None:
        """Raise :class:`ConfigError` with one sentence naming the key if a value cannot work."""
        def bad(key: str, why: str) -> ConfigError:
            error = ConfigError(f"{where}: {key} = {shown(getattr(self, key))} {why}.")
            error.key = key
            return error

        check_numbers(self, bad)
        check_limits(self, bad)
        size = len(self.title.encode("utf-8", "surrogatepass")) if self.title is not None else 0
        if size > MAX_TITLE_BYTES:
            raise bad("title", f"is {size} bytes long in UTF-8; it names the file OUT/<title>_kohya.safetensors, so "
                               f"keep it to {MAX_TITLE_BYTES} bytes ({MAX_TITLE_BYTES} ASCII characters)")
        check_texts(self, bad)
        check_data(self, bad)
        if self.save_format is not None and (not self.save_format
                                             or not set(self.save_format) <= set(SAVE_FORMATS)):
            raise bad("save_format", f"must name one or both of {', '.join(SAVE_FORMATS)}")
        if self.title is not None and not self.title.strip():
            raise bad("title", "is empty; give the LoRA a name or leave title unset")
        try:
            self.frame_settings.check(where)
        except ClipError as exc:
            raise ConfigError(str(exc)) from None
        self.dataset_views(where)  # each [[datasets]] table's values checked as the run's own are
        for key, value in (("vram_budget", self.vram_budget), ("host_budget", self.host_budget)):
            if value is None or key == "host_budget" and value == "auto":
                continue
            try:
                parse_size(value)
            except SizeError as exc:
                why = f"{value!r} is not a size; write it like 24GB or 31.5GiB, or auto." \
                    if key == "host_budget" else str(exc)
                raise ConfigError(f"{where}: {key}: {why}") from None

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

    def dataset_views(self, where: str = "the configuration") -> list[TrainConfig]:
        """The run's datasets, each as this configuration with its table's data keys (train/datasets.py): one per
        ``[[datasets]]`` table, else this one alone. A table's value that cannot work is refused naming the table."""
        if not self.datasets:
            return [self]
        if self.data:
            raise ConfigError(f"{where}: data = {shown(self.data)} and [[datasets]] tables both name folders; put "
                              "every folder in a [[datasets]] table (or remove the tables and keep data).")
        if self.reg_data:
            raise ConfigError(f"{where}: reg_data with [[datasets]] tables: regularisation images mix into one "
                              "dataset; train them as a [[datasets]] table of their own, or keep one data folder.")
        views = []
        for n, table in enumerate(self.datasets, 1):
            unknown = sorted(set(table) - set(DATASET_KEYS))
            if unknown:
                raise ConfigError(f"{where}: [[datasets]] table {n}: unknown key {unknown[0]}; {HOW}.")
            values = {k: coerce(k, v, _FIELD_TYPES[k], f"{where}: [[datasets]] table {n}") for k, v in table.items()}
            try:
                views.append(dataclasses.replace(self, datasets=None, dataset_config=None, **values))
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("the configuration", f"{where}: [[datasets]] table {n} "
                                                   f"({shown(table.get('data'))})", 1)) from None
        return views

    @property
    def largest_resolution(self) -> int:
        """The largest training side of any dataset: what memory plans and sample images use."""
        return max(max(view.resolution) for view in self.dataset_views())

    def largest_batch(self, stride: int | None = None) -> tuple[int, int, int]:
        """(side, batch size, frames) of the dataset whose batches hold the most pixels: what the memory plan is made
        for. ``stride``: a video family's frames per latent frame (train/clips.py), which the longest window a
        dataset's frame keys can cut is rounded down by; None: images, one frame."""
        def largest(v: TrainConfig) -> tuple[int, int, int]:
            frames = 1 if stride is None else v.frame_settings.longest(stride)
            return max(v.resolution), v.batch_size, frames

        return max(map(largest, self.dataset_views()), key=lambda e: e[0] ** 2 * e[1] * e[2])

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
    def frame_settings(self) -> FrameSettings:
        """The frame keys, as train/clips.py cuts clips by them."""
        return FrameSettings(tuple(self.target_frames) if isinstance(self.target_frames, list) else (),
                             self.frame_extraction, self.frame_stride, self.frame_sample, self.max_frames,
                             self.source_fps)

    @property
    def vram_budget_bytes(self) -> int | None:
        return parse_size(self.vram_budget) if self.vram_budget is not None else None

    @property
    def host_budget_bytes(self) -> int | None:
        """``host_budget`` in bytes; None for ``auto`` (the machine's, train/host_plan.py)."""
        return parse_size(self.host_budget) if self.host_budget not in (None, "auto") else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The configuration as TOML (keys left unset are written as comments, since TOML has no null)."""
        return toml_text((f.name, getattr(self, f.name)) for f in fields(self))


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


def _tables(found: tuple[list[dict[str, Any]], dict[str, Any]], values: dict[str, Any], where: str) -> dict:
    """The ``[[datasets]]`` tables and the run-wide keys they set (train/datasets.py) as configuration values;
    refused where a run-wide one differs from the run's own."""
    tables, run = found
    out: dict[str, Any] = {"datasets": tables} if tables else {}
    for key, value in run.items():
        value = coerce(key, value, _FIELD_TYPES[key], where)
        if values.get(key) is not None and values[key] != value:
            raise ConfigError(f"{where}: the [[datasets]] tables' {key} = {shown(value)} and the run's "
                              f"{shown(values[key])} differ; give it in one place.")
        out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at ``path`` (a ``[train]`` table or top-level keys), then ``overrides``
    (flag values; ``None`` means the flag was not given)."""
    values: dict[str, Any] = {}
    where = "the configuration"
    if path is not None:
        where = str(path)
        table, parts = read_table(path, set(_FIELD_TYPES) - {"datasets"})
        values.update({k: coerce(k, v, _FIELD_TYPES[k], where) for k, v in table.items()})
        values.update(_tables(dataset_tables(parts, where), values, where))
    overrides = dict(overrides or {})
    file = overrides.get("dataset_config") or values.get("dataset_config")
    if file and values.get("datasets"):
        raise ConfigError(f"{where} has [[datasets]] tables and dataset_config names {file} too; keep one of them.")
    if file:  # read into the tables, which --print-config then writes in place of the file's name
        values.update(_tables(read_dataset_file(file), values, f"dataset_config {file}"))
        values["dataset_config"] = overrides["dataset_config"] = None
    if overrides.get("steps") is not None and overrides.get("epochs") is None:
        values.pop("epochs", None)  # a --steps flag decides the length even where the file sets epochs
    _keep_scale(values, overrides, where)
    for key, value in overrides.items():
        if key not in _FIELD_TYPES:
            raise ConfigError(f"--{key.replace('_', '-')} is not a training option.")
        if value is not None:
            values[key] = coerce(key, value, _FIELD_TYPES[key], f"--{key.replace('_', '-')}")
    try:
        cfg = TrainConfig(**values)
    except ConfigError as exc:
        key = getattr(exc, "key", None)
        source = f"--{key.replace('_', '-')}" if key and overrides.get(key) is not None else where
        raise ConfigError(str(exc).replace("the configuration", source, 1)) from None
    warn_ignored(cfg)
    return cfg
