"""The `squareq` click group: its global options (--version, --verbose, -h), the logging and third-party quieting
they set, and the one place where the library's user-facing errors become one line on stderr and exit status 1.
The commands are added to it in cli/__init__.py."""
from __future__ import annotations

import logging
import sys

import click

from .. import __version__
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
from ..slab.atomic import OutputError, os_error_sentence
from ..sources.encoders import EncoderError
from ..third_party import quiet_third_parties
from ..train.cache import CacheError
from ..train.checkpoint_state import CheckpointError
from ..train.config import ConfigError
from ..train.data import DataError
from ..train.errors import TrainError
from ..train.lora_factors import LoraFileError
from ..train.prompt_options import PromptError
from ..train.sample import SampleError

USER_ERRORS = (SlabError, ModelError, SpecError, BudgetError, StateError, ThresholdsError, ConfigError, DataError,
               CheckpointError, CacheError, EncoderError, LoraFileError, PlanError, StreamError, AcceptError,
               TrainError, SampleError, OutputError, PeftMissing, DeviceError, SizeError, MissingExtra, PromptError)


class _Group(click.Group):
    """Turns the library's user-facing errors into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except OSError as exc:
            # the library maps the OSErrors it expects; one it did not still gets a sentence, not a traceback
            click.echo(f"error: {os_error_sentence(exc, f'squareq {ctx.invoked_subcommand}')}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="squareq")
@click.option("-v", "--verbose", is_flag=True, help="Log which kernels and backends are used, and show the warnings "
              "of diffusers, transformers and torchvision.")
def main(verbose: bool) -> None:
    """Compile a diffusion transformer into a W4/W6/W8 slab and train LoRAs on it by streaming blocks.

    \b
    squareq compile MODEL --budget 12GB -o model.slab
    squareq train model.slab --data DIR -o lora/
    squareq accept model.slab --model MODEL
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    quiet_third_parties(verbose)
