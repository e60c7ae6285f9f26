"""Options several commands share, each defined once so it has the same spelling, type, choices and default in every
command (tests/test_cli_flags.py checks it): the runtime's (--compute, --cuda-graphs, --prefetch, ...), the sources'
(--model, --revision, the encoders as single files) and the data's; each command gives its own help. Also
``given_files``, which collects the encoder files, and ``removed_if_failed``, which takes back an output folder a
failed command created."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import click

from ..sources.encoder_source import SINGLE_FILE_FLAGS, cli_flag
from ..train.config import TrainConfig
from ..train.config_help import HELP
from ..train.config_values import ATTENTION_MODES, COMPILE_MODES, COMPUTE_MODES, CUDA_GRAPHS, DTYPE_CHOICES, HOSTS


class AutoOrInt(click.ParamType):
    """``auto`` or a whole number of at least ``minimum``."""

    name = "auto|N"

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    def convert(self, value, param, ctx):
        """``auto`` as is, a number as an int; anything else fails with one sentence naming the flag."""
        if value == "auto":
            return value
        try:
            number = int(value) if not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or number < self.minimum:
            self.fail(f"{value!r}: give auto or a whole number of at least {self.minimum}.", param, ctx)
        return number


def _default(key: str):
    return getattr(TrainConfig, key)


# key: (click type, default, extra click settings); the default is squareq train's (TrainConfig's) in every command
_SHARED = {
    "compute": (click.Choice(COMPUTE_MODES), _default("compute"), {}),
    # a bare --cuda-graphs, as when it was a switch, means on
    "cuda_graphs": (click.Choice(CUDA_GRAPHS), _default("cuda_graphs"), {"is_flag": False, "flag_value": "on"}),
    "dtype": (click.Choice(DTYPE_CHOICES), _default("dtype"), {}),
    "host": (click.Choice(HOSTS), _default("host"), {}),
    "compile": (click.Choice(COMPILE_MODES), _default("compile"), {}),
    "attention": (click.Choice(ATTENTION_MODES), _default("attention"), {}),
    "prefetch": (AutoOrInt(minimum=1), _default("prefetch"), {}),
    "resident_blocks": (AutoOrInt(minimum=0), _default("resident_blocks"), {}),
    "vram_budget": (click.STRING, None, {}),
    "host_budget": (click.STRING, _default("host_budget"), {}),
    "model": (click.STRING, None, {}),
    "revision": (click.STRING, None, {}),
    "seed": (click.INT, _default("seed"), {}),
    "max_sequence_length": (click.INT, _default("max_sequence_length"), {}),
    "trigger": (click.STRING, None, {}),
    "caption_ext": (click.STRING, _default("caption_ext"), {}),
    "cache_dir": (click.Path(path_type=Path), None, {}),
    "lr": (click.FLOAT, _default("lr"), {}),
    "rank": (click.INT, _default("rank"), {}),
    "sample_steps": (click.INT, _default("sample_steps"), {}),
    **{key: (click.Path(path_type=Path), None, {}) for key in SINGLE_FILE_FLAGS},
}
SHARED_KEYS = frozenset(_SHARED)


def shared_option(key: str, help: str | None = None, **settings):
    """The flag of ``key`` (a squareq train key) as every command spells it, with this command's ``help``
    (default: squareq train's) and ``settings`` (e.g. ``required``) that do not change its type or default."""
    kind, default, extra = _SHARED[key]
    return click.option(cli_flag(key), key, type=kind, default=default, show_default=default is not None,
                        help=HELP.get(key) if help is None else help, **extra, **settings)


def encoder_file_options(command):
    """--clip-l, --clip-g, --t5 and --vae: encoders as single files, with `squareq train`'s help (train.config_help)."""
    for name in reversed(SINGLE_FILE_FLAGS):
        command = shared_option(name)(command)
    return command


def device_option(what_runs: str, cpu_note: str = "else the CPU"):
    """--device, its help saying what runs there and what auto does without a GPU (``cpu_note``)."""
    return click.option("--device", default="auto", show_default=True,
                        help=f"Where {what_runs}: auto (the GPU when PyTorch sees one; {cpu_note}), cpu, cuda or "
                        "cuda:N.")


REVISION = shared_option("revision", "The branch, tag or commit of a Hugging Face Hub ID given as the model.")


def given_files(clip_l, clip_g, t5, vae) -> dict[str, str]:
    """The single files given, by component (what the library's ``files`` take)."""
    return {k: str(v) for k, v in zip(SINGLE_FILE_FLAGS, (clip_l, clip_g, t5, vae)) if v is not None}


@contextlib.contextmanager
def removed_if_failed(*paths: Path | None) -> Iterator[None]:
    """When the command fails, remove the folders it created for each of ``paths`` (the path and its missing parents)
    where they hold no file, so a failed run leaves no empty output folder behind; a folder that existed before, or
    holds a file, is never touched."""
    new = [top for top in map(_topmost_missing, filter(None, paths)) if top is not None]
    try:
        yield
    except BaseException:
        for path in new:
            _remove_empty_tree(path)
        raise


def _topmost_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: ``path`` exists)."""
    missing = None
    for candidate in (Path(path).absolute(), *Path(path).absolute().parents):
        if os.path.lexists(candidate):
            return missing
        missing = candidate
    return missing


def _remove_empty_tree(path: Path) -> None:
    """``path`` and the folders below it, as long as they hold no file (rmdir refuses a folder that is not empty)."""
    if path.is_symlink() or not path.is_dir():
        return
    for child in path.iterdir():
        _remove_empty_tree(child)
    with contextlib.suppress(OSError):
        path.rmdir()
