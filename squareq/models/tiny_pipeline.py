"""The rest of the built-in tiny FLUX pipeline: VAE, CLIP and T5 text encoders, tokenizers, scheduler.

``tiny-flux`` (see ``tiny.py``) is only the transformer. Training needs cached latents and text
embeddings, and sampling needs a VAE decoder, so this module builds the other FLUX components at toy
size from seeded configs, fully offline (no hub download, no tokenizer files fetched): the tokenizers
are built in-process from a fixed vocabulary. The result is a real ``diffusers.FluxPipeline`` that
encodes prompts, samples images and round-trips through ``save_pretrained``/``from_pretrained`` on a CPU.

The shapes follow the tiny transformer's config, as FLUX's real components follow FLUX's:
VAE latent channels = in_channels / 4 (FLUX packs 2x2 latent patches into one token), CLIP's pooled
width = pooled_projection_dim, T5's width = joint_attention_dim.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from .prompts import CALIBRATION_PROMPTS
from .tiny import TINY_FLUX_CONFIG, build_tiny_flux

# FLUX.1's VAE (black-forest-labs/FLUX.1-dev vae/config.json) at toy width: same block types, four
# blocks (so three 2x downsamples = 8x, which FluxPipeline derives from len(block_out_channels)), the
# same scaling/shift factors and no quant convs. Widths 8..16 with 4 groups keep it a few kB.
TINY_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    act_fn="silu",
    latent_channels=TINY_FLUX_CONFIG["in_channels"] // 4,
    norm_num_groups=4,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    force_upcast=True,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)

# FLUX.1-dev's scheduler/scheduler_config.json. With dynamic shifting the pipeline computes mu from
# the image token count (calculate_shift), so `shift` is only used if dynamic shifting is turned off.
TINY_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    base_shift=0.5,
    max_shift=1.15,
)

CLIP_MAX_LENGTH = 77  # CLIP-L's context; FluxPipeline reads it from tokenizer.model_max_length
T5_MAX_LENGTH = 512  # FLUX.1-dev's max_sequence_length ceiling

# Special tokens first, so their ids are fixed (T5's real layout: pad 0, eos 1, unk 2). CLIP's real
# tokenizer maps unknown text to <|endoftext|>; a separate [UNK] keeps the first eos the real one,
# which is where CLIPTextModel pools.
CLIP_SPECIALS = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", unk_token="[UNK]")
T5_SPECIALS = dict(pad_token="<pad>", eos_token="</s>", unk_token="<unk>")

_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def tiny_vocabulary() -> list[str]:
    """The shared word list (without special tokens): prompt words, characters, ``##`` continuations.

    WordPiece falls back to single characters plus ``##`` pieces, so any lower-case ASCII word still
    gets distinct ids; only non-ASCII text becomes the unknown token.
    """
    words = sorted({w for p in CALIBRATION_PROMPTS for w in re.findall(r"[a-z0-9]+", p.lower())})
    singles = [c for c in _CHARS + _PUNCT if c not in words]
    return words + singles + ["##" + c for c in _CHARS]


def _tokenizer_object(specials: list[str], template: str, pair: str):
    """A ``tokenizers.Tokenizer``: lower-casing WordPiece over the tiny vocabulary with a post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {tok: i for i, tok in enumerate(specials + tiny_vocabulary())}
    unk = next(s for s in specials if "unk" in s.lower())
    tok = Tokenizer(WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    # Split on whitespace, then isolate each punctuation character, as the vocabulary was built.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")])
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single=template, pair=pair, special_tokens=[(s, vocab[s]) for s in specials if s in template])
    return tok


def build_tiny_tokenizers():
    """``(clip_tokenizer, t5_tokenizer)`` as ``PreTrainedTokenizerFast``, built offline and deterministic.

    CLIP wraps each prompt as ``<|startoftext|> ... <|endoftext|>`` and pads with ``<|endoftext|>`` (as
    openai/clip-vit-large-patch14 does); T5 appends ``</s>`` and pads with ``<pad>``.
    """
    from transformers import PreTrainedTokenizerFast

    bos, eos, unk = CLIP_SPECIALS["bos_token"], CLIP_SPECIALS["eos_token"], CLIP_SPECIALS["unk_token"]
    clip = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object([bos, eos, unk], f"{bos} $A {eos}", f"{bos} $A {eos} $B {eos}"),
        bos_token=bos, eos_token=eos, unk_token=unk, pad_token=eos,
        model_max_length=CLIP_MAX_LENGTH, padding_side="right",
        # No token_type_ids: neither text encoder accepts them.
        model_input_names=["input_ids", "attention_mask"],
    )
    pad, eos, unk = T5_SPECIALS["pad_token"], T5_SPECIALS["eos_token"], T5_SPECIALS["unk_token"]
    t5 = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object([pad, eos, unk], f"$A {eos}", f"$A {eos} $B {eos}"),
        eos_token=eos, pad_token=pad, unk_token=unk,
        model_max_length=T5_MAX_LENGTH, padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )
    return clip, t5


