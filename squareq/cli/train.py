"""`squareq train` and `squareq cache`: a flag for every training key (their help: train/config_help.py), the
configuration resolved from defaults, --config and flags, then a training run or the cache filled alone."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from ..devices import run_on
from ..slab import open_slab
from ..train.config import TrainConfig, load_config
from ..train.config_help import HELP
from ..train.config_values import CUDA_GRAPHS
from .options import REVISION, device_option, encoder_file_options, given_files


def _config_options(command):
    """A flag for every TrainConfig key (its help: train.config_help.HELP), so the file and the flags never drift."""
    for f in reversed(dataclasses.fields(TrainConfig)):
        if f.name in ("slab", "data", "output"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "sample_prompts":
            command = click.option(flag, f.name, multiple=True, help=HELP[f.name])(command)
        elif f.name == "cuda_graphs":  # a bare --cuda-graphs, as before it took a value, means on
            command = click.option(flag, f.name, type=click.Choice(CUDA_GRAPHS), is_flag=False, flag_value="on",
                                   default=None, help=HELP[f.name])(command)
        elif str(f.type) == "bool":  # --no-upscale; None when not given, so a config file's value stands
            command = click.option(flag, f.name, is_flag=True, flag_value=True, default=None,
                                   help=HELP[f.name])(command)
        else:
            kind = str(f.type)
            # a word or a count (prefetch: auto or 3) is read as text and settled by the config
            typ = str if "list" in kind or "str" in kind else float if "float" in kind else \
                int if "int" in kind else str
            command = click.option(flag, f.name, type=typ, default=None, help=HELP[f.name])(command)
    return command


@click.command()
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

    flags = {k: (list(v) or None) if k == "sample_prompts" else v for k, v in flags.items()}
    flags.update(slab=str(slab) if slab else None, data=str(data) if data else None,
                 output=str(output) if output else None)
    cfg = load_config(config_file, flags)
    if print_config:
        click.echo(cfg.to_toml(), nl=False)
        return
    for key, flag in (("slab", "SLAB"), ("data", "--data"), ("output", "-o/--out")):
        if not getattr(cfg, key):
            raise click.UsageError(f"{flag} is required (or set {key} in --config).")
    result = run_training(cfg, echo=click.echo)
    click.echo(f"done: {result.steps} steps, LoRA at {result.lora_file}")


@click.command("cache")
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), required=True, help="Folder of images with captions.")
@click.option("--cache-dir", type=click.Path(path_type=Path), required=True, help="Where the cache goes.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="A TOML file of training options.")
@click.option("--model", help=HELP["model"])
@REVISION
@encoder_file_options
@click.option("--resolution", help=HELP["resolution"])
@click.option("--trigger", help=HELP["trigger"])
@click.option("--caption-ext", help=HELP["caption_ext"])
@click.option("--max-sequence-length", type=int, help=HELP["max_sequence_length"])
@device_option("the VAE and text encoders run")
def cache_cmd(slab, data, cache_dir, config_file, model, revision, clip_l, clip_g, t5, vae, resolution, trigger,
              caption_ext, max_sequence_length, device) -> None:
    """Compute the latents and text embeddings `squareq train` would, without training."""

    from ..train.prepare import prepare_data

    cfg = load_config(config_file, {"slab": str(slab), "data": str(data), "cache_dir": str(cache_dir), "model": model,
                                    "revision": revision, "resolution": resolution, "trigger": trigger,
                                    "caption_ext": caption_ext, "max_sequence_length": max_sequence_length,
                                    **given_files(clip_l, clip_g, t5, vae)})
    with open_slab(slab, verify="off") as s:
        record = s.manifest.model
    with run_on(device) as where:
        prepared = prepare_data(cfg, record, where, echo=click.echo)
    n = prepared.computed
    click.echo(f"{len(prepared.dataset)} images cached in {cache_dir} ({n} {'entry' if n == 1 else 'entries'} "
               "computed now)")
