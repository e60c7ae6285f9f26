"""`squareq accept`: the gates a slab passes before anyone trains on it, their report (table, JSON, JUnit) and the
exit status that says the verdict."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..sizes import parse_size
from .options import REVISION, device_option, encoder_file_options, given_files, removed_if_failed, shared_option


@click.command()
@click.argument("slab", type=click.Path(path_type=Path))
@shared_option("model", required=True, help="The source the slab was compiled from: a Hugging Face Hub ID, a "
               "diffusers folder, a BFL FLUX.1 file or tiny-flux (the bf16 reference for every gate).")
@REVISION
@encoder_file_options
@click.option("--thresholds", "thresholds_file", type=click.Path(path_type=Path),
              help="The compiler's TOML file; [thresholds] mse, drift, psnr, ssim, grad_cos, grad_norm and conv "
              "apply here (docs/accept.md).")
@click.option("--budget", help="Largest slab size, e.g. 12GB (default: the budget the compile recorded).")
@shared_option("vram_budget", "Largest peak reserved GPU memory of the training steps, e.g. 12GB.")
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
@shared_option("compute", "The slab's base-layer arithmetic in the gradient, image-drift and convergence gates, as "
               "squareq train and sample run it (auto: FP8 on GPUs with FP8 tensor cores, see docs/tuning.md); the "
               "bf16 references run in bf16.")
@device_option("every gate runs", "on a CPU, auto refuses a model over 1B parameters and says how long it "
                "would take")
def accept(slab, model, revision, clip_l, clip_g, t5, vae, thresholds_file, budget, vram_budget, steps, data,
           train_config, resolution, max_sequence_length, lr, rank, samples, images, sample_steps, clip_model, workdir,
           report, junit, require_gpu, compute, device) -> None:
    """Gate SLAB before anyone trains on it: layer MSE and block drift on fresh inputs, image drift and LoRA
    gradient agreement against the bf16 source, convergence decided by paired tests, peak VRAM and size. Exit
    status 0 when every gate passes, 3 when one fails, 4 when none fails but one cannot decide (INCONCLUSIVE),
    1 when it cannot run."""
    from ..acceptance import AcceptOptions
    from ..acceptance import accept as run_accept
    from ..acceptance.convergence import ConvergenceSettings
    from ..compiler import Thresholds

    for flag, path in (("--report", report), ("--junit", junit)):
        if path is not None and not Path(path).parent.is_dir():
            raise click.BadParameter(f"the folder {Path(path).parent} does not exist; create it or write the report "
                                     "elsewhere.", param_hint=flag)
    builtin = data is None and train_config is None  # the built-in 64 px images and short captions
    opts = AcceptOptions(
        slab=slab, model=model, revision=revision, files=given_files(clip_l, clip_g, t5, vae), device=device,
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
    with removed_if_failed(workdir or Path(f"{slab}.accept")):  # a failed run leaves no empty workdir it created
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
