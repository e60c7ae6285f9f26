"""Options several commands share, so each reads the same everywhere: --revision, --device, and the encoders as
single files (--clip-l, --clip-g, --t5, --vae) with `squareq train`'s help; ``given_files`` collects the latter."""
from __future__ import annotations

from pathlib import Path

import click

from ..sources.encoder_source import SINGLE_FILE_FLAGS, cli_flag
from ..train.config_help import HELP


def encoder_file_options(command):
    """--clip-l, --clip-g, --t5 and --vae: encoders as single files, with `squareq train`'s help (train.config_help)."""
    for name in reversed(SINGLE_FILE_FLAGS):
        command = click.option(cli_flag(name), name, type=click.Path(path_type=Path), help=HELP[name])(command)
    return command


def device_option(what_runs: str, cpu_note: str = "else the CPU"):
    """--device, its help saying what runs there and what auto does without a GPU (``cpu_note``)."""
    return click.option("--device", default="auto", show_default=True,
                        help=f"Where {what_runs}: auto (the GPU when PyTorch sees one; {cpu_note}), cpu, cuda or "
                        "cuda:N.")


REVISION = click.option("--revision", help="The branch, tag or commit of a Hugging Face Hub ID given as the model.")


def given_files(clip_l, clip_g, t5, vae) -> dict[str, str]:
    """The single files given, by component (what the library's ``files`` take)."""
    return {k: str(v) for k, v in zip(SINGLE_FILE_FLAGS, (clip_l, clip_g, t5, vae)) if v is not None}

