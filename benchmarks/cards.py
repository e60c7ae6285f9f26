#!/usr/bin/env python3
"""Every example config on the card it names (issue 39): caching, training steps and a sample image under that
card's memory.

    python benchmarks/cards.py --workdir DIR [--out DIR] [--configs flux1-dev-8gb,qwen-image] [--steps 5] [--tiny]

For each config in ``examples/`` (its card below, :data:`CARDS`, which must name every example and no other: the run
stops otherwise), in a process of its own:

* the CUDA caching allocator is capped (``torch.cuda.set_per_process_memory_fraction``) at the card's memory less
  the CUDA context this process holds on the device, which a card of that size holds too;
* the config's text encoders and VAE, at their released shapes with seeded random weights (FLUX.1: CLIP-L and
  T5-XXL; FLUX.2: Mistral-Small-3.1-24B with its Pixtral tower; Qwen-Image: Qwen2.5-VL-7B; Wan 2.1: UMT5-XXL's
  encoder and the Wan 2.1 VAE; Wan 2.2-TI2V-5B: UMT5-XXL's encoder and the Wan 2.2 VAE; HunyuanVideo: Llama-3-8B's
  decoder, CLIP-L and its VAE; :data:`PIPELINES`), were written once
  into the workdir as a user holds them (:data:`LAYOUTS`): the cached Hub snapshot of its repository
  (``hub-full/``, ``HF_HUB_CACHE`` with ``HF_HUB_OFFLINE=1``, the config's ``model`` its Hub ID), and for FLUX.1 also
  ComfyUI's single files (``clip_l``, ``t5``, ``vae``: ``clip_l.safetensors``, ``t5xxl_fp16.safetensors``,
  ``ae.safetensors``), each a run of its own; the trainer's own caching (``squareq.train.loop``) loads them through
  squareq's loaders and places them within the config's ``vram_budget`` (``squareq.sources.encoder_placement``), so
  those that do not fit stream block by block;
* ``squareq.train.loop.train`` then runs ``--steps`` steps of the config (its batch, resolution, rank, ring, host and
  ``host_budget``, the PC it is for) on its shape key's slab (``benchmarks/train_step.py --only slab``: the same
  random weights and W4/W6/W8 mix), on noise images at its largest resolution, or for a video family (Wan,
  HunyuanVideo) on :data:`CLIPS` noise clips only (folders of square PNG frames at that resolution, each named by the
  caption beside it), as many frames as its longest window needs after ``source_fps`` drops frames to the family's
  rate, so every step trains on a window of the config's frames; the run's host plan (``squareq.train.host_plan``:
  its expected peak, where the slab waits, which encoders read from their files through a ring) is recorded;
* in the Hub layout, the same steps again with ``host_budget = "auto"`` (what this machine has: no budget to keep
  within) on the filled cache, then with the PC's budget again on it: the step with the PC's budget against the
  step without one, as the first run measured it (after caching in its process) and with both on the filled cache;
* ``squareq sample``'s path draws one image at the config's largest resolution (a video config: one clip of its
  longest window), FLUX.1 by SquareQ's own path, the other families by their diffusers pipeline over the Hub
  snapshot, within the config's host budget: the host phase ``sampling``.

The slab, the Hub snapshot (:data:`REPOS`) and the files written for it are keyed by a config's shape key
(:func:`shape_of`: its family, or where one family's configs are for models of other shapes, :data:`SHAPES`), so
``wan2.2-ti2v-5b`` runs on Wan 2.2-TI2V-5B's shapes: its 5B transformer (``train_step.py --family wan2.2-5b``, 48
latent channels), UMT5-XXL and the Wan 2.2 VAE (48 channels, 16x a side) in the release's repository, while what goes
by the family (its slab's manifest says ``wan``: squareq's frame rate and temporal stride, :data:`LAYOUTS`) is Wan's.

The tokenizers are the offline tiny ones (char-level; FLUX.2's and Qwen-Image's pad or template to the same lengths
as the real ones do; HunyuanVideo's pipeline cuts its template's ``crop_start`` tokens off whatever they hold), so token
counts are like the real ones' but ids are not. Each process reports the peak reserved
memory of caching, of the steps and of sampling against the card; per host phase (:data:`PHASES`: loading the
encoders, caching, the steps, sampling) the peaks of anonymous memory (RssAnon, pinned pages included) and of RSS,
read from ``/proc/self/status`` every 100 ms by a thread (``common.HostPeaks``), each against the config's
``host_budget`` (``within_host_budget``); the median step, the bytes copied
into the ring per step, and what that copy would take at a consumer PCIe 4.0 x16 link's ~25 GB/s (arithmetic, not
measured). One JSON line per measurement, then a markdown table. ``--tiny``: the families' tiny slabs and encoders as
wide as them, no caps, 2 steps and a 2-step sample at 64 px (a video config's windows :data:`TINY_FRAMES` frames),
the same files written at the tiny shapes
(``hub-tiny/``; ComfyUI's for the first FLUX.1 config only), every config in this one process with its own
``vram_budget`` (the encoders are placed within it; the trainer checks its memory plan on a GPU only), a smoke test
anywhere, seconds on a CPU, where the GPU figures (memory peaks, bytes copied) are null and listed as not measured.

The phases and the caching's figures are read around ``squareq.sources.encoders.open_encoders``:
:func:`watched_encoders` wraps the real function wherever a loaded squareq module holds it (squareq has no public
hook for that); the encoders still load through it from the files.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import common  # noqa: E402
from common import NOT_MEASURED, RECORDS, Column, HostPeaks, emit, git_commit, log, not_measured, set_figure  # noqa: E402
from train_e2e import write_data  # noqa: E402  (noise images with captions)
from user_layout import REPOS, has_snapshot, hub_cache, write_comfyui_encoders, write_hub_snapshot  # noqa: E402

GIB = 1 << 30
EXAMPLES = ROOT / "examples"
# example config -> (family, the card it names in GiB): a row for every examples/*.toml, which main checks
CARDS = {"flux1-dev-8gb": ("flux", 8), "flux1-dev-16gb": ("flux", 16), "flux1-dev-24gb": ("flux", 24),
         "flux1-kontext-dev-16gb": ("flux", 16),
         "flux2-dev": ("flux2", 24), "qwen-image": ("qwen-image", 16), "qwen-image-edit": ("qwen-image", 24),
         "wan2.1-t2v-14b-16gb": ("wan", 16), "wan2.1-t2v-14b-24gb": ("wan", 24), "wan2.2-ti2v-5b": ("wan", 16),
         "hunyuan-video-24gb": ("hunyuan-video", 24)}
# the configs that train on edit pairs, with the Hub repository of their edit pipeline (its processor and template;
# the family's slab stands in for the edit model's transformer, which is the same class at the same shapes)
EDIT_REPOS = {"qwen-image-edit": "Qwen/Qwen-Image-Edit",
              "flux1-kontext-dev-16gb": "black-forest-labs/FLUX.1-Kontext-dev"}
# config -> its shape key where that is not its family: train_step.py's --family of its slab, the key of its Hub
# repository (user_layout.REPOS) and of its pipeline (PIPELINES); Wan 2.2-TI2V-5B is squareq's wan family at shapes
# of its own
SHAPES = {"wan2.2-ti2v-5b": "wan2.2-5b"}
PCIE4_BYTES_PER_S = 25e9  # a PCIe 4.0 x16 link's practical host-to-device rate
SAMPLE_PROMPT = "a photo of sks on a beach"
IMAGES = 8  # noise images: enough for the largest batch (4) in every bucket
CLIPS = 2  # noise clips of a video config (batch 1): folders of frames, each its longest window's frames or more
TINY_FRAMES = 5  # --tiny's window of a video config (1 + 4: one latent frame past the first), as train_step.py's
TINY_STEPS = 2  # --tiny's training and sampling steps (unless given)

# the released text encoders' shapes (their config.json on the Hub)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
MISTRAL_SMALL = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                     rope_theta=1e9)
PIXTRAL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=1540,
               patch_size=14, head_dim=64)
QWEN25_VL_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rope_theta=1e6,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=32,
                relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5)
QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31])


@contextlib.contextmanager
def fast_init(dtype):
    """Modules built in ``dtype`` with their initializers skipped (the weights are filled by :func:`fill_random`)."""
    import torch

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            yield
    finally:
        torch.set_default_dtype(previous)


def fill_random(module, seed: int) -> None:
    """Seeded N(0, 0.02) matrices, norm weights 1, other vectors 0 (as benchmarks/train_step.py's models), generated
    on the GPU when there is one and copied into the host tensors."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype).mul_(0.02))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def chat_tokenizer():
    """The offline tiny T5 tokenizer with a chat template that keeps the user's text (FLUX.2's pipeline asks for
    one)."""
    from squareq.models.tiny_pipeline import build_tiny_tokenizers

    tok = build_tiny_tokenizers()[1]
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{% if m['content'] is string %}"
                         "{{ m['content'] }}{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}"
                         "{% endif %}{% endfor %}")
    return tok


