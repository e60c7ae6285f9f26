"""The `squareq` command line: a thin layer that parses flags, calls the library and prints."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import click

from . import __version__
from .acceptance import AcceptError
from .compiler.budget import BudgetError
from .compiler.ladder import DEFAULT_FORMATS, ladder
from .compiler.state import StateError
from .compiler.thresholds import ThresholdsError
from .devices import DeviceError, describe, run_on
from .extras import MissingExtra
from .models import ModelError
from .quant import SpecError
from .runtime import PeftMissing, PlanError, StreamError
from .runtime.attention_choice import MODES as ATTENTION_MODES
from .runtime.block_compile import MODES as COMPILE_MODES
from .runtime.compute import MODES as COMPUTE_MODES
from .sizes import SizeError, parse_size
from .slab import SlabError, open_slab
from .slab.atomic import OutputError, os_error_sentence
from .slab.summary import format_summary, summarize
from .sources.encoder_source import SINGLE_FILE_FLAGS, cli_flag
from .sources.encoders import EncoderError
from .train.cache import CacheError
from .train.checkpoint_state import CheckpointError
from .train.config import ConfigError, TrainConfig, load_config
from .train.config_help import HELP
from .train.config_values import CUDA_GRAPHS
from .train.data import DataError
from .train.errors import TrainError
from .train.lora_factors import LoraFileError
from .train.prompt_options import PromptError
from .train.sample import SampleError

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


# Libraries whose routine warnings (diffusers' "AutoencoderKL ... float32", "truncated to N tokens", torchvision's
# deprecations) would bury SquareQ's own lines in a 10-hour log; --verbose shows them.
THIRD_PARTIES = ("diffusers", "transformers", "huggingface_hub", "accelerate", "torchvision", "peft")


def quiet_third_parties(verbose: bool) -> None:
    """Without ``verbose``: only errors from the libraries SquareQ drives, through logging or ``warnings``; with it,
    their warnings too."""
    if verbose:
        for name in THIRD_PARTIES:
            logging.getLogger(name).setLevel(logging.WARNING)
        return
    import os
    import warnings

    # diffusers and transformers set their loggers' level when first imported, from these variables
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in THIRD_PARTIES:
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")


def _encoder_file_options(command):
    """--clip-l, --clip-g, --t5 and --vae: encoders as single files, with `squareq train`'s help (train.config)."""
    for name in reversed(SINGLE_FILE_FLAGS):
        command = click.option(cli_flag(name), name, type=click.Path(path_type=Path), help=HELP[name])(command)
    return command


def _device_option(what_runs: str, cpu_note: str = "else the CPU"):
    return click.option("--device", default="auto", show_default=True,
                        help=f"Where {what_runs}: auto (the GPU when PyTorch sees one; {cpu_note}), cpu, cuda or "
                        "cuda:N.")


_REVISION = click.option("--revision", help="The branch, tag or commit of a Hugging Face Hub ID given as the model.")


@main.command()
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--model", required=True, help="The source the slab was compiled from: a Hugging Face Hub ID, a "
              "diffusers folder, a BFL FLUX.1 file or tiny-flux (the bf16 reference for every gate).")
@_REVISION
@_encoder_file_options
@click.option("--thresholds", "thresholds_file", type=click.Path(path_type=Path),
              help="The compiler's TOML file; [thresholds] mse, drift, psnr, ssim, grad_cos, grad_norm and conv "
              "apply here (docs/accept.md).")
@click.option("--budget", help="Largest slab size, e.g. 12GB (default: the budget the compile recorded).")
@click.option("--vram-budget", help="Largest peak reserved GPU memory of the training steps, e.g. 12GB.")
@click.option("--steps", type=click.IntRange(min=4), default=40, show_default=True,
              help="Training steps of each convergence run (frozen bf16, bf16, slab).")
@click.option("--data", type=click.Path(path_type=Path), help="Images with captions for the convergence runs "
              "(default: the built-in tiny dataset of coloured shapes).")
@click.option("--train-config", type=click.Path(path_type=Path), help="A squareq train TOML the convergence runs "
              "start from (this gate sets steps, schedule, data and output).")
@click.option("--resolution", type=click.IntRange(min=64), help="Training resolution (default: --train-config's; "
              "else 64 on the built-in dataset, 512 otherwise).")
@click.option("--max-sequence-length", type=click.IntRange(min=1), help="Text-encoder tokens per caption (default: "
              "--train-config's; else 32 on the built-in dataset, 512 otherwise).")
