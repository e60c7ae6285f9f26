"""The VAE and text encoders the cache needs, found from the slab's recorded source or ``--model``.

``tiny-flux`` uses the built-in toy VAE, CLIP and T5 (squareq.models.tiny_pipeline); a diffusers FLUX pipeline
folder (or its ``transformer/`` subfolder), or its Hub ID, supplies its own ``vae``, ``text_encoder`` and
``text_encoder_2``, except those given as single files (``--clip-l``, ``--t5``, ``--vae``: sources/single_files.py).
The other families' built-in tiny models (``tiny-sd3``, ``tiny-wan``, ...) get a toy VAE with their latent channels
and a tiny T5 (and CLIP, where the family takes pooled text) at the widths their denoiser expects
(:class:`ToyEncoders`); their pipeline folders go through the family's diffusers pipeline
(``squareq.sources.pipeline_encoders``). They are held only while the cache is filled, then released.

Encoders that do not fit the run's VRAM budget with the others (FLUX.1's T5-XXL is 9.5 GB, FLUX.2's Mistral 48 GB)
stay in page-locked host memory and stream through the device block by block (sources/encoder_placement.py), so the
cache fills on a GPU with a few GB free; the VAE and the small encoders load whole.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models import ADAPTERS, BUILTIN_MODELS, build_tiny_flux_pipeline
from ..models.tiny_pipeline import (
    CLIP_MAX_LENGTH,
    build_tiny_text_encoders,
    build_tiny_vae,
)
from ..runtime.host.budget import anonymous_memory
from .boundary import reading
from .encoder_files import as_loaded, mapped_dtypes
from .encoder_identity import module_identity
from .encoder_placement import DEFAULT_RUN, EncoderRun, Placement, placed
from .encoder_source import (  # noqa: F401 (EncoderError re-exported)
    EncoderError,
    EncoderSource,
    cli_flag,
    dtype_tag,
    pipeline_folder,
)
from .hub import read_index
from .pipeline_encoders import open_family_pipeline
from .single_files import load_single_files


@dataclass
class Encoders:
    pipeline: object  # a diffusers FluxPipeline without its transformer (FLUX.1; other families: pipeline_encoders.py)
    device: torch.device
    dtype: torch.dtype
    vae_identity: str  # cache-key parts: which weights computed an entry
    text_identity: str
    placement: Placement | None = None  # where the encoders run (None: the built-in toys, whole)

    @property
    def vae(self):
        return self.pipeline.vae

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """[3, H, W] in [-1, 1] -> the FLUX-normalized latent [C, H/8, W/8] (fp32). The distribution's mode, so
        a cached latent is the same every time it is computed."""
        vae = self.vae
        z = vae.encode(image[None].to(self.device, self.dtype)).latent_dist.mode()
        return ((z.float() - vae.config.shift_factor) * vae.config.scaling_factor)[0].cpu()

    @torch.no_grad()
    def encode_prompts(self, texts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        """One cache entry per text: T5 ``prompt_embeds`` [L, D] and CLIP ``pooled_prompt_embeds`` [D] (fp32)."""
        return ADAPTERS["flux"].recipe.pipeline.encode(self.pipeline, list(texts), max_sequence_length, self.device)


TEXT_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
ENCODER_PARTS = ("vae", "text_encoder", "text_encoder_2")  # FLUX.1's, with weights


def _load_folder(source: EncoderSource, dtype: torch.dtype, text: bool = True, dtypes: dict | None = None):
    """The FLUX pipeline of ``source`` without its transformer (and, ``text=False``, without its text encoders and
    tokenizers), its single files in place of the components they replace; ``dtypes``: a component's own dtype, by
    name (the text encoders that load as views of their files, sources/encoder_files.py)."""
    from diffusers import FluxPipeline

    folder = pipeline_folder(source)
    dtypes = dtypes or {}
    left_out = dict.fromkeys(("transformer",) + (() if text else TEXT_PARTS))
    given = load_single_files(source, folder, read_index(folder), dtype, only=None if text else ("vae",),
                              dtypes=dtypes)
    with reading(f"the VAE{' and text encoders' if text else ''} of {source} from {folder}",
                 "pass a complete FLUX pipeline folder or Hub ID with --model", EncoderError):
        return FluxPipeline.from_pretrained(str(folder), **{**left_out, **given}, torch_dtype={"default": dtype,
                                                                                              **dtypes},
                                            local_files_only=True, use_safetensors=True)  # never a pickle


class ToyEncoders:
    """The built-in encoders of a tiny non-FLUX model: a toy ``AutoencoderKL`` with the family's latent channels
    (normalized with FLUX's VAE factors; a frame axis for video families) and a tiny T5, plus a tiny CLIP's pooled
    output where the family takes pooled text. Seeded: the same weights on every machine."""

    def __init__(self, family: str, config, device: torch.device, dtype: torch.dtype) -> None:
        self.recipe = ADAPTERS[family].recipe
        self.fields = self.recipe.text_fields(config)
        self.device, self.dtype = device, dtype
        self.vae = build_tiny_vae(latent_channels=self.recipe.latent_channels(config))
        self.clip, self.clip_tok, self.t5, self.t5_tok = build_tiny_text_encoders(
            t5_width=self.fields.width, clip_width=self.fields.pooled)
        for module in (self.vae, self.clip, self.t5):  # built in fp32; moved, and cast only where asked
            module.to(device)
            if dtype != torch.float32:
                module.to(dtype=dtype)
        where = dtype_tag(dtype)
        self.vae_identity = module_identity(self.vae, "vae") + where
        self.text_identity = (family + module_identity(self.t5, "t5")
                              + (module_identity(self.clip, "clip") if self.fields.pooled else "") + where)
        self.placement = None  # built-in toys: whole, wherever they run

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """[3, H, W] in [-1, 1] -> the normalized latent [C, H/8, W/8] ([C, 1, H/8, W/8] for video families); with
        the family's image embedding next to it (``{"latents", "effnet"}``) where its denoiser takes one."""
        z = self.vae.encode(image[None].to(self.device, self.dtype)).latent_dist.mode()
        z = ((z.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor)[0].cpu()
        if self.recipe.image_conditioning is not None:
            return {"latents": z, "effnet": self.recipe.image_conditioning(z)}
        return z[:, None] if self.recipe.frames else z

    @torch.no_grad()
    def encode_clip(self, frames: torch.Tensor) -> torch.Tensor:
        """[3, F, H, W] in [-1, 1] -> the normalized latent [C, F, H/8, W/8] of a video family: the toy VAE is an
        image VAE, so each frame is encoded on its own (no temporal compression)."""
        z = self.vae.encode(frames.permute(1, 0, 2, 3).to(self.device, self.dtype)).latent_dist.mode()
        z = (z.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        return z.permute(1, 0, 2, 3).cpu()

    @torch.no_grad()
    def encode_prompts(self, texts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        """One entry per text: the T5 sequence padded to ``max_sequence_length`` (with its mask where the family
        masks padding) and the pooled CLIP output where the family takes one (fp32)."""
        t5 = self.t5_tok(list(texts), padding="max_length", max_length=max_sequence_length, truncation=True,
                         return_tensors="pt").to(self.device)
        mask = t5.attention_mask
        sequence = self.t5(t5.input_ids, attention_mask=mask).last_hidden_state.float().cpu()
        entries = [{"prompt_embeds": seq} for seq in sequence]
        if self.fields.mask:
            for entry, m in zip(entries, mask.cpu(), strict=True):
                entry["prompt_mask"] = m.float()
        if self.fields.pooled:
            ids = self.clip_tok(list(texts), padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                                return_tensors="pt").input_ids.to(self.device)
            for entry, pooled in zip(entries, self.clip(ids).pooler_output.float().cpu(), strict=True):
                entry["pooled_prompt_embeds"] = pooled
        return entries


def builtin_family(source: EncoderSource | str) -> str | None:
    """The family of a built-in tiny model name (None for anything else)."""
    where = EncoderSource.of(source).where
    return BUILTIN_MODELS[where][0] if where in BUILTIN_MODELS else None


def check_encoder_source(source: EncoderSource | str, family: str) -> None:
    """Refuse, in one sentence, encoders that cannot serve a ``family`` model: another family's built-in, or a
    folder that is not a diffusers pipeline. Reads no weights (a Hub ID's encoder files are fetched)."""
    source = EncoderSource.of(source)
    if family not in ADAPTERS or ADAPTERS[family].recipe is None:
        raise EncoderError(f"SquareQ has no VAE and text encoders for the {family} family (it cannot train it); "
                           f"the families it trains: {', '.join(f for f, a in ADAPTERS.items() if a.recipe)}.")
    other = builtin_family(source)
    if other is not None and other != family:
        raise EncoderError(f"{source} is the built-in {other} model, so its encoders do not fit a {family} model; pass "
                           f"the {family} pipeline folder with --model.")
    if source.files and builtin_family(source) is not None:
        raise EncoderError(f"{source.where} has built-in encoders; leave out "
                           f"{', '.join(cli_flag(k) for k, _ in source.files)}.")
    pipeline_folder(source)


def open_decoder(source: EncoderSource | str, family: str, dtype: torch.dtype):
    """The FLUX pipeline of ``source`` with its VAE and scheduler only, on the host: all that drawing an image from
    cached prompt embeddings needs (the trainer's sample images), without the text encoders (FLUX.1's T5 is 9.5 GB)."""
    source = EncoderSource.of(source)
    check_encoder_source(source, family)
    if family != "flux":
        raise EncoderError(f"sample images during training are drawn for FLUX.1 only, not the {family} family.")
    if source.where == "tiny-flux":
        pipe = build_tiny_flux_pipeline()
        for name in ("transformer", *TEXT_PARTS):
            setattr(pipe, name, None)
        pipe.vae.to(dtype=dtype)
        return pipe
    return _load_folder(source, dtype, text=False)


def encoder_dtype(device: torch.device, run_dtype: str = "bf16") -> torch.dtype:
    """The text encoders' and VAE's type beside a denoiser running in ``run_dtype``: fp32 on the CPU and in an fp16
    run (T5 and VAEs overflow fp16; the cards that need fp16 have no bf16), else bf16."""
    return torch.bfloat16 if device.type == "cuda" and run_dtype != "fp16" else torch.float32


@contextlib.contextmanager
def open_encoders(source: EncoderSource | str, device: torch.device, family: str, config=None,
                  run: EncoderRun = DEFAULT_RUN, dtype: torch.dtype | None = None) -> Iterator[Encoders]:
    """The encoders of ``source`` (a built-in tiny model, a pipeline folder or Hub ID, and single files) for a
    ``family`` model with ``config`` (the slab's recorded model config) on ``device``, placed for ``run`` (whole, or
    the large text encoders streamed: sources/encoder_placement.py), released on exit. ``dtype``: theirs (default:
    :func:`encoder_dtype`'s for a bf16 run)."""
    source = EncoderSource.of(source)
    check_encoder_source(source, family)
    dtype = dtype or encoder_dtype(device)
    if family != "flux":
        if builtin_family(source) == family:
            try:
                yield ToyEncoders(family, config, device, dtype)
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            return

        with open_family_pipeline(source, family, device, dtype, run) as encoders:
            yield encoders
        return
    mapped = {}
    if source.where == "tiny-flux":
        pipe = build_tiny_flux_pipeline()
        pipe.transformer = None
    else:
        folder = pipeline_folder(source)
        mapped = mapped_dtypes(source, folder, read_index(folder), TEXT_PARTS)
        before = anonymous_memory()
        pipe = _load_folder(source, dtype, dtypes=mapped)
        mapped = as_loaded(mapped, before, pipe, ENCODER_PARTS, dtype)
    where = dtype_tag(dtype)
    vae_id = module_identity(pipe.vae, "vae", source=source.origin("vae")) + where
    text_id = module_identity(pipe.text_encoder, "clip", dtype, source.origin("clip_l")) \
        + module_identity(pipe.text_encoder_2, "t5", dtype, source.origin("t5")) + where
    try:
        with placed(pipe, ENCODER_PARTS, device, dtype, run, mapped) as placement:
            yield Encoders(pipe, device, dtype, vae_id, text_id, placement)
    finally:
        for name in ENCODER_PARTS:
            setattr(pipe, name, None)
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # once, before training: the encoders' memory goes back to the ring
