"""Drawing edits of control images (a prompt's ``--ci``, ``squareq sample --control``): FLUX.1 Kontext through
``FluxKontextPipeline`` on the FLUX.1 pipeline's components; FLUX.2's reference images through its one pipeline;
Qwen-Image-Edit through its folder's own edit pipeline
(``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``), whose prompts without control images the family's
text-to-image pipeline draws on the same components. What cannot be drawn is said as a sentence, which
train/sample.py raises."""
from __future__ import annotations

from ..models import ADAPTERS
from ..sources.encoder_source import EncoderError, EncoderSource
from ..sources.pipeline_encoders import pipeline_class, plain_pipeline
from .controls import edit_families, folder_edits
from .data import rgb_image
from .prompt_options import SamplePrompt


def edit_pipeline(pipe):
    """diffusers' ``FluxKontextPipeline`` on the components of the FLUX pipeline ``pipe`` (Kontext is FLUX.1's
    transformer class; its pipeline encodes the control image and appends its tokens to the image's)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**pipe.components)


def edit_inputs(prompt: SamplePrompt) -> dict:
    """FluxKontextPipeline's inputs for ``prompt``'s control image: the image upright over white (the pipeline brings
    it to the nearest of its PREFERRED_KONTEXT_RESOLUTIONS, as in inference), and ``max_area`` such that the image
    drawn keeps the prompt's width and height (the pipeline fits them to that area)."""
    return {"image": rgb_image(prompt.controls[0]), "max_area": prompt.width * prompt.height}


def prompt_pipeline(pipe, family: str, prompt: SamplePrompt) -> tuple[object, dict]:
    """The pipeline of ``family``'s folder (``pipe``) that draws ``prompt``, and its inputs for the prompt's control
    images: an edit pipeline with them upright over white (it sizes them itself, for its VAE and its text encoder),
    as a list where it takes several (Edit-Plus); without control images, the family's text-to-image pipeline on the
    same components (train/sample.py :func:`check_edit_prompts` refused the others)."""
    recipe = ADAPTERS[family].recipe
    folder = recipe.pipeline if recipe is not None else None
    if folder is None or not folder.edits:  # FLUX.2: its one pipeline takes its reference images, as a list in order
        return pipe, {"image": [rgb_image(c) for c in prompt.controls]} if prompt.controls else {}
    if not prompt.controls:
        return plain_pipeline(pipe, folder), {}
    images = [rgb_image(c) for c in prompt.controls]
    return pipe, {"image": images if folder.edits[type(pipe).__name__].controls > 1 else images[0]}


def controls_problem(family: str, settled: list[SamplePrompt]) -> str | None:
    """Why control images (``--ci``, ``--control``) cannot be drawn by ``family``: it draws no edits, a prompt gives
    more than it takes, or its edit pipeline would refuse one mid-drawing (FLUX.2's: a side under 64, an aspect over
    8); None when they can (or there are none)."""
    recipe = getattr(ADAPTERS.get(family), "recipe", None)
    limit = recipe.controls if recipe is not None else 0
    edited = next((p for p in settled if len(p.controls) > limit), None)
    if edited is not None and not limit:
        return (f"--ci/--control {edited.controls[0]}: this slab holds a {family} model, which draws no edits of a "
                f"control image ({', '.join(edit_families())} do); drop the control image.")
    if edited is not None:
        return (f"--ci/--control: the prompt {edited.text[:40]!r} gives {len(edited.controls)} control images, and "
                f"{recipe.edit_name} takes {limit}; give {'one' if limit == 1 else f'at most {limit}'}.")
    check = recipe.control_problem if recipe is not None else None
    for path in dict.fromkeys(c for p in settled for c in p.controls) if check is not None else ():
        problem = check(rgb_image(path))
        if problem:
            return f"--ci/--control {path}: {problem}; give a larger image, or one nearer square."
    return None


def edit_folder_problem(family: str, encoders: EncoderSource, settled: list[SamplePrompt]) -> str | None:
    """Why the pipeline folder of ``encoders`` cannot draw the control images of ``settled`` for a family whose edit
    pipelines are their own folders' (Qwen-Image-Edit): it holds no edit pipeline, or one that takes fewer; None
    when it can."""
    edits = folder_edits(family)
    edited = [p for p in settled if p.controls]
    if not edits or not edited:
        return None
    try:
        found = pipeline_class(encoders)
    except EncoderError as exc:
        return f"--model: {exc}"
    if found is None:  # a built-in model: check_family says it has no pipeline to draw with
        return None
    edit = edits.get(found)
    where = EncoderSource.of(encoders).where
    if edit is None:
        return (f"--ci/--control {edited[0].controls[0]}: {where} holds a {found}, which draws no edits of a control "
                f"image; pass a {' or '.join(edits)} folder or Hub ID with --model.")
    many = next((p for p in edited if len(p.controls) > edit.controls), None)
    if many is not None:
        return (f"--ci/--control: the prompt {many.text[:40]!r} gives {len(many.controls)} control images, and "
                f"{where}'s {found} takes {edit.controls}; give {edit.controls}.")
    return None