@click.option("--lr", type=float, help="Learning rate of the convergence runs (default: --train-config's; else 5e-3 "
              "on the built-in dataset, 1e-3 otherwise).")
@click.option("--rank", type=click.IntRange(min=1), help="LoRA rank of both runs (default: --train-config's, else 16).")
@click.option("--samples", type=click.IntRange(min=2), default=2, show_default=True,
              help="Fresh calibration samples for layer MSE and block drift (at least 2: one is held out).")
@click.option("--images", type=click.IntRange(min=1, max=16), default=4, show_default=True,
              help="Image drift: how many of the built-in prompts to draw, from the bf16 source and from the slab.")
@click.option("--sample-steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Image drift: sampling steps per image.")
@click.option("--clip-model", type=click.Path(path_type=Path), help="Image drift: a local CLIP model folder; adds "
              "each image's CLIP score to the report (nothing is downloaded).")
@click.option("--workdir", type=click.Path(path_type=Path),
              help="Reference slab, training runs and the loss plot (default: SLAB.accept next to the slab).")
@click.option("--report", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--junit", type=click.Path(path_type=Path), help="Write a JUnit XML report here (for CI systems).")
@click.option("--require-gpu", is_flag=True, help="A gate that needs a GPU fails instead of being skipped.")
@click.option("--compute", type=click.Choice(COMPUTE_MODES), default="auto", show_default=True,
              help="The slab's base-layer arithmetic in the gradient, image-drift and convergence gates, as squareq "
              "train and sample run it (auto: FP8 on GPUs with FP8 tensor cores, see docs/tuning.md); the bf16 "
              "references run in bf16.")
@_device_option("every gate runs", "on a CPU, auto refuses a model over 1B parameters and says how long it "
                "would take")
def accept(slab, model, revision, clip_l, clip_g, t5, vae, thresholds_file, budget, vram_budget, steps, data,
           train_config, resolution, max_sequence_length, lr, rank, samples, images, sample_steps, clip_model, workdir,
           report, junit, require_gpu, compute, device) -> None:
    """Gate SLAB before anyone trains on it: layer MSE and block drift on fresh inputs, image drift and LoRA
    gradient agreement against the bf16 source, convergence decided by paired tests, peak VRAM and size. Exit
    status 0 when every gate passes, 3 when one fails, 4 when none fails but one cannot decide (INCONCLUSIVE),
    1 when it cannot run."""
    from .acceptance import AcceptOptions
    from .acceptance import accept as run_accept
    from .acceptance.convergence import ConvergenceSettings
    from .compiler import Thresholds

    for flag, path in (("--report", report), ("--junit", junit)):
        if path is not None and not Path(path).parent.is_dir():
            raise click.BadParameter(f"the folder {Path(path).parent} does not exist; create it or write the report "
                                     "elsewhere.", param_hint=flag)
    builtin = data is None and train_config is None  # the built-in 64 px images and short captions
    opts = AcceptOptions(
        slab=slab, model=model, revision=revision, files=_given_files(clip_l, clip_g, t5, vae), device=device,
        thresholds=Thresholds.from_toml(thresholds_file) if thresholds_file else Thresholds(),
        budget=parse_size(budget, "--budget") if budget else None,
        vram_budget=parse_size(vram_budget, "--vram-budget") if vram_budget else None,
        workdir=workdir, require_gpu=require_gpu, samples=samples, images=images, sample_steps=sample_steps,
        clip_model=str(clip_model) if clip_model else None,
        training=ConvergenceSettings(steps=steps, data=str(data) if data else "", lr=lr or (5e-3 if builtin else None),
                                     rank=rank,
                                     resolution=resolution or (64 if builtin else None),
                                     max_sequence_length=max_sequence_length or (32 if builtin else None),
                                     base=str(train_config) if train_config else None, compute=compute))
    result = run_accept(opts, echo=lambda line: click.echo(line, err=True))
    click.echo(result.table())
    if report:
        result.write_json(report)
        click.echo(f"report: {report}")
    if junit:
        result.write_junit(junit)
        click.echo(f"junit: {junit}")
    for gate in result.gates:
        for key, what in (("grid", "images"), ("plot", "loss curves")):
            if gate.details.get(key):
                click.echo(f"{what}: {gate.details[key]}")
    sys.exit({"PASSED": 0, "FAILED": 3, "INCONCLUSIVE": 4}[result.verdict])


def _compile_line(line: str) -> None:
    """One line of the compile's progress on stderr; on a terminal the blocks' bar (compile_slab's ``bar``) is drawn
    below these lines."""
    click.echo(f"[compile] {line}", err=True)


def _given_calibration(calib_cache, calib_text) -> str:
    """The flag that chose data other than images to encode, for a sentence."""
    return "--calib-cache" if calib_cache else "--calib-text" if calib_text else "--calib-synthetic"


def _given_files(clip_l, clip_g, t5, vae) -> dict[str, str]:
    return {k: str(v) for k, v in zip(SINGLE_FILE_FLAGS, (clip_l, clip_g, t5, vae)) if v is not None}


@main.command("compile")
@click.argument("model")
@_REVISION
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="The slab directory to write.")
@click.option("--budget", required=True, help="Largest slab size, e.g. 12GB, 11.5GiB, 800MB.")
@click.option("--objective", type=click.Choice(["size", "quality"]), default="size", show_default=True,
              help="size: the smallest plan whose measured model-output error meets τ_OUT; quality: then spend the "
                   "rest of the budget where that error falls most per byte.")
