"""The library's user-facing errors, which the `squareq` group turns into one line on stderr and exit status 1.
Imported only when a command fails, since these modules import torch and `squareq --help` must not."""
from __future__ import annotations

from ..acceptance import AcceptError
from ..compiler.budget import BudgetError
from ..compiler.state import StateError
from ..compiler.thresholds import ThresholdsError
from ..devices import DeviceError
from ..extras import MissingExtra
from ..models import ModelError
from ..quant import SpecError
from ..runtime import PeftMissing, PlanError, StreamError
from ..sizes import SizeError
from ..slab import SlabError
from ..slab.atomic import OutputError
from ..sources.encoders import EncoderError
from ..train.cache import CacheError
from ..train.checkpoint_state import CheckpointError
from ..train.clips import ClipError
from ..train.config import ConfigError
from ..train.data import DataError
from ..train.errors import TrainError, TrainInterrupted
from ..train.lora_factors import LoraFileError
from ..train.prompt_options import PromptError
from ..train.sample import SampleError
from ..ui.paths import UiError

USER_ERRORS = (SlabError, ModelError, SpecError, BudgetError, StateError, ThresholdsError, ConfigError, DataError,
               CheckpointError, CacheError, EncoderError, LoraFileError, PlanError, StreamError, AcceptError,
               TrainError, SampleError, OutputError, PeftMissing, DeviceError, SizeError, MissingExtra, PromptError,
               ClipError, UiError)

__all__ = ["USER_ERRORS", "TrainInterrupted"]
