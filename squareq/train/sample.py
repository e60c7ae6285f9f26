"""``squareq sample``: images from the streamed slab (optionally with a LoRA), through the family's pipeline.

The transformer is the runtime model (blocks streamed forward only, under ``no_grad``); the VAE, text
encoders and scheduler come from the slab's recorded source or ``--model``, as for caching. FLUX.1 prompts are
encoded first and its text encoders let go before denoising; the other families run their own diffusers pipeline
whole (its ``encode_prompt``, CFG and decoding as diffusers does them).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .. import runtime
from ..devices import default_device
from ..models import ADAPTERS, BUILTIN_MODELS
from ..progress import Echo, Progress
from ..runtime import autocast_dtype
from ..runtime.block_compile import CompileModeError, resolve_compile
from ..runtime.compute import ComputeError, resolve_dtype
from ..runtime.residency import StreamTuner
from ..sizes import SizeError
from ..slab import open_slab
from ..sources.encoder_placement import EncoderRun
from ..sources.encoder_source import (
    EncoderError,
    EncoderSource,
    pipeline_folder,
    slab_encoders,
    whole_pipeline_folder,
)
from ..sources.encoders import encoder_dtype, open_decoder, open_encoders
from ..sources.pipeline_encoders import open_family_pipeline
from ..sources.vae_memory import can_tile
from ..third_party import pipeline_bars
from .clips import TEMPORAL_STRIDE
from .edit_sample import controls_problem, edit_folder_problem, edit_inputs, edit_pipeline, prompt_pipeline
from .errors import TrainError
from .host_plan import plan_host_memory
from .lora_attach import attach_lora, attach_peft_adapter
from .lora_files import is_peft_adapter
from .lora_reader import load_lora
from .prompt_options import MAX_FRAMES, MAX_GUIDANCE, MAX_SIDE, MAX_STEPS, PromptError, SamplePrompt, parse_prompt
from .wuerstchen_sample import (
    HUB_IDS,
    SIDE_MULTIPLE,
    STAGES,
    draw_stages,
    open_stages,
    other_stage,
    stage_parameters,
)

log = logging.getLogger("squareq.sample")

# ring slots that hide a forward-only pass's copies of FLUX.1-dev at 1024² on an H100 (two do not: docs/benchmarks.md);
# `squareq sample --prefetch auto` starts there, the trainer's sample images use at least as many
FORWARD_SLOTS = 3


class SampleError(ValueError):
    """The slab's family cannot be sampled yet; the message says which can."""


class SampleProgress:
    """The images a run draws, as one bar over their denoising steps titled ``desc``, with its ETA, drawn on a
    terminal or when ``shown`` (squareq/progress.py; ``leave``: the finished bar stays); elsewhere a line for ``echo``
    as each image is done. The bar starts with the first drawing, after the models loaded, so its ETA is the
    drawing's."""

    def __init__(self, desc: str = "sample", shown: bool | None = None, echo: Echo | None = None,
                 leave: bool = True) -> None:
        self.desc, self.shown, self.echo, self.leave = desc, shown, echo, leave
        self.bar: Progress | None = None
        self.ends: list[int] = []  # the steps done once each image is done

    @contextlib.contextmanager
    def drawing(self, settled: list[SamplePrompt]) -> Iterator[SampleProgress]:
        self.ends = list(itertools.accumulate(p.steps for p in settled))
        with Progress(self.ends[-1] if self.ends else 0, self.desc, "step", shown=self.shown, leave=self.leave) as bar:
            self.bar = bar
            try:
                yield self
            finally:
                self.bar = None

    def after_step(self, then=None):
        """A ``callback_on_step_end`` that runs ``then`` (the tuner's) and counts the step."""
        def step_end(pipe, step: int, timestep, kwargs: dict) -> dict:
            out = then(pipe, step, timestep, kwargs) if then is not None else kwargs
            if self.bar is not None:
                self.bar.advance()
            return out

        return step_end

    def image_done(self, i: int, image, on_image: Callable[[int, object], None] | None = None) -> None:
        """Image ``i`` is drawn: the bar at its last step (a pipeline that ran fewer callbacks), its line in a log,
        and ``on_image`` (which may print: above the bar)."""
        bar = self.bar
        if bar is not None:
            if bar.n < self.ends[i]:
                bar.advance(self.ends[i] - bar.n)
            if not bar.shown and self.echo is not None:
                self.echo(f"{self.desc}: image {i + 1}/{len(self.ends)} drawn, ETA {bar.eta()}")
        if on_image is not None:
            with bar.writing() if bar is not None else contextlib.nullcontext():
                on_image(i, image)