@click.option("--thresholds", "thresholds_file", type=click.Path(path_type=Path),
              help="TOML file with a [thresholds] table (out decides; mse, act, scale, block are diagnostics; drift, "
              "psnr, ssim, grad_cos, grad_norm and conv are for squareq accept); defaults in docs/compiler.md.")
@click.option("--formats", default=",".join(DEFAULT_FORMATS), show_default=True,
              help=f"The ladder's rungs to measure, comma-separated, from: {', '.join(ladder())} (fewest bytes per "
              "weight first; W is integer codes, NF4 the QLoRA lookup, FP8 E4M3). Each layer starts on the cheapest "
              "and moves up where its measured effect on the output falls most per byte; fewer rungs, a faster "
              "compile.")
@click.option("--min-bits", "old_min_bits", hidden=True, help="Gone: see --formats.")
@click.option("--max-bits", "old_max_bits", hidden=True, help="Gone: see --formats.")
@click.option("--blocks", multiple=True, help="Generic mode: attribute path of an nn.ModuleList of blocks "
                                              "(repeatable).")
@click.option("--model-class", default=None, help="Build this transformers/diffusers class (e.g. BertModel) "
              "instead of the one config.json names.")
@click.option("--calib-data", type=click.Path(path_type=Path), default=None,
              help="Calibrate on these captioned images (the trainer's layouts), encoded by the model's own VAE and "
              "text encoders (default: the built-in photographs).")
@click.option("--calib-cache", type=click.Path(path_type=Path), default=None,
              help="Calibrate on a training cache (squareq cache / squareq train).")
@click.option("--calib-text", type=click.Path(path_type=Path), default=None,
              help="Text models: calibrate on this UTF-8 file, one sample per line (default: built-in English text).")
@click.option("--encoders", default=None, help="The pipeline with the VAE and text encoders that encode the "
              "calibration images: a folder or Hub ID (default: MODEL's own pipeline; for a BFL FLUX.1 file with "
              "--clip-l/--t5/--vae, black-forest-labs/FLUX.1-dev's configs and tokenizers).")
@_encoder_file_options
@click.option("--calib-samples", type=click.IntRange(min=2), default=None,
              help="Calibration samples, a quarter held out (default: 32 for images, 512 for text).")
@click.option("--calib-resolution", type=click.IntRange(min=64), default=512, show_default=True,
              help="Side of the square calibration images, in pixels.")
@click.option("--calib-tokens", type=click.IntRange(min=2), default=None,
              help="Text models: most tokens per calibration sample (default: 128).")
@click.option("--calib-synthetic", is_flag=True, help="Calibrate on noise and Gaussian text instead of data: for speed "
              "tests only, the compiler's choices are then not to be trusted.")
@click.option("--rounding", type=click.Choice(["gptq", "nearest"]), default="gptq", show_default=True,
              help="gptq: error-compensating rounding from input second moments; nearest: plain RTN.")
@click.option("--rotation/--no-rotation", default=True, show_default=True,
              help="Also try each layer Hadamard-rotated (kept only where it lowers the held-out error); "
              "--no-rotation: a faster search, without the rotation's gain.")
