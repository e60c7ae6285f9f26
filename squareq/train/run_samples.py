"""Sample images during training: the sampling settings checked before anything loads, the sample prompts settled
once per run, and :class:`TrainingSamples`, which draws them every ``sample_every`` steps from the model being
trained (FLUX.1's from the cached prompt embeddings through a VAE kept on the host; the other families' through their
own diffusers pipeline). A pause for forward passes (:func:`forward_only`, also the validation pass's) sets the
training RNG aside, so samples do not change the run."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from .. import runtime
from ..models import ADAPTERS
from ..plot import first_frame, write_png, write_sample
from ..progress import Echo
from ..sources.encoder_source import EncoderSource
from ..sources.encoders import encoder_dtype, open_decoder
from .cache import EmbeddingCache
from .config import TrainConfig
from .errors import TrainError
from .prompt_options import PromptError, SamplePrompt, parse_prompt
from .sample import (
    FORWARD_SLOTS,
    SampleError,
    SampleProgress,
    check_edit_prompts,
    check_family,
    check_prompts,
    draw_image,
    draw_through_pipeline,
    draw_wuerstchen,
    each_prompt,
    negative_needs_true_cfg,
    wuerstchen_training_folders,
)
from .wuerstchen_sample import STAGES


def check_sampling(cfg: TrainConfig, family: str, encoders: EncoderSource) -> tuple[Path, Path] | None:
    """Refuse sample settings this run could not draw with (:class:`TrainError`, one sentence each), before anything
    loads. Returns a Würstchen stage's two pipeline folders when ``sample_every`` is set (resolved, a Hub ID fetched,
    once, not at every round of samples), else None."""
    _check_stage_keys(cfg, family)
    stages = _check_samples(cfg, family, encoders) if cfg.sample_every else None
    try:  # a negative prompt without --l: refused for a guidance-distilled family only; frames for a video one
        check_prompts(family, sample_prompts(cfg, family))
        if cfg.sample_every:  # control images its folder can draw (Qwen-Image-Edit's edit pipelines)
            check_edit_prompts(family, encoders, sample_prompts(cfg, family))
    except (PromptError, SampleError) as exc:
        raise TrainError(f"sample_prompts: {exc}") from None
    return stages


def _check_samples(cfg: TrainConfig, family: str, encoders) -> tuple[Path, Path] | None:
    """Refuse ``sample_every`` (:class:`TrainError`, one sentence) where squareq sample could not draw either: a
    family with neither SquareQ's own sampler nor a diffusers pipeline, or a pipeline family without its folder.
    Returns a Würstchen stage's two pipeline folders (``sample_prior``, ``sample_decoder``), else None."""
    try:
        if family in STAGES:
            return wuerstchen_training_folders(cfg.slab, family, cfg.sample_prior, cfg.sample_decoder)
        check_family(cfg.slab, family, encoders)
        return None
    except SampleError as exc:
        raise TrainError(f"sample_every = {cfg.sample_every}: {exc} (Or set sample_every = 0.)") from None


def _check_stage_keys(cfg: TrainConfig, family: str) -> None:
    """Refuse sample_prior / sample_decoder beside a slab that is not one of Würstchen's stages."""
    given = [k for k in ("sample_prior", "sample_decoder") if getattr(cfg, k)]
    if given and family not in STAGES:
        raise TrainError(f"{given[0]} is for a Würstchen slab's sample images; this slab holds a {family} model, so "
                         "leave it out.")


def sample_prompts(cfg: TrainConfig, family: str) -> list[SamplePrompt]:
    """``cfg.sample_prompts`` with their options settled (train/prompt_options.py), ``--n`` under ``family``'s rule."""
    return list(_settled_prompts(tuple(cfg.sample_prompts), cfg.largest_resolution, cfg.sample_steps,
                                 cfg.sample_guidance, cfg.sample_seed, family))


@functools.lru_cache(maxsize=16)
def _settled_prompts(prompts: tuple[str, ...], resolution: int, steps: int, guidance: float,
                     seed: int, family: str) -> tuple[SamplePrompt, ...]:
    # parsed once per run and settings, not at every sample round (a skipped kohya option is said once anyway)
    return tuple(parse_prompt(p, negative_needs_true_cfg(family)).settled(resolution, steps, guidance, seed)
                 for p in prompts)


