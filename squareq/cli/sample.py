"""`squareq sample` and `squareq export-lora`: images drawn from the streamed slab (optionally with a LoRA), and a
LoRA rewritten in the other file layout."""
from __future__ import annotations

from pathlib import Path

import click

from ..sizes import parse_size
from ..slab.atomic import os_error_sentence
from ..train.prompt_options import PromptError
from ..train.sample import SampleError
from .options import REVISION, encoder_file_options, given_files, removed_if_failed, shared_option


@click.command()
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
@shared_option("model")
@REVISION
@encoder_file_options
@click.option("--prior", help="Würstchen: the prior's pipeline folder or Hub ID (warp-ai/wuerstchen-prior), run whole "
              "beside a decoder slab; an image needs both stages.")
@click.option("--decoder", help="Würstchen: the decoder's pipeline folder or Hub ID (warp-ai/wuerstchen), run whole "
              "beside a prior slab.")
@click.option("--control", "controls", multiple=True, type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="A control image to edit (FLUX.1 Kontext, Qwen-Image-Edit; repeat the flag for Edit-Plus's "
              "several), or a reference image (FLUX.2; repeat the flag for several, in order); a prompt's --ci sets "
              "its own. Sized as the family's pipeline sizes it.")
@click.option("--resolution", type=int, default=1024, show_default=True)
@click.option("--steps", type=int, default=20, show_default=True, help="Denoising steps.")
@click.option("--guidance", type=float, default=3.5, show_default=True, help="Guidance scale, 0 to 100.")
@shared_option("seed", "Seed of the images' noise.")
@shared_option("max_sequence_length", "Text-encoder tokens per prompt.")
@shared_option("prefetch", "Block slots on the GPU: a number, or auto (start at 3; after the second step, or with "
               "--cuda-graphs the first that replays them, add slots while a step simulated from the measured copies "
               "and compute gets faster, as free VRAM allows, at most 8).")
@shared_option("resident_blocks", "Blocks kept on the GPU after the measured step, those whose copy outweighs their "
               "compute first: a number, or auto (as many as free VRAM allows while copies are not hidden).")
@shared_option("vram_budget", "GPU memory the denoising steps may reserve, e.g. 3GB: bounds the slots --prefetch "
               "auto adds and the blocks --resident-blocks keeps (default: what the device has free, less a margin). "
               "What is on the GPU when they are planned (the denoiser, Würstchen's other stage) counts; FLUX.1's "
               "text encoders, which run before, and the VAE's decode after, do not.")
@shared_option("host", "Where block blobs wait: auto (pinned when they fit within --host-budget beside the text "
               "encoders, else disk), pinned (RAM), shared (one RAM copy per host, in /dev/shm) or disk (read from "
               "the slab file).")
@shared_option("host_budget", "Host memory (RAM) this command may hold, e.g. 16GB, or auto: what the machine has "
               "available, less 10% or 2 GB. The slab and the text encoders are held at once: pinned where they fit, "
               "else read from their files through a few page-locked blocks; a run that cannot fit is refused before "
               "any work, naming the budget that would.")
@shared_option("compute")
@shared_option("dtype", "The activations' 16-bit type: auto (fp16 on GPUs without bf16: T4, V100, RTX 20xx; bf16 "
               "elsewhere), bf16 or fp16.")
@click.option("--frames", type=int, default=1, show_default=True,
              help="Frames of a video family's clip (Wan, HunyuanVideo, LTX-Video), saved as an animated WebP; a "
                   "prompt's --f sets its own.")
@shared_option("cuda_graphs", "Replay each block's forward from a CUDA graph once the first denoising steps have "
               "captured it (CUDA only; docs/tuning.md says when it pays): on, or auto and off, which leave it off "
               "when sampling; a bare --cuda-graphs is on (after SLAB; right before it, write --cuda-graphs on).")
@shared_option("compile", "Run each block's forward under torch.compile: on, off, or auto (off: a sampling run "
               "measured slower with its compile counted; docs/tuning.md).")