@click.option("--learned-rounding/--no-learned-rounding", default=True, show_default=True,
              help="Move the chosen codes one step at a time where that lowers the layer's error on the calibration "
              "data (kept only where it lowers the held-out error; needs --rounding gptq's statistics).")
@click.option("--output-correction", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="After the plan, refit each layer's per-channel scale and bias so its outputs in the quantized "
              "model keep the original's mean and spread (no extra bytes or time in the slab; kept only where it "
              "lowers the held-out error). auto: text models only.")
@click.option("--group-size", type=int, default=64, show_default=True)
@click.option("--from", "previous", type=click.Path(path_type=Path), default=None,
              help="Rebuild from this earlier slab of the same model: each layer starts at its rung there, and its "
              "measurements are reused when the source, data and search options are unchanged.")
@click.option("--effect-probes", type=click.IntRange(min=1), default=4, show_default=True,
              help="Random probes of each layer's effect on the model's output, each a copy of the held-out samples "
              "(more: less noise, more compute).")
@click.option("--max-block-bytes", help="Cap on the largest streamed block (the runtime's ring holds K slots of it), "
              "e.g. 400MB.")
@click.option("--vram-cap", help="GPU memory for the streamed weights, e.g. 4GB: caps the largest block at "
              "(this - the resident tensors) / --ring-slots.")