class _FiniteLatents:
    """diffusers' ``callback_on_step_end`` that stops a drawing whose latents turned NaN/Inf (a damaged LoRA, a NaN
    guidance): its image would be saved all black. ``then``: another callback to run after the check."""

    def __init__(self, prompt: str, then=None) -> None:
        self.prompt, self.then = prompt, then

    def __call__(self, pipe, step: int, timestep, kwargs: dict) -> dict:
        latents = kwargs.get("latents")
        if latents is not None and not bool(torch.isfinite(latents).all()):
            raise SampleError(f"denoising step {step + 1} for the prompt {self.prompt[:40]!r} produced NaN or Inf, so "
                              "its image (it would be black) is not saved; check the LoRA (--lora) and --guidance.")
        # the tuner's callback first: it asks the graphs whether this step settled them (StreamTuner.after_step)
        out = self.then(pipe, step, timestep, kwargs) if self.then is not None else kwargs
        _end_graph_step(_denoiser(pipe))
        return out


def _denoiser(pipe):
    """A diffusers pipeline's denoiser: its transformer, its UNet (SD 1.5, SDXL), or Würstchen's prior or decoder."""
    return next((m for m in (getattr(pipe, a, None) for a in ("transformer", "unet", "prior", "decoder"))
                 if isinstance(m, torch.nn.Module)), None)


def _end_graph_step(transformer) -> None:
    """A denoising step is a step for the runtime's CUDA graphs (BlockGraphs.end_step): what their warm-up and captures
    left in the caching allocator goes back."""
    try:
        graphs = runtime.runtime_of(transformer).graphs
    except ValueError:  # not a runtime model
        return
    if graphs is not None:
        graphs.end_step()