def tiny_clip_config(vocab_size: int, width: int | None = None) -> dict:
    """CLIPTextModel kwargs: hidden = pooled_projection_dim (or ``width``), because FLUX feeds ``pooler_output``
    as is."""
    width = width or TINY_FLUX_CONFIG["pooled_projection_dim"]
    return dict(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=64,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",  # CLIP-L's activation
        # Ids of CLIP_SPECIALS in the tiny vocabulary. eos must not be 2: CLIPTextModel treats
        # eos_token_id == 2 as a legacy config and pools at argmax(input_ids) instead of the first eos.
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        attention_dropout=0.0,
        dropout=0.0,
    )


def tiny_t5_config(vocab_size: int, width: int | None = None) -> dict:
    """T5EncoderModel kwargs: T5 v1.1 style (gated-gelu, untied head) with d_model = joint_attention_dim (or
    ``width``)."""
    return dict(
        vocab_size=vocab_size,
        d_model=width or TINY_FLUX_CONFIG["joint_attention_dim"],
        d_kv=12,
        d_ff=96,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # google/t5-v1_1-xxl, FLUX's T5
        tie_word_embeddings=False,
        dropout_rate=0.0,  # frozen encoder: no dropout even if someone calls .train()
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def build_tiny_vae(seed: int = 0, latent_channels: int | None = None):
    """A FLUX-style ``AutoencoderKL`` at toy size: 8x downsampling, 4 latent channels (or ``latent_channels``),
    seeded init."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**{**TINY_VAE_CONFIG, "latent_channels": latent_channels or
                                TINY_VAE_CONFIG["latent_channels"]}).eval()


def build_tiny_text_encoders(seed: int = 0, t5_width: int | None = None, clip_width: int | None = None):
    """``(clip, clip_tokenizer, t5, t5_tokenizer)``: seeded tiny CLIPTextModel and T5EncoderModel (at tiny-flux's
    widths unless given)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = build_tiny_tokenizers()
    with torch.random.fork_rng(devices=[]):
        # Separate seeds per encoder so adding a layer to one leaves the other's weights unchanged.
        torch.manual_seed(seed + 2)
        clip = CLIPTextModel(CLIPTextConfig(**tiny_clip_config(len(clip_tok), clip_width))).eval()
        torch.manual_seed(seed + 3)
        t5 = T5EncoderModel(T5Config(**tiny_t5_config(len(t5_tok), t5_width))).eval()
    return clip, clip_tok, t5, t5_tok


def build_tiny_scheduler():
    """FLUX.1-dev's flow-matching Euler scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER_CONFIG)


def build_tiny_flux_pipeline(seed: int = 0):
    """A complete ``FluxPipeline`` around the ``tiny-flux`` transformer, everything seeded and offline."""
    from diffusers import FluxPipeline

    clip, clip_tok, t5, t5_tok = build_tiny_text_encoders(seed)
    return FluxPipeline(
        scheduler=build_tiny_scheduler(),
        vae=build_tiny_vae(seed),
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=build_tiny_flux(seed),
    )


def write_tiny_flux_pipeline(folder, seed: int = 0, overwrite: bool = False) -> Path:
    """Save the tiny pipeline as a diffusers folder (safetensors) at ``folder``; return its path.

    Written under a temporary sibling name and renamed when complete, so a crash never leaves a
    half-written folder that ``from_pretrained`` would half-load.
    """
    from ..slab.atomic import atomic_directory

    folder = Path(folder)
    pipe = build_tiny_flux_pipeline(seed)
    with atomic_directory(folder, overwrite=overwrite) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    return folder


__all__ = [
    "CLIP_MAX_LENGTH",
    "T5_MAX_LENGTH",
    "TINY_SCHEDULER_CONFIG",
    "TINY_VAE_CONFIG",
    "build_tiny_flux_pipeline",
    "build_tiny_scheduler",
    "build_tiny_text_encoders",
    "build_tiny_tokenizers",
    "build_tiny_vae",
    "tiny_clip_config",
    "tiny_t5_config",
    "tiny_vocabulary",
    "write_tiny_flux_pipeline",
]