@click.option("--ring-slots", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ring slots the runtime will use, for --vram-cap.")
@_device_option("the compile runs", "on a CPU, auto refuses a model over 1B parameters and says how long it would "
                "take")
@click.option("--vram-budget", help="GPU memory this compile may use, e.g. 8GB (default: what the device has free); "
              "what does not fit waits in pinned host memory, and the slab is the same.")
@click.option("--host-budget", help="Host memory (RAM) this compile may use, e.g. 32GB (default: what the machine has "
              "available, less 10% or 2 GB); what does not fit is spilled to a scratch file in the state folder "
              "(<out>.state), and the slab is the same.")
@click.option("--resume", is_flag=True, help="Continue an interrupted compile from its state folder.")
@click.option("--force", is_flag=True, help="Replace an existing slab at --out.")
def compile_cmd(model, revision, out, budget, objective, thresholds_file, formats, old_min_bits, old_max_bits, blocks,
                model_class, calib_data, calib_cache, calib_text, encoders, clip_l, clip_g, t5, vae, calib_samples,
                calib_resolution, calib_tokens, calib_synthetic, rounding, rotation, learned_rounding,
                output_correction, group_size, previous, effect_probes, max_block_bytes, vram_cap, ring_slots, device,
                vram_budget, host_budget, resume, force) -> None:
    """Calibrate MODEL on real data, choose a format per layer (W4/W6/W8/bf16 by default) under a size budget, write a
    slab.

    MODEL is a Hugging Face Hub ID (black-forest-labs/FLUX.1-dev; from the local cache, or downloading only what
    the compile reads), a diffusers folder (pipeline or transformer/), a BFL FLUX.1 .safetensors file (ComfyUI's
    flux1-dev.safetensors, with --clip-l, --t5 and --vae), tiny-flux, or, with --blocks, any diffusers/transformers
    model folder or Hub ID.
    """
    from .compiler import CompileOptions, Thresholds, check_budget, compile_slab
    from .compiler.device_choice import choose_device, compile_flops
    from .compiler.inputs import DEFAULT_IMAGE_SAMPLES, is_text_model
    from .compiler.previous import check_previous
    from .compiler.vram import memory_cap
    from .sources import open_source
    from .sources.encoder_source import encoder_source_for, pinned

    _check_compile_flags(max_block_bytes, vram_cap, old_min_bits or old_max_bits,
                         {"--calib-data": calib_data, "--calib-cache": calib_cache, "--calib-text": calib_text,
                          "--calib-synthetic": calib_synthetic})
    opts = CompileOptions(
        budget=parse_size(budget, "--budget"), objective=objective,
        thresholds=Thresholds.from_toml(thresholds_file) if thresholds_file else Thresholds(),
        formats=formats, rounding=rounding, rotation=rotation, learned_rounding=learned_rounding,
        output_correction=output_correction, group_size=group_size,
        calib_samples=calib_samples,
        calib_cache=str(calib_cache) if calib_cache else None, calib_text=str(calib_text) if calib_text else None,
        calib_tokens=calib_tokens, calib_synthetic=calib_synthetic,
        max_block_bytes=parse_size(max_block_bytes, "--max-block-bytes") if max_block_bytes else None,
        vram_cap=parse_size(vram_cap, "--vram-cap") if vram_cap else None, ring_slots=ring_slots,
        previous=str(previous) if previous else None, effect_probes=effect_probes,
        vram_budget=parse_size(vram_budget, "--vram-budget") if vram_budget else None,
        host_budget=parse_size(host_budget, "--host-budget") if host_budget else None, resume=resume, overwrite=force,
    )
    files = _given_files(clip_l, clip_g, t5, vae)
    given = ", ".join([*(cli_flag(k) for k in files), *(["--encoders"] if encoders else [])])
    if given and (calib_cache or calib_text or calib_synthetic):  # before anything is downloaded
        raise click.UsageError(f"{given} encode calibration images, and {_given_calibration(calib_cache, calib_text)} "
                               "encodes none; leave them out.")

    def on_device(candidate) -> None:  # before a Hub ID's weights are downloaded
        opts.device = choose_device(device, candidate,
                                    lambda skeleton: compile_flops(candidate, skeleton, opts, calib_resolution))

    source = open_source(model, list(blocks) or None, revision, check=on_device, model_class=model_class)
    _compile_line(f"compiling {source.description} on {describe(opts.device)}")
    check_budget(source, opts)  # before the encoders run
    check_previous(opts.previous, source)  # --from: another model or a damaged build number, before the encoders run
    trains = source.family_adapter is not None and source.family_adapter.recipe is not None
    if not (calib_cache or calib_text or calib_synthetic) and trains and not is_text_model(source.skeleton()):
        from .train.calibration_images import calibration_images

        where = None
        if encoders or files:
            where = encoder_source_for(source.encoder_source or source.description, source.family,
                                       source.skeleton().config, model=encoders, files=files)
            opts.encoders = pinned(where).record()  # train and sample find the same encoders
        with memory_cap(opts.vram_budget, opts.device):  # the encoders run on the GPU too
            opts.calib_images = calibration_images(source, data=calib_data, encoders=where,
                                                   resolution=calib_resolution, device=opts.device,
                                                   limit=calib_samples or DEFAULT_IMAGE_SAMPLES, seed=opts.seed,
                                                   echo=_compile_line, vram_budget=opts.vram_budget)
    elif calib_data:
        raise click.UsageError(f"--calib-data is for the diffusion families; {model} is calibrated on text, so pass "
                               "--calib-text FILE instead.")
    elif given:
        raise click.UsageError(f"{given} encode calibration images, and {model} is calibrated on text; leave them out.")
    manifest = compile_slab(source, out, opts, progress=_compile_line, bar=sys.stderr.isatty())
    counts = {}
    for layer in manifest.layers:
        counts[layer.spec.short_label] = counts.get(layer.spec.short_label, 0) + 1
    size = sum(p.stat().st_size for p in out.iterdir())
    click.echo(f"wrote {out}: {size:,} bytes (budget {opts.budget:,}); layers: "
               + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
               + f"; see the reasons with: squareq inspect {out}")


def _check_compile_flags(max_block_bytes, vram_cap, old_bits, calibration: dict) -> None:
    """Refuse flags that contradict each other or are gone, before anything is read."""
    if max_block_bytes and vram_cap:
        raise click.UsageError("--max-block-bytes and --vram-cap each cap the largest block; give one of them.")
    if old_bits:
        raise click.UsageError("--min-bits and --max-bits are gone: name the rungs with --formats instead (--formats "
                               "W6,W8,bf16 for --min-bits 6, --formats W4,W6,W8 for --max-bits 8).")
    given = [flag for flag, v in calibration.items() if v]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} each name the calibration data; give one of them.")


def _config_options(command):
    """A flag for every TrainConfig key (its help from train.config.HELP), so the file and the flags never drift."""
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


