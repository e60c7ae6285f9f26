"""``CompileOptions``: everything `squareq compile` takes besides the model and the output path, checked when made."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import quant
from ..models.calibration_set import CalibrationSet
from .budget import BudgetError
from .correction import MODES as CORRECTION_MODES
from .effect import DEFAULT_PROBES
from .ladder import DEFAULT_FORMATS, rung_specs
from .thresholds import Thresholds


@dataclass
class CompileOptions:
    """Everything `squareq compile` takes besides the model and the output path."""

    budget: int
    objective: str = "size"
    thresholds: Thresholds = field(default_factory=Thresholds)
    formats: tuple[str, ...] = DEFAULT_FORMATS  # the rungs measured, by name (compiler/ladder.py)
    rounding: str = "gptq"
    rotation: bool = True  # the search also tries each layer Hadamard-rotated (compiler/layer_search.py)
    learned_rounding: bool = True  # and refines its winner's codes on the calibration rows (quant/refine.py)
    output_correction: str = "auto"  # refit each layer's scale and bias after the plan (compiler/correction.py)
    group_size: int = 64
    calib_samples: int | None = None  # None: the measured default for the kind of data (compiler/inputs.py)
    calib_images: CalibrationSet | None = None  # encoded images + captions (squareq.compiler.calibration_images)
    encoders: dict[str, str] | None = None  # recorded: the encoders calib_images came from, when not the source's
    calib_cache: str | None = None  # a training cache folder to calibrate on (squareq cache / squareq train)
    calib_text: str | None = None  # a text file, one sample per line (text models)
    calib_tokens: int | None = None  # most tokens per text sample (None: the default)
    calib_synthetic: bool = False  # noise and Gaussian text instead of data: for speed runs only
    max_rows: int = 512
    seed: int = 0
    effect_probes: int = DEFAULT_PROBES
    max_block_bytes: int | None = None  # the runtime's ring holds K slots of the largest block (docs/compiler.md)
    vram_cap: int | None = None  # or: GPU memory for the streamed weights, shared by ring_slots slots
    ring_slots: int = 2
    vram_budget: int | None = None  # the compile's own GPU memory (None: what the device has free)
    host_budget: int | None = None  # the compile's host memory (None: what the machine has available, less a margin)
    previous: str | None = None  # --from: a slab built before, whose rungs each layer starts at
    device: str = "cpu"  # where it runs (the CLI resolves --device auto: compiler/device_choice.py)
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        # checked when the options are made, before calibration data is encoded or any state folder is written: the
        # search builds its first spec only once the state exists, and that state would then refuse the fixed rerun
        try:
            quant.QuantSpec(group_size=self.group_size)
        except quant.SpecError as exc:
            raise quant.SpecError(f"--group-size {self.group_size}: {exc}") from None
        if isinstance(self.formats, str):
            self.formats = tuple(f.strip() for f in self.formats.split(",") if f.strip())
        try:
            self.formats = tuple(s.short_label for s in rung_specs(self.formats, self.group_size))
        except ValueError as exc:
            raise BudgetError(str(exc)) from None
        if self.output_correction not in CORRECTION_MODES:
            raise BudgetError(f"--output-correction {self.output_correction!r} must be one of "
                              f"{', '.join(CORRECTION_MODES)}.")
        for flag, value, least in (("--calib-samples", self.calib_samples, 2), ("--calib-tokens", self.calib_tokens, 2),
                                   ("--effect-probes", self.effect_probes, 1), ("--ring-slots", self.ring_slots, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise BudgetError(f"{flag} {value} must be a whole number of at least {least}.")

    def fingerprint(self) -> dict:
        """What the measurements depend on (the plan's thresholds, budget and objective are not among them)."""
        keep = ("formats", "rounding", "rotation", "learned_rounding", "group_size", "calib_samples", "calib_tokens",
                "calib_synthetic",
                "max_rows", "seed", "effect_probes")
        return {k: getattr(self, k) for k in keep}
