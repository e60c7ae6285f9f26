"""`squareq compile`: its flags checked against each other, the source opened and its device chosen, the calibration
images encoded, and the compile's messages as `[compile]` lines on stderr (its blocks' bar: compiler/progress.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from ..compiler.ladder import DEFAULT_FORMATS, ladder
from ..devices import describe
from ..sizes import parse_size
from ..sources.encoder_source import cli_flag
from .options import REVISION, device_option, encoder_file_options, given_files, removed_if_failed, shared_option


def _compile_line(line: str) -> None:
    """One line of the compile's progress on stderr; on a terminal the blocks' bar (compile_slab's ``bar``) is drawn
    below these lines."""
    click.echo(f"[compile] {line}", err=True)


def _given_calibration(calib_cache, calib_text) -> str:
    """The flag that chose data other than images to encode, for a sentence."""
    return "--calib-cache" if calib_cache else "--calib-text" if calib_text else "--calib-synthetic"


@click.command("compile")
@click.argument("model")
@REVISION
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
@encoder_file_options
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
@device_option("the compile runs", "on a CPU, auto refuses a model over 1B parameters and says how long it would "
                "take")
@click.option("--vram-budget", help="GPU memory this compile may use, e.g. 8GB (default: what the device has free); "
              "what does not fit waits in pinned host memory, and the slab is the same.")
@shared_option("host_budget", "Host memory (RAM) this compile may use, e.g. 32GB, or auto: what the machine has "
               "available, less 10% or 2 GB; what does not fit is spilled to a scratch file in the state folder "
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
    from ..compiler import CompileOptions, Thresholds, check_budget, compile_slab
    from ..compiler.device_choice import choose_device, compile_flops
    from ..compiler.inputs import DEFAULT_IMAGE_SAMPLES, is_text_model
    from ..compiler.slab_output import check_output
    from ..compiler.state import state_folder
    from ..compiler.vram import memory_cap
    from ..sources import open_source
    from ..sources.encoder_source import encoder_source_for, pinned

    _check_compile_flags(max_block_bytes, vram_cap, old_min_bits or old_max_bits,
                         {"--calib-data": calib_data, "--calib-cache": calib_cache, "--calib-text": calib_text,
                          "--calib-synthetic": calib_synthetic})
    check_output(out, force)  # before the source is opened or anything measured
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
        host_budget=parse_size(host_budget, "--host-budget") if host_budget not in (None, "auto") else None,
        resume=resume, overwrite=force,
    )
    files = given_files(clip_l, clip_g, t5, vae)
    given = ", ".join([*(cli_flag(k) for k in files), *(["--encoders"] if encoders else [])])
    if given and (calib_cache or calib_text or calib_synthetic):  # before anything is downloaded
        raise click.UsageError(f"{given} encode calibration images, and {_given_calibration(calib_cache, calib_text)} "
                               "encodes none; leave them out.")

    def on_device(candidate) -> None:  # before a Hub ID's weights are downloaded
        opts.device = choose_device(device, candidate,
                                    lambda skeleton: compile_flops(candidate, skeleton, opts, calib_resolution))

    with removed_if_failed(out, state_folder(out)):  # a failed compile leaves no empty folder it created
        source = open_source(model, list(blocks) or None, revision, check=on_device, model_class=model_class)
        _compile_line(f"compiling {source.description} on {describe(opts.device)}")
        check_budget(source, opts)  # before the encoders run
        _check_source(source, opts.previous)  # before the encoders run
        trains = source.family_adapter is not None and source.family_adapter.recipe is not None
        if not (calib_cache or calib_text or calib_synthetic) and trains and not is_text_model(source.skeleton()):
            from ..compiler.calibration_images import calibration_images

            where = None
            if encoders or files:
                where = encoder_source_for(source.encoder_source or source.description, source.family,
                                           source.skeleton().config, model=encoders, files=files)
                opts.encoders = pinned(where).record()  # train and sample find the same encoders
            with memory_cap(opts.vram_budget, opts.device):  # the encoders run on the GPU too
                opts.calib_images = calibration_images(source, data=calib_data, encoders=where, device=opts.device,
                                                       resolution=_fitting_resolution(source, calib_resolution),
                                                       limit=calib_samples or DEFAULT_IMAGE_SAMPLES, seed=opts.seed,
                                                       echo=_compile_line, vram_budget=opts.vram_budget,
                                                       host_budget=opts.host_budget)
        elif calib_data:
            raise click.UsageError(f"--calib-data is for the diffusion families; {model} is calibrated on text, so "
                                   "pass --calib-text FILE instead.")
        elif given:
            raise click.UsageError(f"{given} encode calibration images, and {model} is calibrated on text; leave them "
                                   "out.")
        manifest = compile_slab(source, out, opts, progress=_compile_line, bar=sys.stderr.isatty())
    _say_written(out, manifest, opts.budget)


def _check_source(source, previous: str | None) -> None:
    """What is refused of the source before the encoders run or anything is calibrated: a --from slab of another
    model or with a damaged build number, and NaN/Inf weights (a pass over the source, one block at a time)."""
    from ..compiler.previous import check_previous

    check_previous(previous, source)
    source.check_finite(_compile_line)


def _fitting_resolution(source, asked: int) -> int:
    """The calibration side: ``asked``, or where the model's positional embedding takes less (SD3's
    ``pos_embed_max_size`` patches of 8x VAE pixels), the largest side it takes, said in a line; given as
    ``--calib-resolution`` and too large, refused in one sentence naming that side."""
    config = source.skeleton().config
    patches = config.get("pos_embed_max_size")
    if not patches:
        return asked
    largest = int(patches) * int(config.get("patch_size", 1)) * 8  # the family's VAE: 8 pixels a latent
    if asked <= largest:
        return asked
    if click.get_current_context().get_parameter_source("calib_resolution") is not ParameterSource.DEFAULT:
        raise click.UsageError(f"--calib-resolution {asked} is more than {source.description} takes: its positional "
                               f"embedding covers {largest} px ({patches} patches of {config.get('patch_size', 1)} "
                               f"latents of 8 pixels); give --calib-resolution {largest} or less.")
    _compile_line(f"calibrating at {largest} px, not {asked}: {source.description}'s positional embedding covers "
                  f"{largest} px (pos_embed_max_size {patches})")
    return largest


def _say_written(out: Path, manifest, budget: int) -> None:
    """The last line: the slab's size against the budget, its layers by format, and where to read the reasons."""
    counts = {}
    for layer in manifest.layers:
        counts[layer.spec.short_label] = counts.get(layer.spec.short_label, 0) + 1
    size = sum(p.stat().st_size for p in out.iterdir())
    click.echo(f"wrote {out}: {size:,} bytes (budget {budget:,}); layers: "
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