@main.command()
@click.argument("slab", type=click.Path(path_type=Path), required=False)
@click.option("--data", type=click.Path(path_type=Path), help="Folder of images with .txt captions or metadata.jsonl.")
@click.option("-o", "--out", "output", type=click.Path(path_type=Path), help="Folder for the LoRA, checkpoints and "
                                                                             "logs.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="A TOML file of training options.")
@click.option("--print-config", is_flag=True, help="Print the resolved configuration as TOML and exit.")
@_config_options
def train(slab, data, output, config_file, print_config, **flags) -> None:
    """Train a LoRA on SLAB, streaming its blocks through the GPU (flags override --config)."""
    from .train.loop import train as run_training

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


@main.command("cache")
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), required=True, help="Folder of images with captions.")
@click.option("--cache-dir", type=click.Path(path_type=Path), required=True, help="Where the cache goes.")
@click.option("--config", "config_file", type=click.Path(path_type=Path), help="A TOML file of training options.")
@click.option("--model", help=HELP["model"])
@_REVISION
@_encoder_file_options
@click.option("--resolution", help=HELP["resolution"])
@click.option("--trigger", help=HELP["trigger"])
@click.option("--caption-ext", help=HELP["caption_ext"])
@click.option("--max-sequence-length", type=int, help=HELP["max_sequence_length"])
@_device_option("the VAE and text encoders run")
def cache_cmd(slab, data, cache_dir, config_file, model, revision, clip_l, clip_g, t5, vae, resolution, trigger,
              caption_ext, max_sequence_length, device) -> None:
    """Compute the latents and text embeddings `squareq train` would, without training."""

    from .train.prepare import prepare_data

    cfg = load_config(config_file, {"slab": str(slab), "data": str(data), "cache_dir": str(cache_dir), "model": model,
                                    "revision": revision, "resolution": resolution, "trigger": trigger,
                                    "caption_ext": caption_ext, "max_sequence_length": max_sequence_length,
                                    **_given_files(clip_l, clip_g, t5, vae)})
    with open_slab(slab, verify="off") as s:
        record = s.manifest.model
    with run_on(device) as where:
        prepared = prepare_data(cfg, record, where, echo=click.echo)
    n = prepared.computed
    click.echo(f"{len(prepared.dataset)} images cached in {cache_dir} ({n} {'entry' if n == 1 else 'entries'} "
               "computed now)")


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


@main.command()
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True,
              help="A prompt (repeat for several images), with kohya's per-prompt options if wanted: "
              "\"a fox --w 768 --h 1024 --s 28 --g 3.5 --d 7 --n blurry --l 4\" (width, height, steps, guidance, "
              "seed, negative prompt, true CFG scale; docs/train.md).")
@click.option("--prompt-file", type=click.Path(path_type=Path), help="A text file of prompts, one a line, options "
              "included (kohya's prompt file; empty and # lines skipped); drawn after the --prompt ones.")
@click.option("--lora", type=click.Path(path_type=Path), help="A LoRA file or folder (diffusers or kohya layout).")
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("samples"), show_default=True,
              help="Folder for the PNG files.")
@click.option("--model", help=HELP["model"])
@_REVISION
@_encoder_file_options
@click.option("--prior", help="Würstchen: the prior's pipeline folder or Hub ID (warp-ai/wuerstchen-prior), run whole "
              "beside a decoder slab; an image needs both stages.")
@click.option("--decoder", help="Würstchen: the decoder's pipeline folder or Hub ID (warp-ai/wuerstchen), run whole "
              "beside a prior slab.")
@click.option("--resolution", type=int, default=1024, show_default=True)
@click.option("--steps", type=int, default=20, show_default=True, help="Denoising steps.")
@click.option("--guidance", type=float, default=3.5, show_default=True, help="Guidance scale, 0 to 100.")
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--max-sequence-length", type=int, default=512, show_default=True, help="T5 tokens per prompt.")
@click.option("--prefetch", type=AutoOrInt(minimum=1), default="auto", show_default=True,
              help="Block slots on the GPU: a number, or auto (start at 3; after the second step, or with "
                   "--cuda-graphs the first that replays them, add slots while a step simulated from the measured "
                   "copies and compute gets faster, as free VRAM allows, at most 8).")
@click.option("--resident-blocks", type=AutoOrInt(minimum=0), default="0", show_default=True,
              help="Blocks kept on the GPU after the measured step, those whose copy outweighs their compute "
                   "first: a number, or auto (as many as free VRAM allows while copies are not hidden).")
@click.option("--vram-budget", help="GPU memory the denoising steps may reserve, e.g. 3GB: bounds the slots "
              "--prefetch auto adds and the blocks --resident-blocks keeps (default: what the device has free, less a "
              "margin). What is on the GPU when they are planned (the denoiser, Würstchen's other stage) counts; "
              "FLUX.1's text encoders, which run before, and the VAE's decode after, do not.")