def _scaled(real: dict, **tiny) -> dict:
    return {**real, **tiny}


def _flow():
    import diffusers

    return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)


def flux_pipeline(config: dict, tiny: bool):
    """FLUX.1: CLIP-L, T5-XXL and its 16-channel VAE."""
    import diffusers
    import torch
    from transformers import T5Config, T5EncoderModel

    from squareq.models.tiny_pipeline import build_tiny_tokenizers, build_tiny_vae

    clip_tok, t5_tok = build_tiny_tokenizers()
    t5 = _scaled(T5_XXL, d_model=config["joint_attention_dim"], d_kv=8, d_ff=64, num_layers=3, num_heads=4) \
        if tiny else T5_XXL
    with fast_init(torch.bfloat16):
        parts = dict(text_encoder=clip_model(clip_tok, config["pooled_projection_dim"], tiny),
                     text_encoder_2=T5EncoderModel(T5Config(**t5)))
    vae = build_tiny_vae() if tiny else diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return diffusers.FluxPipeline(scheduler=_flow(), vae=vae.to(torch.bfloat16), tokenizer=clip_tok,
                                  tokenizer_2=t5_tok, transformer=None, **parts)


def clip_model(clip_tok, width: int, tiny: bool):
    """CLIP-L's text model (``tiny``: 2 layers, ``width`` wide), its bos and eos those of ``clip_tok``; built within
    :func:`fast_init`."""
    from transformers import CLIPTextConfig, CLIPTextModel

    clip = _scaled(CLIP_L, hidden_size=width, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   projection_dim=width) if tiny else CLIP_L
    return CLIPTextModel(CLIPTextConfig(**clip, bos_token_id=clip_tok.bos_token_id,
                                        eos_token_id=clip_tok.eos_token_id))


def flux2_pipeline(config: dict, tiny: bool):
    """FLUX.2: Mistral-Small-3.1-24B with its Pixtral tower, and the FLUX.2 VAE."""
    import diffusers
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = _scaled(MISTRAL_SMALL, hidden_size=config["joint_attention_dim"] // 3,
                   intermediate_size=64, num_hidden_layers=31, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=8) if tiny else MISTRAL_SMALL
    vision = _scaled(PIXTRAL, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     image_size=32, patch_size=16, head_dim=8) if tiny else PIXTRAL
    tok = chat_tokenizer()
    with fast_init(torch.bfloat16):
        encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=MistralConfig(**text, pad_token_id=tok.pad_token_id),
            vision_config=PixtralVisionConfig(**vision)))
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                                       norm_num_groups=4) if tiny else diffusers.AutoencoderKLFlux2()
    return diffusers.Flux2Pipeline(scheduler=_flow(), vae=vae.to(torch.bfloat16), text_encoder=encoder,
                                   tokenizer=tok, transformer=None)


def qwen_image_pipeline(config: dict, tiny: bool, edit: bool = False):
    """Qwen-Image: Qwen2.5-VL-7B and the Qwen-Image VAE. ``edit``: Qwen-Image-Edit's pipeline, its tokenizer given
    Qwen's vision tokens (their ids in the encoder's config) and a Qwen2-VL image processor for the vision tower (the
    released one's pixel bounds; tiny: at most 16 vision tokens an image)."""
    import diffusers
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from squareq.sources.vl_processor import add_vision_tokens, image_only_processor

    text = _scaled(QWEN25_VL_7B, hidden_size=config["joint_attention_dim"], intermediate_size=64,
                   num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                   rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}) if tiny else QWEN25_VL_7B
    vision = _scaled(QWEN25_VL_VISION, depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                     out_hidden_size=config["joint_attention_dim"], fullatt_block_indexes=[0]) if tiny \
        else QWEN25_VL_VISION
    tokenizer = chat_tokenizer()
    ids = add_vision_tokens(tokenizer) if edit else {}
    with fast_init(torch.bfloat16):
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    z = config["in_channels"] // 4  # the transformer packs 2x2 latent patches
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           latents_mean=[0.0] * z, latents_std=[1.0] * z) if tiny \
        else diffusers.AutoencoderKLQwenImage()
    parts = dict(scheduler=_flow(), vae=vae.to(torch.bfloat16), text_encoder=encoder, tokenizer=tokenizer,
                 transformer=None)
    if not edit:
        return diffusers.QwenImagePipeline(**parts)
    images = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16) if tiny else \
        Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
    return diffusers.QwenImageEditPipeline(**parts, processor=image_only_processor(images, tokenizer))