@shared_option("attention")
def sample(slab, prompts, prompt_file, lora, out, model, revision, clip_l, clip_g, t5, vae, prior, decoder, controls,
           resolution, steps, guidance, seed, max_sequence_length, prefetch, resident_blocks, vram_budget, host,
           host_budget, compute, dtype, frames, cuda_graphs, compile, attention):
    """Generate images with the streamed slab, optionally with a LoRA: FLUX.1 through SquareQ's sampler, other
    families through their diffusers pipeline folder (--model)."""
    from ..train.prompt_options import read_prompt_file

    try:
        prompts = list(prompts) + (read_prompt_file(prompt_file) if prompt_file else [])
    except PromptError as exc:
        raise SampleError(f"--prompt-file: {exc}") from None
    if not prompts:
        raise SampleError("squareq sample needs something to draw: give --prompt TEXT (repeat for several) or "
                          "--prompt-file FILE.")
    from ..slab.atomic import ensure_output_dir
    from ..train.sample import check_sample_options

    check_sample_options(resolution, steps, guidance, max_sequence_length)
    limit = parse_size(vram_budget, "--vram-budget") if vram_budget else None
    with removed_if_failed(out):
        ensure_output_dir(out, "-o/--out")  # before any drawing, whose images would otherwise be lost
        _draw(slab, prompts, out, given_files(clip_l, clip_g, t5, vae), lora=lora, model=model, resolution=resolution,
              steps=steps, guidance=guidance, seed=seed, max_sequence_length=max_sequence_length, prefetch=prefetch,
              host=host, resident_blocks=resident_blocks, compute=compute, cuda_graphs=cuda_graphs == "on",
              revision=revision, compile=compile, attention=attention, dtype=dtype, frames=frames, vram_budget=limit,
              host_budget=host_budget, stages={"prior": prior, "decoder": decoder},
              controls=tuple(str(c) for c in controls))


def _draw(slab, prompts: list[str], out: Path, files: dict[str, str], **settings) -> None:
    """Draw ``prompts`` with ``settings`` (sample_images' keywords), each image saved in ``out`` as it comes."""
    from ..plot import write_sample
    from ..train.sample import sample_images

    def save(i: int, image) -> None:
        stem = out / f"sample-{i:03d}"
        try:
            path = write_sample(image, stem)  # a video's frames: an animated WebP
        except OSError as exc:
            raise SampleError(os_error_sentence(exc, f"saving {stem}", "draw the remaining prompts again")) from None
        click.echo(f"wrote {path}")

    sample_images(slab, list(prompts), on_image=save, files=files, echo=lambda line: click.echo(line, err=True),
                  **settings)


@click.command("export-lora")
@click.argument("lora", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True,
              help="kohya: a .safetensors file; diffusers: a folder for pytorch_lora_weights.safetensors.")
@click.option("--format", "fmt", type=click.Choice(["kohya", "diffusers"]), default="kohya", show_default=True,
              help="kohya: the family's kohya/ComfyUI layout (LyCORIS's for a LoKr or LoHa folder); diffusers: "
              "diffusers/PEFT's.")
def export_lora(lora: Path, out: Path, fmt: str) -> None:
    """Write a LoRA in another layout (kohya/ComfyUI or diffusers/PEFT).

    kohya writes the family's kohya/ComfyUI layout, and a LoKr or LoHa run's PEFT folder in LyCORIS's."""
    from ..runtime import LoraVariant
    from ..train.lora_files import PEFT_WEIGHTS, WEIGHT_NAME, is_peft_adapter, save_diffusers_lora, save_kohya_lora
    from ..train.lora_reader import load_exported

    source = lora / (PEFT_WEIGHTS if is_peft_adapter(lora) else WEIGHT_NAME) if lora.is_dir() else lora
    target = out if fmt == "kohya" else out / WEIGHT_NAME
    if source.exists() and target.exists() and source.resolve() == target.resolve():
        raise click.UsageError(f"-o {out} would overwrite the LoRA being exported ({source}); write the {fmt} layout "
                               "to another path.")
    from ..slab.atomic import remove_debris

    for debris in remove_debris(target):  # an export killed mid-write (its cleanup never ran) left its temporary
        click.echo(f"removed {debris}, left by an export that was killed while writing it")
    factors, info = load_exported(lora, fmt)
    save = save_kohya_lora if fmt == "kohya" else save_diffusers_lora
    provenance = {k: v for k, v in info["metadata"].items() if k in ("family", "base_model_signature", "base_config")}
    extra = ({"prefix": info["component"], "variant": LoraVariant(dora=info["use_dora"])} if fmt == "diffusers"
             else {"config": provenance.get("base_config")})
    path = save(factors, out, info["rank"], info["alpha"], info["targets"], extra_metadata=provenance,
                header=info["header"], **extra)
    kind = f"{info['layout']} " if info["layout"] in ("lokr", "loha") else ""
    click.echo(f"wrote {path} ({fmt} layout, {kind}rank {info['rank']}, alpha {info['alpha']:g})")