@click.option("--host", type=click.Choice(["auto", "pinned", "disk"]), default="auto", show_default=True,
              help="Where block blobs wait: auto (pinned when they fit in the host memory available with room to "
                   "spare, else disk), pinned (RAM) or disk (read from the slab file).")
@click.option("--compute", type=click.Choice(COMPUTE_MODES), default="auto", show_default=True, help=HELP["compute"])
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16"]), default="auto", show_default=True,
              help="The activations' 16-bit type: auto (fp16 on GPUs without bf16: T4, V100, RTX 20xx; bf16 "
                   "elsewhere), bf16 or fp16.")
@click.option("--frames", type=int, default=1, show_default=True,
              help="Frames of a video family's clip (Wan, HunyuanVideo, LTX-Video), saved as an animated WebP; a "
                   "prompt's --f sets its own.")
@click.option("--cuda-graphs", is_flag=True, help="Replay each block's forward from a CUDA graph once the first "
              "denoising steps have captured it (CUDA only; docs/tuning.md says when it pays).")
@click.option("--compile", "compile_mode", type=click.Choice(COMPILE_MODES), default="auto", show_default=True,
              help="Run each block's forward under torch.compile: on, off, or auto (off: a sampling run measured "
                   "slower with its compile counted; docs/tuning.md).")
@click.option("--attention", type=click.Choice(ATTENTION_MODES), default="auto", show_default=True,
              help=HELP["attention"])
def sample(slab, prompts, prompt_file, lora, out, model, revision, clip_l, clip_g, t5, vae, prior, decoder, resolution,
           steps,
           guidance, seed, max_sequence_length, prefetch, resident_blocks, vram_budget, host, compute, dtype, frames,
           cuda_graphs, compile_mode, attention):
    """Generate images with the streamed slab, optionally with a LoRA: FLUX.1 through SquareQ's sampler, other
    families through their diffusers pipeline folder (--model)."""
    from .plot import write_sample
    from .train.prompt_options import read_prompt_file

    try:
        prompts = list(prompts) + (read_prompt_file(prompt_file) if prompt_file else [])
    except PromptError as exc:
        raise SampleError(f"--prompt-file: {exc}") from None
    if not prompts:
        raise SampleError("squareq sample needs something to draw: give --prompt TEXT (repeat for several) or "
                          "--prompt-file FILE.")
    from .slab.atomic import ensure_output_dir
    from .train.sample import check_sample_options, sample_images

    check_sample_options(resolution, steps, guidance, max_sequence_length)
    limit = parse_size(vram_budget, "--vram-budget") if vram_budget else None
    ensure_output_dir(out, "-o/--out")  # before any drawing, whose images would otherwise be lost

    def save(i: int, image) -> None:
        stem = out / f"sample-{i:03d}"
        try:
            path = write_sample(image, stem)  # a video's frames: an animated WebP
        except OSError as exc:
            raise SampleError(os_error_sentence(exc, f"saving {stem}", "draw the remaining prompts again")) from None
        click.echo(f"wrote {path}")

    sample_images(slab, list(prompts), lora=lora, model=model, resolution=resolution, steps=steps, guidance=guidance,
                  seed=seed, max_sequence_length=max_sequence_length, prefetch=prefetch, host=host,
                  resident_blocks=resident_blocks, on_image=save, compute=compute, cuda_graphs=cuda_graphs,
                  revision=revision, files=_given_files(clip_l, clip_g, t5, vae), compile=compile_mode,
                  attention=attention, dtype=dtype, frames=frames, vram_budget=limit,
                  stages={"prior": prior, "decoder": decoder})


@main.command("export-lora")
@click.argument("lora", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True,
              help="kohya: a .safetensors file; diffusers: a folder for pytorch_lora_weights.safetensors.")