def check_sample_options(resolution: int, steps: int, guidance: float, max_sequence_length: int,
                         frames: int = 1) -> None:
    """Refuse (:class:`SampleError`, naming the flag) values a FLUX pipeline would crash on or silently replace; the
    bounds are those a prompt's own options have (train/prompt_options.py)."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(resolution) or resolution < 16 or resolution % 16 or resolution > MAX_SIDE:
        raise SampleError(f"--resolution {resolution} must be a multiple of 16 from 16 to {MAX_SIDE} (FLUX packs 2x2 "
                          "patches of an 8x VAE), e.g. 512 or 1024.")
    if not whole(steps) or not 1 <= steps <= MAX_STEPS:
        raise SampleError(f"--steps {steps} must be a whole number from 1 to {MAX_STEPS}, e.g. 20.")
    if not isinstance(guidance, (int, float)) or not math.isfinite(guidance) or not 0 <= guidance <= MAX_GUIDANCE:
        raise SampleError(f"--guidance {guidance} must be a number from 0 to {MAX_GUIDANCE:g}, e.g. 3.5 (FLUX.1-dev's "
                          "usual).")
    if not whole(max_sequence_length) or max_sequence_length < 1:
        raise SampleError(f"--max-sequence-length {max_sequence_length} must be a whole number of at least 1.")
    if not whole(frames) or not 1 <= frames <= MAX_FRAMES:
        raise SampleError(f"--frames {frames} must be a whole number from 1 to {MAX_FRAMES}, e.g. 81 for Wan.")


def draw_image(pipe, prompt: SamplePrompt, max_sequence_length: int, device: torch.device, on_step_end=None,
               embeds: dict[str, torch.Tensor] | None = None, negative: dict[str, torch.Tensor] | None = None):
    """One image of ``prompt`` (settled: train/prompt_options.py) from a FLUX pipeline whose transformer is a
    runtime model (autocast to its type, no gradients); ``on_step_end``: diffusers' ``callback_on_step_end`` (a
    StreamTuner's). ``embeds`` / ``negative``: the prompt's and its negative prompt's cached ``prompt_embeds`` and
    ``pooled_prompt_embeds`` (cache entries), for a pipeline without text encoders. :class:`SampleError` if the
    latents turn NaN/Inf."""
    text = {"prompt": prompt.text}
    if prompt.uses_negative:  # true CFG: the transformer runs for the negative prompt too
        text.update(negative_prompt=prompt.negative, true_cfg_scale=prompt.cfg_scale)
    if embeds is not None:
        dtype = pipe.vae.dtype  # the encoders' dtype when the entry was computed: the same values come back
        text = {"prompt": None, **{k: embeds[k][None].to(device, dtype) for k in
                                   ("prompt_embeds", "pooled_prompt_embeds")}}
        if prompt.uses_negative:
            text.update(negative_prompt_embeds=negative["prompt_embeds"][None].to(device, dtype),
                        negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"][None].to(device, dtype),
                        true_cfg_scale=prompt.cfg_scale)
    if prompt.controls:  # an edit of the control image: FLUX.1 Kontext (train/edit_sample.py)
        pipe, text = edit_pipeline(pipe), {**text, **edit_inputs(prompt)}
    pipeline_bars(pipe)  # SquareQ's own bar counts the steps (SampleProgress)
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype(pipe.transformer)):
        return pipe(**text, height=prompt.height, width=prompt.width, num_inference_steps=prompt.steps,
                    guidance_scale=prompt.guidance, max_sequence_length=max_sequence_length,
                    callback_on_step_end=_FiniteLatents(prompt.text, on_step_end),
                    generator=torch.Generator(device).manual_seed(prompt.seed)).images[0]


def draw_with_pipeline(pipe, prompt: SamplePrompt, max_sequence_length: int, device: torch.device, on_step_end=None,
                       inputs: dict | None = None):
    """One image of ``prompt`` (settled) from a family's own diffusers pipeline whose denoiser is a runtime model and
    whose text encoders encode the prompt: ``--g`` is its ``guidance_scale`` (CFG for SD 1.5/SDXL/SD3/Wan, the
    embedded guidance for the distilled families), a video family draws one frame; ``inputs``: more of the call's
    arguments (an edit pipeline's control images: train/edit_sample.py). :class:`SampleError` if the latents turn
    NaN/Inf."""
    params = inspect.signature(pipe.__call__).parameters
    kwargs = dict(prompt=prompt.text, height=prompt.height, width=prompt.width, num_inference_steps=prompt.steps,
                  guidance_scale=prompt.guidance, generator=torch.Generator(device).manual_seed(prompt.seed),
                  **(inputs or {}))
    optional = {"max_sequence_length": max_sequence_length, "num_frames": prompt.frames or 1, "output_type": "pil",
                "negative_prompt": prompt.negative or None,
                "true_cfg_scale": prompt.cfg_scale if prompt.uses_negative else None,  # Qwen-Image's, as FLUX.1's
                "callback_on_step_end": _FiniteLatents(prompt.text, on_step_end)}
    kwargs.update({k: v for k, v in optional.items() if k in params and v is not None})
    pipeline_bars(pipe)  # SquareQ's own bar counts the steps (SampleProgress)
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype(_denoiser(pipe))):
        out = pipe(**kwargs)
    frames = getattr(out, "frames", None)
    if frames is None:
        return out.images[0]
    return list(frames[0]) if (prompt.frames or 1) > 1 else frames[0][0]


def sampling_attention(mode: str) -> tuple[str, str]:
    """The attention preference for a sampling run, and why: ``auto`` keeps torch's order, since cuDNN's first calls
    cost more than a run earns back; ``cudnn`` and ``default`` as asked."""
    if mode != "auto":
        return mode, "asked for"
    return "default", ("torch's order: a sampling run measured slower with cuDNN's attention first, its first step "
                       "counted (FLUX.1 at 1024², 28 steps: 0.437 s against 0.232 s a step, though its steady step was "
                       "0.144 s against 0.158 s; docs/benchmarks.md); --attention cudnn prefers it anyway")


def sample_images(slab: str | Path, prompts: list[str], lora: str | Path | None = None,
                  model: EncoderSource | str | None = None, resolution: int = 1024, steps: int = 20,
                  guidance: float = 3.5, seed: int = 42, max_sequence_length: int = 512,
                  prefetch: int | str = "auto", host: str = "auto", device=None, resident_blocks: int | str = 0,
                  on_image: Callable[[int, object], None] | None = None, compute: str = "auto",
                  cuda_graphs: bool = False, revision: str | None = None,
                  files: dict[str, str | None] | None = None, compile: str = "auto", attention: str = "auto",
                  dtype: str = "auto", frames: int = 1, vram_budget: int | None = None,
                  stages: dict[str, str | None] | None = None, progress: bool | None = None,
                  echo: Echo | None = None, label: str = "sample", host_budget: str | int | None = "auto",
                  controls: tuple[str, ...] = ()):
    """One PIL image per prompt (a clip's list of frames for a video family's prompt with frames), each from ``seed``
    (so a prompt gives the same image with and without a LoRA, but for the LoRA's effect). prefetch "auto" starts
    the ring at :data:`FORWARD_SLOTS` slots and grows it
    after the second step if the copies were not hidden; resident_blocks ("auto" or a count) keeps blocks on the
    GPU from then on (runtime/residency.py). ``on_image(i, image)`` is called as each image is drawn (the CLI saves
    it then, so a failure later keeps what was drawn). ``compute``: the base layers' arithmetic (runtime/compute.py).
    ``cuda_graphs``: replay each block's forward from a CUDA graph once it is captured (runtime/block_graphs.py).
    ``compile``: each block's forward under torch.compile, auto, on or off (runtime/block_compile.py; auto is off).
    ``attention``: which attention kernels the blocks prefer, auto, cudnn or default (runtime/attention_choice.py;
    auto keeps torch's order here: :func:`sampling_attention`). ``dtype``: bf16, fp16 or auto (fp16 on GPUs without
    bf16; the text encoders and VAE then run in fp32; runtime/compute.py). ``frames``: a video family's clip length
    (a prompt's ``--f`` sets its own); a clip comes back as its list of frames, an image as itself. ``vram_budget``
    (bytes): bounds the ring slots and kept blocks the tuner adds, so that the reserved GPU memory stays within it
    (runtime/residency.py ``peak_limit``; default: what the device has free, less a margin). ``stages``:
    Würstchen's other stage's pipeline folder or Hub ID, ``{"prior": ...}`` beside a decoder slab or
    ``{"decoder": ...}`` beside a prior slab. ``progress``, ``echo``, ``label``: the drawing's bar titled ``label``
    (:class:`SampleProgress`; on a terminal when ``progress`` is None), else its lines for ``echo``.
    ``model`` (at ``revision``) and the single ``files`` choose the VAE and text encoders (default: what the slab
    records). FLUX.1 is drawn by SquareQ's own path; the families whose adapter has ``pipeline_samples`` by their own
    diffusers pipeline folder (:func:`draw_with_pipeline`), which ``model`` or the slab's source must be.
    ``controls``: the control images to edit (FLUX.1 Kontext, Qwen-Image-Edit) for each prompt without its own
    ``--ci``."""
    check_sample_options(resolution, steps, guidance, max_sequence_length, frames)
    try:  # before the slab is hashed; the family's rule on --n once it is open
        [parse_prompt(p, true_cfg_only=False) for p in prompts]
    except PromptError as exc:
        raise SampleError(f"--prompt: {exc}") from None
    device = default_device(device)
    s = open_slab(slab, verify="eager")
    family = s.manifest.model.family
    settled = _settled(prompts, family, resolution, steps, guidance, seed, frames, tuple(controls))
    encoders = slab_encoders(s.manifest.model, model, revision, files)
    draw = _drawer(slab, family, encoders, stages or {})
    check_edit_prompts(family, encoders, settled)
    plan = _host_plan(s, device, host_budget, host, dtype, max_sequence_length, encoders, family)
    host = plan.slab_host
    start = FORWARD_SLOTS if prefetch == "auto" else prefetch
    if cuda_graphs and device.type != "cuda":
        raise SampleError(f"--cuda-graphs needs a CUDA GPU and this run samples on {device}; leave it off.")
    try:
        compile_blocks, why = resolve_compile(compile, device, training=False)
    except CompileModeError as exc:
        raise SampleError(f"--compile: {exc}") from None
    log.info("compile %s: %s (%s).", compile, "on" if compile_blocks else "off", why)
    attention, why = sampling_attention(attention)
    log.info("attention: %s (%s).", attention, why)
    try:
        dtype, why = resolve_dtype(dtype, device)
        log.info("dtype: %s (%s).", dtype, why)
        transformer = runtime.load(s, device, options=runtime.LoadOptions(
            prefetch=start, host=host, verify="off", compute=compute, cuda_graphs=cuda_graphs,
            compile_blocks=compile_blocks, attention=attention, dtype=dtype))
    except ComputeError as exc:
        raise SampleError(f"--compute {compute} --dtype {dtype}: {exc}") from None
    _check_vram_budget(vram_budget, device, prefetch, resident_blocks)
    tuner = None
    if prefetch == "auto" or resident_blocks:  # probed once the blocks replay their graphs, if they have any
        tuner = StreamTuner(transformer, prefetch=prefetch, resident=resident_blocks, forward_only=True,
                            peak_limit=vram_budget)
    if lora is not None and is_peft_adapter(lora):  # a LoKr or LoHa folder (lora_type lokr/loha)
        attach_peft_adapter(transformer, lora)
    elif lora is not None:
        attach_lora(transformer, *load_lora(lora))
    try:
        return draw(encoders, family, transformer, settled, max_sequence_length, device, tuner, on_image,
                    progress=SampleProgress(label, progress, echo), encoder_host=plan.encoder_budget)
    finally:
        runtime.runtime_of(transformer).close()


def _settled(prompts: list[str], family: str, *settings) -> list[SamplePrompt]:
    """``prompts`` with the command's ``settings`` (SamplePrompt.settled's) where they give none, refused
    (:class:`SampleError`) where ``family`` cannot draw them."""
    try:
        settled = [parse_prompt(p, negative_needs_true_cfg(family)).settled(*settings) for p in prompts]
    except PromptError as exc:
        raise SampleError(f"--prompt: {exc}") from None
    check_prompts(family, settled)
    return settled


def _host_plan(s, device: torch.device, host_budget, host: str, dtype: str, max_sequence_length: int,
               encoders: EncoderSource, family: str):
    """The slab and the encoders are held at once: both within ``host_budget`` (train/host_plan.py), refused before
    any work. ``squareq -v sample`` shows the plan; the images and errors stay alone on stderr."""
    try:
        plan = plan_host_memory("sample", device, host_budget, host, dtype,
                                EncoderRun(None, max_sequence_length, 0, "the free GPU memory"),
                                [b.nbytes for b in s.manifest.blocks], encoders, family, flag="--host-budget")
    except (TrainError, SizeError) as exc:
        raise SampleError(str(exc)) from None
    log.info("%s", plan.line())
    return plan


def _check_vram_budget(vram_budget: int | None, device: torch.device, prefetch, resident_blocks) -> None:
    """Refuse --vram-budget where it bounds nothing: a run off the GPU, or one that adds no slots or blocks."""
    if vram_budget is not None and (device.type != "cuda" or (prefetch != "auto" and not resident_blocks)):
        raise SampleError(f"--vram-budget bounds the GPU slots --prefetch auto adds and the blocks --resident-blocks "
                          f"keeps, and this run {'samples on ' + str(device) if device.type != 'cuda' else 'adds none'}"
                          "; leave it out.")


def each_prompt(settled: list[SamplePrompt], tuner, on_image, draw_one,
                 progress: SampleProgress | None = None) -> list:
    """``draw_one(prompt, on_step_end)`` for each prompt, with the tuner's callback; ``on_image`` as each is drawn;
    ``progress`` counts the steps (none shown without it)."""
    progress = progress if progress is not None else SampleProgress(shown=False)
    images = []
    with progress.drawing(settled):
        for prompt in settled:
            images.append(draw_one(prompt, progress.after_step(tuner.pipeline_callback if tuner is not None else None)))
            progress.image_done(len(images) - 1, images[-1], on_image)
    return images


def _draw_flux(encoders: EncoderSource, family: str, transformer, settled: list[SamplePrompt],
               max_sequence_length: int, device: torch.device, tuner, on_image,
               progress: SampleProgress | None = None, encoder_host: int | None = None) -> list:
    """FLUX.1's images: the prompts first, within what the device has free beside the streamed transformer (its T5
    streams on a small card) and ``encoder_host`` bytes of host memory, one at a time as the pipeline would; then the
    text encoders go, and the denoiser and the VAE's decode (several GB at 1024²) have the GPU to themselves."""
    run = EncoderRun(None, max_sequence_length, 0, "the free GPU memory", host_budget=encoder_host,
                     host_flag="--host-budget")
    with open_encoders(encoders, device, family, run=run, dtype=_encoder_dtype(transformer, device)) as opened:
        entries = {t: opened.encode_prompts([t], max_sequence_length)[0] for p in settled for t in p.texts}
        dtype = opened.dtype
    pipe = open_decoder(encoders, family, dtype)
    pipe.vae.to(device)
    pipe.transformer = transformer
    try:
        return each_prompt(settled, tuner, on_image, lambda prompt, callback: draw_image(
            pipe, prompt, max_sequence_length, device, callback, embeds=entries[prompt.text],
            negative=entries.get(prompt.negative)), progress)
    finally:
        pipe.transformer = None


def check_prompts(family: str, settled: list[SamplePrompt]) -> None:
    """Refuse (:class:`SampleError`, naming the option) what ``family``'s sampler would drop or change: frames for
    an image family or a count its VAE cannot make, a negative prompt or true-CFG scale its pipeline does not take."""
    recipe = getattr(ADAPTERS.get(family), "recipe", None)
    clips = [p for p in settled if p.frames > 1]
    if clips and not (recipe is not None and recipe.frames):
        raise SampleError(f"--frames/--f {clips[0].frames}: this slab holds a {family} model, which draws images; "
                          "frames are for the video families (Wan, HunyuanVideo, LTX-Video), so leave them at 1.")
    stride = TEMPORAL_STRIDE.get(family, 1)
    odd = [p for p in clips if (p.frames - 1) % stride]
    if odd:
        k = (odd[0].frames - 1) // stride
        raise SampleError(f"--frames/--f {odd[0].frames}: a {family} clip has 1 + {stride}·k frames (its VAE packs "
                          f"{stride} frames into one); give {1 + stride * k} or {1 + stride * (k + 1)}.")
    odd = [p for p in settled if family in STAGES and (p.width % SIDE_MULTIPLE or p.height % SIDE_MULTIPLE)]
    if odd:
        raise SampleError(f"--resolution/--w/--h {odd[0].width}x{odd[0].height}: a Würstchen image's sides are "
                          f"multiples of {SIDE_MULTIPLE} (the prior's latents are 1/42.67 of a side, rounded up, and "
                          "other sides come back another size or fail in the decoder); give e.g. 512 or 1024.")
    problem = controls_problem(family, settled)
    if problem is not None:
        raise SampleError(problem)
    params = _pipeline_parameters(family)
    if params is None:  # FLUX.1's own sampler: parse_prompt's rule
        return
    for p in settled:
        if p.negative and "negative_prompt" not in params:
            raise SampleError(f"--n in the prompt {p.text[:40]!r}: the {family} pipeline takes no negative prompt, so "
                              "it would be ignored; drop --n.")
        if p.cfg_scale > 1.0 and "true_cfg_scale" not in params:
            raise SampleError(f"--l in the prompt {p.text[:40]!r}: the {family} pipeline has no true CFG scale, so it "
                              "would be ignored (its guidance, --g, is the one to set); drop --l.")


def check_edit_prompts(family: str, encoders: EncoderSource, settled: list[SamplePrompt]) -> None:
    """Refuse (:class:`SampleError`) control images the pipeline folder of ``encoders`` cannot draw (Qwen-Image's
    text-to-image folder; more than its edit pipeline takes), before anything loads."""
    problem = edit_folder_problem(family, encoders, settled)
    if problem is not None:
        raise SampleError(problem)


def _pipeline_parameters(family: str):
    """The parameters of ``family``'s diffusers pipeline call, or None where SquareQ's own sampler draws it."""
    if family in STAGES:  # the pipeline of the stage the slab holds, whose call the prompts' options set
        return stage_parameters(family)
    adapter = ADAPTERS.get(family)
    if adapter is None or adapter.samples or not adapter.pipeline_samples:
        return None
    import diffusers

    return inspect.signature(getattr(diffusers, adapter.recipe.pipeline.classes[0]).__call__).parameters


def negative_needs_true_cfg(family: str) -> bool:
    """Whether a negative prompt (``--n``) acts only through true CFG (``--l``) for ``family``: FLUX.1's own sampler,
    and a family whose pipeline has ``true_cfg_scale`` (Qwen-Image, HunyuanVideo); False where the pipeline's
    ``guidance_scale`` is classifier-free guidance and takes the negative prompt itself (:func:`check_prompts`
    refuses it where the pipeline takes none)."""
    params = _pipeline_parameters(family)
    return params is None or "true_cfg_scale" in params


def _encoder_dtype(transformer, device: torch.device) -> torch.dtype:
    """The text encoders' and VAE's type beside ``transformer`` (sources/encoders.py :func:`encoder_dtype`)."""
    return encoder_dtype(device, runtime.runtime_of(transformer).dtype)


def check_family(slab, family: str, encoders: EncoderSource) -> bool:
    """Whether ``family`` is drawn through its own diffusers pipeline (True) or SquareQ's FLUX.1 path (False);
    :class:`SampleError` naming what to pass where neither can draw it."""
    adapter = ADAPTERS.get(family)
    if adapter is not None and adapter.samples:
        return False
    if family in STAGES:  # drawn through both stages' pipelines: wuerstchen_folders says what they need
        raise SampleError(f"{slab} holds Würstchen's {STAGES[family]}, whose images need both stages' pipelines: "
                          f"squareq sample --{other_stage(family)}, or sample_prior and sample_decoder in training.")
    if adapter is None or not adapter.pipeline_samples:
        drawn = [f for f, a in ADAPTERS.items() if a.samples or a.pipeline_samples]
        raise SampleError(f"{slab} holds a {family} model; squareq sample draws {', '.join(drawn)} models only so far.")
    recipe = adapter.recipe
    try:
        folder = pipeline_folder(encoders)
    except EncoderError as exc:
        raise SampleError(f"--model: {exc}") from None
    if folder is None:
        raise SampleError(f"{slab} holds a {family} model, which squareq sample draws through its diffusers "
                          f"pipeline ({' or '.join(recipe.pipeline.classes)}); the built-in tiny model has none, "
                          "so pass the pipeline folder or Hub ID with --model.")
    return True


def draw_through_pipeline(encoders: EncoderSource, family: str, transformer, settled: list[SamplePrompt],
                          max_sequence_length: int, device: torch.device, tuner, on_image,
                          progress: SampleProgress | None = None, encoder_host: int | None = None,
                          host_flag: str = "--host-budget") -> list:
    """The images of ``settled`` from the family's pipeline (its VAE, text encoders and scheduler, within
    ``encoder_host`` bytes of host memory, which ``host_flag`` set; the streamed ``transformer`` as its denoiser)."""
    dtype = _encoder_dtype(transformer, device)
    component = ADAPTERS[family].component
    run = EncoderRun(None, max_sequence_length, 0, "the free GPU memory", host_budget=encoder_host,
                     host_flag=host_flag)
    with open_family_pipeline(encoders, family, device, dtype, run=run) as opened:
        pipe = opened.pipeline
        tile_clip_decodes(pipe, family)
        setattr(pipe, component, transformer)
        try:
            def draw_one(prompt, callback):
                drawing, inputs = prompt_pipeline(pipe, family, prompt)  # an edit's: train/edit_sample.py
                return draw_with_pipeline(drawing, prompt, max_sequence_length, device, callback, inputs)

            return each_prompt(settled, tuner, on_image, draw_one, progress)
        finally:
            setattr(pipe, component, None)


def tile_clip_decodes(pipe, family: str) -> bool:
    """Have a video family's VAE decode its clips in tiles (diffusers' ``enable_tiling``: overlapping tiles, blended);
    whether it does. Decoding a clip whole holds every frame's feature maps at full size: Wan 2.2-TI2V-5B's VAE ran out
    of a 16 GB card's memory on 49 frames at 928² (docs/train.md, "Clips"). Frames no larger than a tile decode as
    before; image families keep their VAE's own setting."""
    recipe = getattr(ADAPTERS.get(family), "recipe", None)
    vae = getattr(pipe, "vae", None)
    if recipe is None or not recipe.frames or vae is None or not can_tile(vae):
        return False
    vae.enable_tiling()
    return True


def _drawer(slab, family: str, encoders: EncoderSource, stages: dict[str, str | None]) -> Callable:
    """What draws ``family``'s images: Würstchen's two pipelines (``stages`` names the other one), a family's own
    pipeline, or SquareQ's FLUX.1 sampler; :class:`SampleError` for what cannot draw, or --prior/--decoder beside a
    slab that is not one of Würstchen's stages."""
    if family in STAGES:
        folders = wuerstchen_folders(slab, family, encoders, stages)
        # Würstchen's stages load whole (CLIPs of 0.7-1.4 GB): no host budget of their own
        return lambda *args, encoder_host=None, **kwargs: draw_wuerstchen(folders, *args, **kwargs)
    given = [f"--{k}" for k, v in stages.items() if v]
    if given:
        raise SampleError(f"{given[0]} is for a Würstchen slab (the stage it does not hold); this slab holds a "
                          f"{family} model, so leave it out.")
    return draw_through_pipeline if check_family(slab, family, encoders) else _draw_flux


SAMPLE_FLAGS = {"model": "--model", "prior": "--prior", "decoder": "--decoder"}  # squareq sample's
TRAIN_SAMPLE_KEYS = {"prior": "sample_prior", "decoder": "sample_decoder"}  # the trainer's (TrainConfig)


def wuerstchen_folders(slab, family: str, encoders: EncoderSource, stages: dict[str, str | None],
                       flags: dict[str, str] = SAMPLE_FLAGS) -> tuple[Path, Path]:
    """The pipeline folders of a Würstchen slab's own stage (``encoders``, given as ``flags["model"]``) and of the
    other stage (``stages``, given as ``flags[stage]``), fetched if Hub IDs; :class:`SampleError` naming the flag or
    key to give."""
    own, other = STAGES[family], other_stage(family)
    if stages.get(own) and flags["model"] != flags[own]:
        raise SampleError(f"{flags[own]}: {slab} holds Würstchen's {own} itself; give the {other}'s pipeline with "
                          f"{flags[other]}.")
    if not stages.get(other):
        raise SampleError(f"{slab} holds Würstchen's {own}, and an image needs its {other} too: give the {other}'s "
                          f"pipeline folder or Hub ID with {flags[other]} (e.g. {flags[other]} {HUB_IDS[other]}).")
    if encoders.where in BUILTIN_MODELS:
        raise SampleError(f"{slab} holds Würstchen's {own}, which is drawn through its pipeline (its text encoder and "
                          f"scheduler); the built-in tiny model has none, so pass the {own}'s pipeline folder or Hub "
                          f"ID with {flags['model']} (e.g. {flags['model']} {HUB_IDS[own]}).")
    try:
        return (whole_pipeline_folder(encoders.where, skip=(own,), flag=flags["model"]),
                whole_pipeline_folder(stages[other], flag=flags[other]))
    except EncoderError as exc:
        raise SampleError(str(exc)) from None


def wuerstchen_training_folders(slab, family: str, sample_prior: str | None,
                                sample_decoder: str | None) -> tuple[Path, Path]:
    """:func:`wuerstchen_folders` for the trainer's sample images: both stages' folders from its keys (a Würstchen
    run trains on a cache or a built-in model, so its own stage's text encoder has to be named too)."""
    given = {"prior": sample_prior, "decoder": sample_decoder}
    own = STAGES[family]
    if not given[own]:
        raise SampleError(f"{slab} holds Würstchen's {own}, whose sample images are drawn through its pipeline (its "
                          f"text encoder and scheduler): give its folder or Hub ID with {TRAIN_SAMPLE_KEYS[own]}, "
                          f"and the {other_stage(family)}'s with {TRAIN_SAMPLE_KEYS[other_stage(family)]}.")
    keys = {**TRAIN_SAMPLE_KEYS, "model": TRAIN_SAMPLE_KEYS[own]}
    return wuerstchen_folders(slab, family, EncoderSource(given[own]), given, keys)


def draw_wuerstchen(folders: tuple[Path, Path], encoders, family: str, transformer, settled: list[SamplePrompt],
                    max_sequence_length: int, device: torch.device, tuner, on_image,
                    progress: SampleProgress | None = None) -> list:
    """The images of ``settled`` from Würstchen's two pipelines, the streamed ``transformer`` as the slab's stage
    (train/wuerstchen_sample.py). The tuner and the NaN check follow the slab's stage's steps."""
    dtype = _encoder_dtype(transformer, device)
    own = STAGES[family]
    try:
        with open_stages(*folders, family, transformer, device, dtype) as (prior_pipe, decoder_pipe):
            def draw_one(prompt, callback):
                return draw_stages(prior_pipe, decoder_pipe, family, prompt, device, autocast_dtype(transformer),
                                   lambda stage: _FiniteLatents(prompt.text, callback if stage == own else None))

            return each_prompt(settled, tuner, on_image, draw_one, progress)
    except EncoderError as exc:
        raise SampleError(str(exc)) from None