class TrainingSamples:
    """The sample images of one run into ``out/samples``: FLUX.1's from the prompts' cached embeddings (``cache``,
    ``text_keys``) through the VAE, which stays on the host between rounds (loaded at the first); the other families'
    through their own diffusers pipeline folder, its text encoders and VAE opened for each round of samples
    (train/sample.py ``draw_through_pipeline``); a Würstchen stage's through both stages' ``stages`` folders.
    Each round is a bar titled ``samples at step N`` over its denoising steps that goes when done (on a terminal, or
    as ``progress`` says), else a line for ``echo`` per image (train/sample.py :class:`SampleProgress`)."""

    def __init__(self, cfg: TrainConfig, family: str, encoders: EncoderSource, stages: tuple[Path, Path] | None,
                 device: torch.device, dtype: str, out: Path, cache: EmbeddingCache,
                 text_keys: dict[str, str], progress: bool | None = None, echo: Echo | None = None,
                 encoder_host: int | None = None) -> None:
        self.cfg, self.family, self.encoders, self.stages = cfg, family, encoders, stages
        self.encoder_host = encoder_host  # host memory a round's encoders may hold beside the slab (host_plan.py)
        self.device, self.dtype, self.folder = device, dtype, out / "samples"
        self.cache, self.text_keys = cache, text_keys
        self.progress, self.echo = progress, echo
        self.decoder = None

    def _bar(self, step: int) -> SampleProgress:
        return SampleProgress(f"samples at step {step}", self.progress, self.echo, leave=False)

    def draw(self, model, step: int) -> None:
        """This step's images of every prompt and their grid, from ``model`` (the one being trained)."""
        if not ADAPTERS[self.family].samples:
            self._through_pipeline(model, step)
            return
        if self.decoder is None:
            self.decoder = open_decoder(self.encoders, self.family, encoder_dtype(self.device, self.dtype))
        embeds = {t: self.cache.load("text", self.text_keys[t]) for p in sample_prompts(self.cfg, self.family)
                  for t in p.texts}
        _save_samples(self.cfg, model, self.decoder, embeds, self.folder, step, self.device, self._bar(step))

    def _through_pipeline(self, model, step: int) -> None:
        folder, cfg = self.folder, self.cfg
        folder.mkdir(parents=True, exist_ok=True)
        draw = functools.partial(draw_through_pipeline, encoder_host=self.encoder_host, host_flag="host_budget")
        if self.family in STAGES:  # Würstchen: both stages' pipelines (whole), the model being trained as its own
            draw = lambda *args, **kwargs: draw_wuerstchen(self.stages, *args, **kwargs)  # noqa: E731
        with forward_only(model, self.device):
            images = draw(
                self.encoders, self.family, model, sample_prompts(cfg, self.family),
                cfg.max_sequence_length, self.device, None,
                lambda i, image: write_sample(image, folder / f"step-{step:08d}-{i}"), progress=self._bar(step))
        write_png(_side_by_side([first_frame(im) for im in images]), folder / f"step-{step:08d}-grid.png")


def _save_samples(cfg: TrainConfig, model, pipe, embeds: dict[str, dict], folder: Path, step: int,
                  device: torch.device, progress: SampleProgress) -> None:
    """PNG samples of ``cfg.sample_prompts`` (their texts' cached ``embeds``) from the model being trained (streamed
    forward under no_grad) through ``pipe``, a pipeline without text encoders whose VAE waits on the host. The
    training RNG is set aside while sampling, so samples do not change the run."""
    folder.mkdir(parents=True, exist_ok=True)
    pipe.transformer = model
    pipe.vae.to(device)
    try:
        with forward_only(model, device):
            def draw_one(prompt, on_step_end):
                return draw_image(pipe, prompt, cfg.max_sequence_length, device, on_step_end,
                                  embeds=embeds[prompt.text], negative=embeds.get(prompt.negative))

            images = each_prompt(sample_prompts(cfg, "flux"), None,
                                 lambda i, im: write_png(im, folder / f"step-{step:08d}-{i}.png"), draw_one, progress)
            write_png(_side_by_side(images), folder / f"step-{step:08d}-grid.png")
    finally:
        pipe.transformer = None
        pipe.vae.to("cpu")


@contextlib.contextmanager
def forward_only(model, device: torch.device):
    """A pause in training for forward passes (samples, validation): eval mode, the training RNG set aside, and
    the ring lent FORWARD_SLOTS, since a forward-only pass needs more slots in flight than a training step to hide
    its copies; the extra slots go back before training goes on."""
    model.eval()
    streamer = runtime.runtime_of(model).streamer
    before = len(streamer.slots) if streamer is not None else 0
    try:
        if streamer is not None:
            streamer.add_slots(FORWARD_SLOTS - before)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        if streamer is not None:  # also the slots an add_slots that ran out of memory did add
            streamer.remove_slots(len(streamer.slots) - before)
        model.train()


def _side_by_side(images):
    """One image of ``images`` in a row (a sample step's grid: one column per prompt)."""
    from PIL import Image

    grid = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)), "white")
    x = 0
    for im in images:
        grid.paste(im, (x, 0))
        x += im.width
    return grid
