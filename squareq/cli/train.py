"""`squareq train` and `squareq cache`: a flag for every training key (their help: train/config_help.py; the flags
other commands share: cli/options.py), the configuration resolved from defaults, --config and the flags given, then a
training run or the cache filled alone."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from click.core import ParameterSource

from ..devices import run_on
from ..slab import open_slab
from ..train.config import TrainConfig, load_config
from ..train.config_help import HELP
from .options import (
    REVISION,
    SHARED_KEYS,
    device_option,
    encoder_file_options,
    given_files,
    removed_if_failed,
    shared_option,
)
from .train_help import GroupedCommand


def _flag_option(f: dataclasses.Field):
    """The flag of the TrainConfig key ``f`` that no other command shares, its default the key's."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kind = str(f.type)
    if f.name == "sample_prompts":
        return click.option(flag, f.name, multiple=True, help=HELP[f.name])
    if kind == "bool":  # --no-upscale
        return click.option(flag, f.name, is_flag=True, default=default, help=HELP[f.name])
    # a list (comma-separated) or a word or a count (prefetch: auto or 3) is read as text and settled by the config
    typ = str if "list" in kind or "str" in kind else float if "float" in kind else int if "int" in kind else str
    if isinstance(default, list):
        default = ",".join(map(str, default))
    return click.option(flag, f.name, type=typ, default=default, help=HELP[f.name])


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _key_option(key: str):
    """The flag of the TrainConfig key ``key``: the shared definition (cli/options.py) where other commands have it."""
    return shared_option(key) if key in SHARED_KEYS else _flag_option(_FIELDS[key])


def _config_options(command):
    """A flag for every TrainConfig key (its help: train.config_help.HELP), so the file and the flags never drift."""
    for key in reversed(_FIELDS):
        if key not in ("slab", "data", "output", "datasets"):  # datasets: tables, in a file only
            command = _key_option(key)(command)
    return command


def given(values: dict) -> dict:
    """``values`` of the flags given on the command line; None for the others, so that a --config file's values
    stand over the defaults the flags show."""
    ctx = click.get_current_context()
    typed = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return {k: v if ctx.get_parameter_source(k) in typed else None for k, v in values.items()}


@click.command(cls=GroupedCommand)
@click.argument("slab", type=click.Path(path_type=Path), required=False)
@click.option("--data", type=click.Path(path_type=Path), help="Folder of images with .txt captions or metadata.jsonl.")
@click.option("-o", "--out", "output", type=click.Path(path_type=Path), help="Folder for the LoRA, checkpoints and "
                                                                             "logs.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="A TOML file of training options.")
@click.option("--print-config", is_flag=True, help="Print the resolved configuration as TOML and exit.")
@_config_options
def train(slab, data, output, config_file, print_config, **flags) -> None:
    """Train a LoRA on SLAB, streaming its blocks through the GPU (flags override --config)."""
    from ..train.loop import train as run_training

    flags = given(flags)
    flags = {k: (list(v) or None) if k == "sample_prompts" and v is not None else v for k, v in flags.items()}
    flags.update(slab=str(slab) if slab else None, data=str(data) if data else None,
                 output=str(output) if output else None)
    cfg = load_config(config_file, flags)
    if print_config:
        click.echo(cfg.to_toml(), nl=False)
        return
    for key, flag in (("slab", "SLAB"), ("data", "--data"), ("output", "-o/--out")):
        if not getattr(cfg, key) and not (key == "data" and cfg.datasets):
            raise click.UsageError(f"{flag} is required (or set {key} in --config"
                                   + (", or [[datasets]] tables there or in --dataset-config)." if key == "data"
                                      else ")."))
    with removed_if_failed(Path(cfg.output)):  # a run that fails before writing leaves no empty folder behind
        result = run_training(cfg, echo=click.echo)
    click.echo(f"done: {result.steps} steps, LoRA at {result.lora_file}")


@click.command("cache")
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), help="Folder of images with captions (or [[datasets]] "
              "tables in --config or --dataset-config).")
@shared_option("cache_dir", "Where the cache goes.", required=True)
@_key_option("dataset_config")
@_key_option("control_dir")
@_key_option("control_resolution")
@_key_option("no_resize_control")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="A TOML file of training options.")
@shared_option("model")
@REVISION
@encoder_file_options
@_key_option("resolution")
@shared_option("trigger")
@shared_option("caption_ext")
@shared_option("max_sequence_length")
@shared_option("vram_budget", "GPU memory the encoders may use, e.g. 8GB: those that do not fit stream block by block "
               "(default: what the device has free).")
@shared_option("host_budget", "Host memory (RAM) the encoders may hold, e.g. 16GB, or auto: what the machine has "
               "available, less 10% or 2 GB. A streamed encoder is pinned whole where it fits, else read from its "
               "file through a few page-locked blocks.")
@device_option("the VAE and text encoders run")
def cache_cmd(slab, data, cache_dir, dataset_config, control_dir, control_resolution, no_resize_control, config_file,
              model, revision, clip_l, clip_g, t5, vae, resolution, trigger, caption_ext, max_sequence_length,
              vram_budget, host_budget, device) -> None:
    """Compute the latents and text embeddings `squareq train` would, without training."""

    from ..train.prepare import prepare_data

    values = given({"model": model, "revision": revision, "resolution": resolution, "trigger": trigger,
                    "caption_ext": caption_ext, "max_sequence_length": max_sequence_length,
                    "vram_budget": vram_budget, "host_budget": host_budget, "dataset_config": dataset_config,
                    "control_dir": control_dir, "control_resolution": control_resolution,
                    "no_resize_control": no_resize_control})
    cfg = load_config(config_file, {"slab": str(slab), "data": str(data) if data else None,
                                    "cache_dir": str(cache_dir), **values, **given_files(clip_l, clip_g, t5, vae)})
    if not cfg.data and not cfg.datasets:
        raise click.UsageError("--data is required (or set data in --config, or [[datasets]] tables there or in "
                               "--dataset-config).")
    with open_slab(slab, verify="off") as s:
        record = s.manifest.model
    with run_on(device) as where, removed_if_failed(cache_dir):
        prepared = prepare_data(cfg, record, where, echo=click.echo)
    n = prepared.computed
    click.echo(f"{len(prepared.dataset)} images cached in {cache_dir} ({n} {'entry' if n == 1 else 'entries'} "
               "computed now)")