@click.option("--format", "fmt", type=click.Choice(["kohya", "diffusers"]), default="kohya", show_default=True)
def export_lora(lora: Path, out: Path, fmt: str) -> None:
    """Write a LoRA in another layout (kohya/ComfyUI or diffusers/PEFT)."""
    from .runtime import LoraVariant
    from .train.lora_files import WEIGHT_NAME, save_diffusers_lora, save_kohya_lora
    from .train.lora_reader import load_lora

    source = lora / WEIGHT_NAME if lora.is_dir() else lora
    target = out if fmt == "kohya" else out / WEIGHT_NAME
    if source.exists() and target.exists() and source.resolve() == target.resolve():
        raise click.UsageError(f"-o {out} would overwrite the LoRA being exported ({source}); write the {fmt} layout "
                               "to another path.")
    from .slab.atomic import remove_debris

    for debris in remove_debris(target):  # an export killed mid-write (its cleanup never ran) left its temporary
        click.echo(f"removed {debris}, left by an export that was killed while writing it")
    factors, info = load_lora(lora)
    save = save_kohya_lora if fmt == "kohya" else save_diffusers_lora
    provenance = {k: v for k, v in info["metadata"].items() if k in ("family", "base_model_signature")}
    prefix = {"prefix": info["component"], "variant": LoraVariant(dora=info["use_dora"])} if fmt == "diffusers" else {}
    path = save(factors, out, info["rank"], info["alpha"], info["targets"], extra_metadata=provenance,
                header=info["header"], **prefix)
    click.echo(f"wrote {path} ({fmt} layout, rank {info['rank']}, alpha {info['alpha']:g})")


@main.command()
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--verify", is_flag=True, help="Check every block's and resident tensor's sha256 first.")
def inspect(slab: Path, as_json: bool, verify: bool) -> None:
    """Show a slab's layers, formats, sizes and metrics."""
    with open_slab(slab, verify="eager" if verify else "off") as s:
        report = summarize(s)
    report["verified"] = verify
    # slabs written before the resident layout digest still open; --verify says what they lack and how to add it
    unhashed = verify and s.manifest.resident and not s.manifest.resident_layout_sha256
    note = (f"note: {slab} was written before resident tensors had a layout digest, so their names, dtypes and "
            "shapes are checked but not hashed; recompile it with `squareq compile` to protect them")
    if as_json:
        click.echo(json.dumps(report, indent=1))
        if unhashed:
            click.echo(note, err=True)
        return
    click.echo(format_summary(report))
    if verify:
        click.echo("verify: every block and resident tensor matches its sha256")
    if unhashed:
        click.echo(note)


@main.command()
def families() -> None:
    """The model families SquareQ knows and what it does for each (compile, stream, train, sample)."""
    from .models import families_table

    click.echo(families_table(), nl=False)


class _StatusLine:
    """A status that rewrites one line of a terminal (``\\r``); in a log file, every ``every``-th update as a line
    of its own. ``echo`` ends the status line before printing."""

    def __init__(self, every: int) -> None:
        self.every, self.calls, self.open = every, 0, False
        self.tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        self.calls += 1
        if self.tty:
            click.echo("\r" + text.ljust(60), nl=False, err=True)
            self.open = True
        elif self.calls % self.every == 0:
            click.echo(text, err=True)

    def echo(self, line: str) -> None:
        if self.open:
            click.echo("", err=True)
            self.open = False
        click.echo(line)


@main.command()
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("squareq-demo"), show_default=True,
              help="Folder for the demo's slab, data, LoRA, sample image and acceptance report.")
@click.option("--budget", default="2MB", show_default=True, help="Size budget for the tiny model's slab.")
@click.option("--steps", type=int, default=200, show_default=True, help="LoRA training steps.")
@click.option("--force", is_flag=True, help="Replace an earlier demo in --out.")
def demo(out: Path, budget: str, steps: int, force: bool) -> None:
    """compile → train → sample → accept on the built-in tiny model and dataset (a few minutes on a CPU)."""
    from .demo import run_demo

    started = time.perf_counter()
    status = _StatusLine(every=max(1, steps // 4))
    result = run_demo(out, parse_size(budget, "--budget"), overwrite=force, steps=steps, echo=status.echo,
                      status=status)
    details = {g.name: g.details for g in result.report.gates}
    verdict = {"PASSED": "all gates passed", "FAILED": "a gate FAILED", "INCONCLUSIVE": "a gate was INCONCLUSIVE"}
    click.echo(f"\nslab:   {result.slab}  (squareq inspect {result.slab})\nLoRA:   {result.lora}\n"
               f"sample: {result.sample}\nreport: {result.report_path}\n"
               f"images: {details['image drift'].get('grid')}  (bf16 | slab | difference)\n"
               f"loss curves: {details['convergence'].get('plot')}\n"
               f"{verdict[result.report.verdict]} in {time.perf_counter() - started:.0f} s")
    sys.exit({"PASSED": 0, "FAILED": 3, "INCONCLUSIVE": 4}[result.report.verdict])


if __name__ == "__main__":
    main()
