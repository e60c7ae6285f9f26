"""The `squareq` click group: its global options (--version, --verbose, -h), the logging and third-party quieting
they set, the commands it knows by name and short help without importing them (so `squareq --help` imports no
torch), and the one place where the library's user-facing errors become one line on stderr and exit status 1."""
from __future__ import annotations

import importlib
import logging
import sys

import click

from .. import __version__

# name: (module of squareq.cli, attribute, the first paragraph of its help, which the group's listing shows without
# importing the module; tests/test_cli_help.py checks it against the command's own)
COMMANDS = {
    "accept": ("accept", "accept", "Gate SLAB before anyone trains on it: layer MSE and block drift on fresh inputs, "
               "image drift and LoRA gradient agreement against the bf16 source, convergence decided by paired "
               "tests, peak VRAM and size."),
    "cache": ("train", "cache_cmd", "Compute the latents and text embeddings `squareq train` would, without "
              "training."),
    "compile": ("compile", "compile_cmd", "Calibrate MODEL on real data, choose a format per layer (W4/W6/W8/bf16 by "
                "default) under a size budget, write a slab."),
    "demo": ("demo", "demo", "compile → train → sample → accept on the built-in tiny model and dataset (a few minutes "
             "on a CPU)."),
    "export-lora": ("sample", "export_lora", "Write a LoRA in another layout (kohya/ComfyUI or diffusers/PEFT)."),
    "families": ("inspect", "families", "The model families SquareQ knows and what it does for each (compile, "
                 "stream, train, sample)."),
    "inspect": ("inspect", "inspect", "Show a slab's layers, formats, sizes and metrics."),
    "sample": ("sample", "sample", "Generate images with the streamed slab, optionally with a LoRA: FLUX.1 through "
               "SquareQ's sampler, other families through their diffusers pipeline folder (--model)."),
    "train": ("train", "train", "Train a LoRA on SLAB, streaming its blocks through the GPU (flags override "
              "--config)."),
    "ui": ("ui", "ui", "Serve a local page to watch and steer training runs: status, curves, samples, memory, logs; "
           "start, stop, resume."),
}


class _Commands(dict):
    """The group's commands by name; a command's module is imported when the command is first looked up."""

    def __missing__(self, name: str) -> click.Command:
        if name not in COMMANDS:
            raise KeyError(name)
        module, attribute, _ = COMMANDS[name]
        command = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        self[name] = command
        return command


class _Group(click.Group):
    """Lists its commands from :data:`COMMANDS` without importing them, and turns the library's user-facing errors
    into one line on stderr and exit status 1."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(self.commands) | set(COMMANDS))

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        try:
            return self.commands[cmd_name]
        except KeyError:
            return None

    def format_commands(self, ctx, formatter) -> None:
        """click's listing, from each command's recorded help where its module is not imported yet."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            command = dict.get(self.commands, name) or click.Command(name, help=COMMANDS[name][2])
            if not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            _exit_for(exc, ctx)
            raise


def _exit_for(exc: Exception, ctx) -> None:
    """Exit with one line for a user-facing error (the error classes imported only now: they import torch); return
    for anything else, which stays a traceback."""
    from ..slab.atomic import os_error_sentence
    from .errors import USER_ERRORS, TrainInterrupted

    if isinstance(exc, TrainInterrupted):  # Ctrl-C kept the run: its message says what was written and how to resume
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    if isinstance(exc, USER_ERRORS):
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if isinstance(exc, OSError):
        # the library maps the OSErrors it expects; one it did not still gets a sentence, not a traceback
        click.echo(f"error: {os_error_sentence(exc, f'squareq {ctx.invoked_subcommand}')}", err=True)
        sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="squareq")
@click.option("-v", "--verbose", is_flag=True, help="Log which kernels and backends are used, and show the warnings "
              "and progress bars of diffusers, transformers, huggingface_hub and torchvision.")
def main(verbose: bool) -> None:
    """Compile a diffusion transformer into a W4/W6/W8 slab and train LoRAs on it by streaming blocks.

    \b
    squareq compile MODEL --budget 12GB -o model.slab
    squareq train model.slab --data DIR -o lora/
    squareq accept model.slab --model MODEL
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    from ..third_party import quiet_third_parties

    quiet_third_parties(verbose)