def wan_pipeline(config: dict, tiny: bool, vae=None, **registered):
    """Wan 2.1: UMT5-XXL's encoder and ``vae``, by default the Wan 2.1 VAE (``AutoencoderKLWan``'s defaults; tiny:
    8x, 4x in time, as wide as the tiny slab's latents); ``registered``: the pipeline's settings beyond its
    components (:func:`wan22_pipeline`'s)."""
    import diffusers
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from squareq.models.tiny_pipeline import build_tiny_tokenizers

    tok = build_tiny_tokenizers()[1]
    text = _scaled(UMT5_XXL, d_model=config["text_dim"], d_kv=8, d_ff=64, num_layers=2, num_heads=4) if tiny \
        else UMT5_XXL
    with fast_init(torch.bfloat16):
        encoder = UMT5EncoderModel(UMT5Config(**text, pad_token_id=tok.pad_token_id))
    z = config["in_channels"]
    if vae is None:
        vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True], latents_mean=[0.0] * z,
                                         latents_std=[1.0] * z) if tiny else diffusers.AutoencoderKLWan()
    return diffusers.WanPipeline(tokenizer=tok, text_encoder=encoder, vae=vae.to(torch.bfloat16), scheduler=_flow(),
                                 transformer=None, **registered)


def wan22_pipeline(config: dict, tiny: bool):
    """Wan 2.2-TI2V-5B: UMT5-XXL's encoder as Wan 2.1's, and the Wan 2.2 VAE (its vae/config.json: 2x2 pixel patches
    into 12 channels, then 8x, so 16x a side, 4x in time, 48 latent channels; tiny: as narrow as Wan 2.1's tiny one,
    its 48 channels those of the tiny slab's latents), in the ``WanPipeline`` with per-token timesteps
    (``expand_timesteps``) that the release's model_index.json registers."""
    import diffusers

    z = config["in_channels"]
    width = dict(base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1) if tiny else \
        dict(base_dim=160, decoder_base_dim=256, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    # the release's latents_mean and latents_std are 48 measured values each, not in diffusers' defaults; the
    # weights are random here anyway, so zeros and ones normalize as well as they would
    vae = diffusers.AutoencoderKLWan(**width, z_dim=z, temperal_downsample=[False, True, True], is_residual=True,
                                     in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                     scale_factor_temporal=4, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    return wan_pipeline(config, tiny, vae=vae, expand_timesteps=True)


def hunyuan_video_pipeline(config: dict, tiny: bool):
    """HunyuanVideo: Llama-3-8B's decoder (LLaVA-LLaMA-3-8B's text part, read at its third-to-last layer; the
    template its pipeline wraps a prompt in is cut off by ``crop_start`` tokens), CLIP-L for the pooled vector, and
    the HunyuanVideo VAE (tiny: 8x, 4x in time, as wide as the tiny slab's latents)."""
    import diffusers
    import torch
    from transformers import LlamaConfig, LlamaModel

    from squareq.models.tiny_pipeline import build_tiny_tokenizers

    clip_tok, tok = build_tiny_tokenizers()
    text = _scaled(LLAMA3_8B, hidden_size=config["text_embed_dim"], intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16) if tiny else LLAMA3_8B
    with fast_init(torch.bfloat16):
        parts = dict(text_encoder=LlamaModel(LlamaConfig(**text, pad_token_id=tok.pad_token_id)),
                     text_encoder_2=clip_model(clip_tok, config["pooled_projection_dim"], tiny))
    vae = diffusers.AutoencoderKLHunyuanVideo(
        latent_channels=config["in_channels"], block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4) if tiny else diffusers.AutoencoderKLHunyuanVideo()
    return diffusers.HunyuanVideoPipeline(scheduler=_flow(), vae=vae.to(torch.bfloat16), tokenizer=tok,
                                          tokenizer_2=clip_tok, transformer=None, **parts)


def kontext_pipeline(config: dict, tiny: bool):
    """FLUX.1 Kontext: FLUX.1's encoders and VAE in a FluxKontextPipeline folder (Kontext's own Hub layout)."""
    import diffusers

    return diffusers.FluxKontextPipeline(**flux_pipeline(config, tiny).components)


def save_processor(pipe):
    """What an edit pipeline's snapshot needs after saving: its processor in the Hub's layout; None for the others."""
    if getattr(pipe, "processor", None) is None:
        return None
    from squareq.sources.vl_processor import save_in_hub_layout

    return lambda snapshot: save_in_hub_layout(snapshot, pipe.processor.image_processor, pipe.processor.tokenizer)


# shape key (shape_of) -> its pipeline without the transformer (config: the slab's transformer config; tiny); an
# edit repository's (EDIT_REPOS) by its name
PIPELINES = {"flux": flux_pipeline, "flux2": flux2_pipeline, "qwen-image": qwen_image_pipeline, "wan": wan_pipeline,
             "wan2.2-5b": wan22_pipeline, "hunyuan-video": hunyuan_video_pipeline,
             "Qwen/Qwen-Image-Edit": lambda config, tiny: qwen_image_pipeline(config, tiny, edit=True),
             "black-forest-labs/FLUX.1-Kontext-dev": lambda config, tiny: kontext_pipeline(config, tiny)}


def shape_of(name: str) -> str:
    """Config ``name``'s shape key: what its slab, Hub snapshot and pipeline are keyed by (:data:`SHAPES`, else its
    family)."""
    return SHAPES.get(name, CARDS[name][0])


def repo_of(name: str) -> str:
    """The Hub repository config ``name``'s encoders are read from: its edit pipeline's, else its shape key's."""
    return EDIT_REPOS.get(name, REPOS[shape_of(name)])


def build_encoders(shape: str, config: dict, tiny: bool):
    """The diffusers pipeline of shape key ``shape`` without its transformer (:data:`PIPELINES`; ``shape`` may be an
    edit repository there): VAE and text encoders at their released shapes (``tiny``: a few layers, as wide as the
    tiny slab's text input), seeded random weights, in host memory."""
    if shape not in PIPELINES:
        raise ValueError(f"no encoders for {shape}")
    pipe = PIPELINES[shape](config, tiny)
    for name in ("text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            fill_random(module, seed=zlib.crc32(name.encode()) % 1000)  # hash() differs between processes
            module.eval()
    return pipe


@contextlib.contextmanager
def watched_encoders(measure: dict, peaks: HostPeaks, phases: tuple[str, str, str] | None = None):
    """Within: every loaded squareq module's ``open_encoders`` is the real one, watched: given ``phases`` (load,
    use, after), the host phase is the first while it loads and places the encoders from their files, the second
    while its caller uses them and the third once it released them; the placement, the caching's wall time and its
    peak reserved memory go into ``measure``."""
    import torch

    from squareq.sources import encoders

    real_open = encoders.open_encoders

    @contextlib.contextmanager
    def watched(*args, **kwargs):
        device = torch.device(inspect.signature(real_open).bind(*args, **kwargs).arguments["device"])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if phases:
            peaks.phase(phases[0])
        try:
            with real_open(*args, **kwargs) as opened:
                if phases:
                    peaks.phase(phases[1])
                if opened.placement is not None:
                    measure["placement"] = opened.placement.record()
                    log(opened.placement.describe())
                yield opened
        finally:
            measure["cache_peak_reserved_GB"] = measure["cache_peak_allocated_GB"] = None  # a CPU: listed later
            if device.type == "cuda":
                torch.cuda.synchronize()
                measure["cache_peak_reserved_GB"] = torch.cuda.max_memory_reserved() / 1e9
                measure["cache_peak_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
                torch.cuda.reset_peak_memory_stats()
            measure["cache_s"] = time.perf_counter() - start
            if phases:
                peaks.phase(phases[2])

    patched = [(module, name) for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith("squareq.")
               for name, value in list(vars(module).items()) if value is real_open]
    for module, name in patched:
        setattr(module, name, watched)
    try:
        yield
    finally:
        for module, name in patched:
            setattr(module, name, real_open)


def write_user_files(args, shape: str, family: str, repo: str | None = None) -> None:
    """The VAE and text encoders of shape key ``shape`` (of squareq's ``family``; seeded random weights, released
    shapes; ``--tiny``: the tiny ones) as the cached Hub snapshot of its repository (``repo``: an edit pipeline's,
    :data:`EDIT_REPOS`) in the workdir, once: what a user's ``hf download`` leaves; for FLUX.1 also as ComfyUI's
    single files. Their count of parameters beside it (:func:`params_file`)."""
    from squareq.slab import open_slab

    cache, repo = hub_dir(args), repo or REPOS[shape]
    if has_snapshot(cache, repo):
        return
    start = time.perf_counter()
    model_config = open_slab(slab_path(Path(args.workdir), shape, args.tiny), verify="off").manifest.model.config
    pipe = build_encoders(shape if repo == REPOS[shape] else repo, model_config, args.tiny)
    params = sum(p.numel() for n in ("text_encoder", "text_encoder_2")
                 if getattr(pipe, n, None) is not None for p in getattr(pipe, n).parameters())
    if "comfyui" in LAYOUTS[family] and repo == REPOS[shape]:
        write_comfyui_encoders(pipe, cache / f"comfyui-{shape}")
    snapshot = write_hub_snapshot(cache, pipe, repo, then=save_processor(pipe))  # last: refs/main says it is whole
    params_file(cache, repo).write_text(json.dumps({"encoder_params": params}))
    log(f"{repo}: encoders and VAE written to {snapshot} in {time.perf_counter() - start:.1f} s")


def params_file(cache: Path, repo: str) -> Path:
    return cache / f"params-{repo.replace('/', '--')}.json"


def remove_user_files(args, shape: str, repos: list[str]) -> None:
    import shutil

    cache = hub_dir(args)
    shutil.rmtree(cache / f"comfyui-{shape}", ignore_errors=True)
    for repo in repos:
        shutil.rmtree(cache / f"models--{repo.replace('/', '--')}", ignore_errors=True)
    log(f"{shape}: its encoder files removed from {cache} (--keep-files keeps them)")


def comfyui_files(cache: Path, shape: str) -> dict[str, Path]:
    folder = cache / f"comfyui-{shape}"
    return {"clip_l": folder / "clip_l.safetensors", "t5": folder / "t5xxl_fp16.safetensors",
            "vae": folder / "ae.safetensors"}


def hub_dir(args) -> Path:
    """Where the encoder files go: ``--files-dir`` (FLUX.2's 48 GB encoder beside its 18 GB slab fills a 64 GB disk),
    else the workdir. Mapped from a RAM file system, their pages count as the process's RssShmem, where on a disk
    they would be page cache: the host figures subtract them (``HostPeaks(ram_files=...)``)."""
    return Path(args.files_dir or args.workdir) / f"hub-{'tiny' if args.tiny else 'full'}"


def cap_to_card(card_gib: int) -> dict:
    """Cap this process's CUDA caching allocator at the card's memory less the CUDA context it holds here."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context and the allocator exist now
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    limit = card_gib * GIB - context
    torch.cuda.set_per_process_memory_fraction(limit / total)
    return {"cuda_context_GB": context / 1e9, "allocator_cap_GB": limit / 1e9,
            "device": torch.cuda.get_device_name(0), "device_total_GB": total / 1e9}


def slab_path(workdir: Path, shape: str, tiny: bool) -> Path:
    """Where train_step.py's slab phase writes the slab of shape key ``shape`` (its ``slab_path``)."""
    return workdir / f"{'tiny' if tiny else 'full'}-{shape}.slab"


PHASES = ("load", "caching", "steps", "sampling")  # the host-memory phases each record gives peaks for
# the layouts of a family's files a user holds, each run: the Hub cache (--model a Hub ID); ComfyUI's single files
# (--clip-l, --t5, --vae; the configs and tokenizers from the Hub cache, as squareq reads them)
LAYOUTS = {"flux": ("hub", "comfyui"), "flux2": ("hub",), "qwen-image": ("hub",), "wan": ("hub",),
           "hunyuan-video": ("hub",)}


def run_config(args, name: str, layout: str) -> None:
    """One example config in this process (module docstring)."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)  # the cuDNN attention backward fails on the device image
    family, card = CARDS[name]
    work = Path(args.workdir)
    rec = {"what": "card", "config": name, "family": family, "card_GiB": card, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "model": repo_of(name),
           "layout": layout}
    cuda = torch.cuda.is_available()
    slab = slab_path(work, shape_of(name), args.tiny)
    rec["shape"] = shape_of(name)  # train_step.py --family of the slab
    rec["encoder_params_B"] = json.loads(params_file(hub_dir(args), repo_of(name)).read_text())["encoder_params"] / 1e9
    if cuda and not args.tiny:
        torch.cuda.empty_cache()
        rec.update(cap_to_card(card))
    cfg = config_of(args, name, slab, layout)
    rec["files"] = {k: v for k, v in cfg.encoder_files.items() if v}
    rec.update(batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, resolution=cfg.resolution, rank=cfg.rank,
               prefetch=cfg.prefetch, host=cfg.host, vram_budget=cfg.vram_budget, target_frames=cfg.target_frames,
               frame_extraction=cfg.frame_extraction, data=Path(cfg.data).name)
    rec["host_budget_GB"] = cfg.host_budget_bytes / 1e9 if cfg.host_budget_bytes else None
    with hub_cache(hub_dir(args)), HostPeaks(PHASES, ram_files=args.files_dir) as peaks:
        log(f"{name}: training (load, caching, steps) from {wall_clock()}")
        train_config(cfg, family, rec, peaks)
        if layout == "hub" and "baseline" not in args.skip:
            log(f"{name}: the steps with no host budget from {wall_clock()}")
            baseline_steps(cfg, rec, peaks)
        else:
            not_measured(rec, "step_s_no_budget", "step_vs_no_budget", "step_s_filled", "step_vs_no_budget_filled",
                         "copy_wait_s_no_budget", "copy_wait_s_filled")
        if "sampling" in args.skip:
            emit(summed(peaks.fields(not_measured(rec, *SAMPLE_FIELDS)), cuda, card))
            return
        if args.run:  # the figures so far, should sampling run past the timeout (in_its_own_process keeps them)
            so_far = not_measured({**rec, "what": PARTIAL}, *SAMPLE_FIELDS)
            print(json.dumps(summed(peaks.fields(so_far), cuda, card), sort_keys=True, default=str), flush=True)
        log(f"{name}: sampling from {wall_clock()}")
        sample_config(args, slab, cfg, rec, peaks)
    emit(summed(peaks.fields(rec), cuda, card))


SAMPLE_FIELDS = ("sample_s", "sample_steps", "sample_size", "sample_frames", "sample_placement",
                 "sample_peak_reserved_GB")
PARTIAL = "card-until-sampling"  # a record's ``what`` before sampling
SKIPPABLE = ("baseline", "sampling")  # --skip


def wall_clock() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S UTC")


def summed(rec: dict, cuda: bool, card: int) -> dict:
    """``rec`` with its run's host peak against the budget and its GPU peak against the card."""
    anon = [rec[f"{phase}_own_peak_GB"] for phase in PHASES if rec[f"{phase}_own_peak_GB"] is not None]
    rec["host_peak_GB"] = max(anon) if anon else None
    if rec["host_budget_GB"] is None or rec["host_peak_GB"] is None:
        not_measured(rec, "within_host_budget")
    else:
        rec["within_host_budget"] = rec["host_peak_GB"] <= rec["host_budget_GB"]
    if cuda:
        rec["peak_reserved_GB"] = max(rec[k] for k in ("cache_peak_reserved_GB", "train_peak_reserved_GB",
                                                       "sample_peak_reserved_GB") if rec[k] is not None)
        rec["fits_card"] = rec["peak_reserved_GB"] * 1e9 <= card * GIB
    else:
        not_measured(rec, "peak_reserved_GB", "fits_card")
    return rec


def config_of(args, name: str, slab: Path, layout: str):
    """The example config ``name`` on ``slab`` for ``--steps`` steps, with noise images at its largest resolution (a
    video family's: noise clips, :func:`write_clips`), its encoders those of its Hub ID (:func:`repo_of`), in ``layout``
    (:data:`LAYOUTS`). ``--tiny``: 64 px, 16 text tokens, and a video config's windows :data:`TINY_FRAMES` frames."""
    from squareq.train.clips import FAMILY_FPS
    from squareq.train.config import load_config

    work, family = Path(args.workdir), CARDS[name][0]
    stamp = f"{name}-{time.time_ns()}"
    overrides = {"slab": str(slab), "model": repo_of(name), "output": str(work / f"out-{stamp}"),
                 "cache_dir": str(work / f"cache-{stamp}"),
                 "steps": args.steps, "save_every": 0, "sample_every": 0, "seed": 0}
    if args.tiny:
        overrides.update(resolution=64, max_sequence_length=16)
        if family in FAMILY_FPS:
            overrides.update(target_frames=[TINY_FRAMES], max_frames=TINY_FRAMES)
    if layout == "comfyui":
        overrides.update({flag: str(path) for flag, path in comfyui_files(hub_dir(args), shape_of(name)).items()})
    cfg = load_config(ROOT / "examples" / f"{name}.toml", overrides)
    res = max(cfg.resolution)
    if family in FAMILY_FPS:
        frames = clip_frames(cfg.frame_settings, FAMILY_FPS[family])
        cfg.data = str(work / f"clips-{res}x{frames}")
        write_clips(Path(cfg.data), CLIPS, frames, res)
    else:
        cfg.data = str(work / f"data-{res}")
        write_data(Path(cfg.data), IMAGES, res)
    if name in EDIT_REPOS:  # edit pairs: a noise control of each target's name and size (--tiny: at its 64 px too)
        write_data(work / f"controls-{res}", IMAGES, res)
        cfg = dataclasses.replace(cfg, control_dir=[str(work / f"controls-{res}")],
                                  control_resolution=[res, res] if args.tiny else cfg.control_resolution)
    return cfg


def clip_frames(settings, family_fps: float) -> int:
    """The frames a clip needs for the longest window ``settings`` cut (``max_frames`` for ``full``); with
    ``source_fps``, frames are dropped to ``family_fps`` first, so enough more that the longest still fits."""
    needed = settings.max_frames if settings.frame_extraction == "full" else max(settings.target_frames)
    if settings.source_fps is None:
        return needed
    return math.ceil(needed * settings.source_fps / family_fps) + 1


def write_clips(folder: Path, count: int, frames: int, side: int) -> None:
    """``count`` noise clips as folders of ``frames`` PNG frames of ``side``² pixels, each named by the caption beside
    it (``clip0/`` and ``clip0.txt``: docs/train.md, "Clips"); a clip whose caption is there was written whole."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        caption = folder / f"clip{i}.txt"
        if caption.is_file():
            continue
        (folder / f"clip{i}").mkdir(parents=True, exist_ok=True)
        for j in range(frames):
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                folder / f"clip{i}" / f"{j:04d}.png", compress_level=1)  # noise does not compress: spend no time
        caption.write_text(f"a video of sample {i}, noise texture")  # last: the clip is whole


def train_config(cfg, family: str, rec: dict, peaks: HostPeaks) -> None:
    """``squareq.train``'s trainer on ``cfg``, its encoders loaded from the Hub cache: wall time, caching and the
    steps' figures (from its metrics.jsonl) into ``rec``; host phases ``load``, ``caching``, then ``steps``."""
    import torch

    from squareq.train.loop import train

    measure: dict = {}
    start = time.perf_counter()
    with watched_encoders(measure, peaks, ("load", "caching", "steps")), watched_host_plan(rec):
        train(cfg, echo=lambda s: log(s))  # the trainer frees the encoders before a step
    peaks.phase(None)
    rec["train_wall_s"] = time.perf_counter() - start
    rec.update(measure)
    rows, timed = step_rows(Path(cfg.output))
    rec["steps"] = len(rows)
    rec["step_s"], rec["step_times"], wait = step_figures(rows, timed)
    set_figure(rec, "copy_wait_s", wait)
    rec["losses_finite"] = all(r["loss"] == r["loss"] and abs(r["loss"]) < float("inf") for r in rows)
    if torch.cuda.is_available():
        rec["copied_GB_per_step"] = statistics.median(r["copied_GB"] for r in timed)
        rec["pcie4_copy_s_arithmetic"] = rec["copied_GB_per_step"] * 1e9 / PCIE4_BYTES_PER_S
        rec["train_peak_reserved_GB"] = max(r["peak_reserved_GB"] for r in rows)
    else:  # the trainer counts copies and GPU memory on a GPU only (its metrics.jsonl has none on a CPU)
        not_measured(rec, "copied_GB_per_step", "pcie4_copy_s_arithmetic", "train_peak_reserved_GB",
                     "cache_peak_reserved_GB", "cache_peak_allocated_GB")


def step_rows(out: Path) -> tuple[list[dict], list[dict]]:
    """The run's metrics.jsonl rows, and those a median step is taken over: all but the first, which sizes the ring,
    and but those in which torch.compile compiled (a new bucket's first step, seconds to a minute: which arm pays it
    depends on the order the arms run in, not on its host memory)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows[1:] if r.get("compile_s", 0.0) < 1.0]
    return rows, steady or rows[1:] or rows


def baseline_steps(cfg, rec: dict, peaks: HostPeaks) -> None:
    """The same steps with ``host_budget = "auto"`` (this machine's memory) on the filled cache, then with the
    config's budget again on it: ``step_s_no_budget`` and the budgeted step's ratio to it, both as the user's first
    run measured it (after caching in the same process) and with both arms on the filled cache (``_filled``), which
    tells the budget's effect from that of the caching before it. ``peaks`` reads the host memory in each arm as it
    did in the first run's steps (its phases of their own, not reported), so the arms differ in nothing else."""
    for suffix, budget, label in (("_no_budget", "auto", "no budget"),
                                  ("_filled", cfg.host_budget, "budget, filled cache")):
        rec[f"step_s{suffix}"], rec[f"step_times{suffix}"], wait = filled_cache_steps(cfg, budget, label, peaks)
        set_figure(rec, f"copy_wait_s{suffix}", wait)
    rec["step_vs_no_budget"] = rec["step_s"] / rec["step_s_no_budget"]
    rec["step_vs_no_budget_filled"] = rec["step_s_filled"] / rec["step_s_no_budget"]


def filled_cache_steps(cfg, host_budget, label: str, peaks: HostPeaks) -> tuple[float, list[float], float | None]:
    """The config's steps with ``host_budget`` on the cache the first run filled: the median step, every step's
    seconds, and the median seconds a step waited on the weights' copies (:func:`step_figures`)."""
    from squareq.train.loop import train

    out = Path(f"{cfg.output}-{label.replace(' ', '-').replace(',', '')}")
    peaks.phase(label)
    try:
        train(dataclasses.replace(cfg, output=str(out), host_budget=host_budget),
              echo=lambda s: log(f"[{label}] {s}"))
    finally:
        peaks.phase(None)
    return step_figures(*step_rows(out))


def step_figures(rows: list[dict], timed: list[dict]) -> tuple[float, list[float], float | None]:
    """From a run's :func:`step_rows`: the median step, every step's seconds, and the median seconds a step waited
    on the weights' host-to-device copies (the trainer's ``copy_wait_s``; None on a CPU, whose metrics have none):
    where arms of the same plan differ in step time, it says whether the copies (where the slab's pages lie, the
    bus) or the compute and the host differ."""
    waits = [r["copy_wait_s"] for r in timed if "copy_wait_s" in r]
    return (statistics.median(r["seconds"] for r in timed), [round(r["seconds"], 3) for r in rows],
            statistics.median(waits) if waits else None)


@contextlib.contextmanager
def watched_host_plan(rec: dict):
    """Within: the trainer's host plan (``squareq.train.loop.train_host_plan``) recorded as it is made: expected
    peak, where the slab waits, the encoders read through rings."""
    from squareq.train import loop

    real = loop.train_host_plan

    def watched(*args, **kwargs):
        plan = real(*args, **kwargs)
        rec["host_plan_peak_GB"] = plan.peak / 1e9
        rec["host_plan_slab"] = plan.slab_host
        rec["host_plan_ring"] = list(plan.encoders.ring) if plan.encoders is not None else []
        return plan

    loop.train_host_plan = watched
    try:
        yield
    finally:
        loop.train_host_plan = real


def sample_config(args, slab: Path, cfg, rec: dict, peaks: HostPeaks) -> None:
    """``squareq sample``'s path, its encoders and VAE loaded from the Hub cache: one image at the config's largest
    resolution; its figures into ``rec``, host phase ``sampling``."""
    import torch

    from squareq.train import sample

    sample_measure: dict = {}
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    peaks.phase("sampling")
    with watched_encoders(sample_measure, peaks):
        images = sample.sample_images(slab, [SAMPLE_PROMPT], model=cfg.model, files=cfg.encoder_files,
                                      controls=tuple(str(next(Path(d).glob("*.png"))) for d in cfg.control_dir or []),
                                      resolution=max(cfg.resolution), steps=args.sample_steps,
                                      frames=max(cfg.target_frames),
                                      max_sequence_length=cfg.max_sequence_length, host=cfg.host,
                                      host_budget=cfg.host_budget)
    peaks.phase(None)
    rec["sample_s"] = time.perf_counter() - start
    rec["sample_steps"] = args.sample_steps
    first = images[0] if not isinstance(images[0], list) else images[0][0]  # a video family's clip: its frames
    rec["sample_size"] = list(first.size)
    rec["sample_frames"] = len(images[0]) if isinstance(images[0], list) else 1
    if "placement" in sample_measure:  # FLUX.1's own path; a family's diffusers pipeline places its own encoders
        rec["sample_placement"] = sample_measure["placement"]["streamed"]
    else:
        not_measured(rec, "sample_placement")
    if cuda:  # the denoising's peak, or the prompt encoding's before it where that was higher
        rec["sample_peak_reserved_GB"] = max(torch.cuda.max_memory_reserved() / 1e9,
                                             sample_measure.get("cache_peak_reserved_GB", 0.0))
    else:
        not_measured(rec, "sample_peak_reserved_GB")


def tiny_flux2_slab(path: Path) -> None:
    """A toy FLUX.2 slab whose text width is three stacked Mistral layers' (3 x 16): the built-in tiny-flux2's (32) is
    not a multiple of three, so FLUX.2's pipeline could not encode for it."""
    import diffusers
    import torch

    from squareq.compiler.plain import PlainOptions, write_rtn_slab
    from squareq.models import ADAPTERS
    from squareq.quant import QuantSpec

    torch.manual_seed(0)
    model = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                              timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4)).eval()
    write_rtn_slab(model, ADAPTERS["flux2"].blocks(model), {}, path, PlainOptions(
        default_spec=QuantSpec(bits=8, group_size=16), clip_search=False, family="flux2", source="cards.py tiny",
        overwrite=True))


def ensure_slab(args, shape: str) -> None:
    """The slab of shape key ``shape`` in the workdir: train_step.py's slab phase (``--family shape``)."""
    work = Path(args.workdir)
    if args.tiny and shape == "flux2":
        tiny_flux2_slab(slab_path(work, shape, True))
        return
    if args.tiny:
        import train_step

        log(f"slab for {shape}: train_step.py's slab phase in this process")
        train_step.slab_here(work, shape, tiny=True)
        return
    cmd = ["--family", shape, "--only", "slab", "--workdir", str(work), "--out", str(work / f"slab-{shape}")]
    log(f"slab for {shape}: train_step.py {' '.join(cmd)}")
    subprocess.run([sys.executable, str(HERE / "train_step.py"), *cmd], check=True, stdout=sys.stderr)


def card_table(records: list[dict]) -> str:
    def gb(key):
        return lambda r: NOT_MEASURED if r[key] is None else f"{r[key]:.2f}"

    def encoders(r):
        return f"{r['encoder_params_B']:.2f} B ({', '.join(r['placement']['streamed']) or 'none'})"

    def cache(r):
        return f"{r['cache_s']:.1f} / {gb('cache_peak_reserved_GB')(r)} " \
               f"(planned {r['placement']['expected_peak_bytes'] / 1e9:.2f})"

    def sample(r):
        return f"{r['sample_s']:.1f} / {gb('sample_peak_reserved_GB')(r)}"

    columns = [Column("config", "config"), Column("files", "layout"),
               Column("card", "card_GiB", lambda r: f"{r['card_GiB']} GiB"),
               Column("encoders (streamed)", "encoder_params_B", encoders, also=("placement",)),
               Column("cache s / peak GB", "cache_s", cache, also=("cache_peak_reserved_GB", "placement")),
               Column("step s", "step_s", ".3f"),
               Column("step without a host budget s (ratio)", "step_s_no_budget", step_ratio,
                      also=("step_vs_no_budget", "step_vs_no_budget_filled")),
               Column("train peak GB", "train_peak_reserved_GB", gb("train_peak_reserved_GB")),
               Column("copied GB / step", "copied_GB_per_step", ".1f"),
               Column("at PCIe 4.0 x16 (arithmetic) s", "pcie4_copy_s_arithmetic", ".2f"),
               Column("sample s / peak GB", "sample_s", sample, also=("sample_peak_reserved_GB",)),
               Column("fits", "fits_card"),
               Column("host budget GB", "host_budget_GB", ".0f"),
               Column("host plan: peak GB, slab, rings", "host_plan_peak_GB", plan_cell,
                      also=("host_plan_slab", "host_plan_ring")),
               Column("host peak GB (RssAnon+RssShmem)", "host_peak_GB", ".2f"),
               Column("within host budget", "within_host_budget"),
               Column("error", None, lambda r: r.get("error", "")[:120])]
    columns[-6:-6] = [Column(f"{phase} host peak GB (RssAnon+RssShmem / RSS)", f"{phase}_own_peak_GB",
                             host_cell(phase), also=(f"{phase}_rss_peak_GB", f"{phase}_rss_anon_peak_GB"))
                      for phase in PHASES]
    return common.table(records, columns, where={"what": "card"})


def step_ratio(r) -> str:
    if r["step_s_no_budget"] is None:
        return NOT_MEASURED
    filled = r["step_vs_no_budget_filled"]
    return f"{r['step_s_no_budget']:.3f} ({r['step_vs_no_budget']:.2f}x; filled cache {filled:.2f}x)"


def plan_cell(r) -> str:
    return f"{r['host_plan_peak_GB']:.2f}, {r['host_plan_slab']}, {', '.join(r['host_plan_ring']) or 'none'}"


def host_cell(phase: str):
    def cell(r):
        rss = r[f"{phase}_rss_peak_GB"]
        return f"{r[f'{phase}_own_peak_GB']:.2f} / {NOT_MEASURED if rss is None else f'{rss:.2f}'}"
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--configs", default=",".join(CARDS))
    parser.add_argument("--steps", type=int, help=f"training steps (default 5; --tiny: {TINY_STEPS})")
    parser.add_argument("--sample-steps", type=int, help=f"denoising steps (default 20; --tiny: {TINY_STEPS})")
    parser.add_argument("--tiny", action="store_true", help="tiny slabs and encoders, every config in this process")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one config, in this process
    parser.add_argument("--layout", default="hub", help=argparse.SUPPRESS)  # --run's files (LAYOUTS)
    parser.add_argument("--timeout", type=float, default=540)
    parser.add_argument("--layouts", default="hub,comfyui",
                        help="the layouts of FLUX.1's files to run (hub, comfyui): the device's time per session")
    parser.add_argument("--files-dir", help="where the encoder files are written (default: the workdir), e.g. a RAM "
                        "file system where the disk is too small; the pages of its files the process maps are "
                        "subtracted from its own memory, as page cache on a disk would not count")
    parser.add_argument("--skip", default="", help="phases to leave out, comma-separated: baseline (the steps with "
                        "no host budget), sampling; a config too long for one device call runs in two, each "
                        "measuring the phases it keeps")
    parser.add_argument("--keep-files", action="store_true",
                        help="keep each shape's encoder files in the workdir after its configs ran (default: removed)")
    args = parser.parse_args()
    args.skip = [p for p in args.skip.split(",") if p]
    if set(args.skip) - set(SKIPPABLE):
        parser.error(f"--skip: {', '.join(sorted(set(args.skip) - set(SKIPPABLE)))} is not a phase it can leave out; "
                     f"choose from {', '.join(SKIPPABLE)}.")
    args.steps = args.steps or (TINY_STEPS if args.tiny else 5)
    args.sample_steps = args.sample_steps or (TINY_STEPS if args.tiny else 20)
    if args.run:
        run_config(args, args.run, args.layout)
        return
    examples = {p.stem for p in EXAMPLES.glob("*.toml")}
    if examples != set(CARDS):
        sys.exit(f"cards.py: CARDS must name every example config and nothing else; examples without a card: "
                 f"{sorted(examples - set(CARDS)) or 'none'}, cards without an example: "
                 f"{sorted(set(CARDS) - examples) or 'none'}.")
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CARDS]
    if unknown:
        parser.error(f"--configs: {', '.join(unknown)} are not example configs; choose from {', '.join(CARDS)}.")
    for shape in dict.fromkeys(map(shape_of, names)):  # one slab and snapshot at a time: the configs on them
        group = [n for n in names if shape_of(n) == shape]
        ensure_slab(args, shape)
        repos = list(dict.fromkeys(map(repo_of, group)))
        for repo in repos:
            write_user_files(args, shape, CARDS[group[0]][0], repo)
        for name, layout in runs(group, args.tiny, args.layouts.split(",")):
            log(f"config {name}, files as {layout}")
            if args.tiny:
                in_this_process(args, name, layout)
            else:
                in_its_own_process(args, name, layout)
            common.write_records(args.out, "cards.jsonl")
        if not (args.tiny or args.keep_files):  # the next shape's files need the disk (FLUX.2's encoder: 48 GB)
            remove_user_files(args, shape, repos)
    print(card_table(RECORDS))


def runs(names: list[str], tiny: bool, layouts: list[str] | None = None) -> list[tuple[str, str]]:
    """(config, layout) to run: each config in each of its family's layouts, an edit config in the Hub layout of its
    edit pipeline only (``layouts``: those of them only; ``tiny``: the layouts after the first for the family's first
    config only, which runs the same loaders in seconds less)."""
    done: set[str] = set()
    out = []
    for name in names:
        family = CARDS[name][0]
        layouts_of = LAYOUTS[family][:1] if name in EDIT_REPOS else LAYOUTS[family]
        out += [(name, layout) for i, layout in enumerate(layouts_of)
                if not (tiny and i and family in done) and (layouts is None or layout in layouts)]
        done.add(family)
    return out


def in_this_process(args, name: str, layout: str) -> None:
    """``--tiny``: the config in this process, a failure an error record."""
    try:
        run_config(args, name, layout)
    except Exception as exc:  # noqa: BLE001 - the next config still runs
        import traceback

        traceback.print_exc()
        emit({"what": "card", "config": name, "layout": layout, "error": f"{type(exc).__name__}: {exc}"[:500]})


def in_its_own_process(args, name: str, layout: str) -> None:
    """The config in a process of its own (its allocator capped to the card), its JSON lines echoed."""
    cmd = [sys.executable, __file__, "--workdir", args.workdir, "--run", name, "--layout", layout,
           *(["--files-dir", args.files_dir] if args.files_dir else []),
           "--steps", str(args.steps), "--sample-steps", str(args.sample_steps), "--skip", ",".join(args.skip)]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        lines = [rec for rec in lines if rec["what"] != PARTIAL]
        if done.returncode != 0 or not lines:  # what it measured before it stopped is kept, as for a timeout
            emit(cut_record(name, layout, done.stdout, f"exit code {done.returncode}"))
            return
        for rec in lines:
            RECORDS.append(rec)
            print(json.dumps(rec, sort_keys=True), flush=True)
    except subprocess.TimeoutExpired as exc:
        emit(cut_record(name, layout, exc.stdout, f"timed out after {args.timeout:.0f} s (--timeout)"))


def cut_record(name: str, layout: str, stdout: str | bytes | None, why: str) -> dict:
    """The record of a config whose process was cut or failed while sampling: its figures up to sampling (the last
    :data:`PARTIAL` line it printed), sampling's not measured; else only ``why``."""
    text = stdout.decode() if isinstance(stdout, bytes) else stdout or ""
    partial = [json.loads(line) for line in text.splitlines() if line.startswith("{") and f'"{PARTIAL}"' in line]
    if not partial:
        return {"what": "card", "config": name, "layout": layout, "error": why}
    return {**partial[-1], "what": "card", "error": f"{why}, while sampling"}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
