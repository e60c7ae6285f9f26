"""The built-in tiny FLUX pipeline: offline build, shapes the trainer relies on, sampling, save/reload."""
from __future__ import annotations

import pytest
import torch

from squareq.models.tiny import TINY_FLUX_CONFIG
from squareq.models.tiny_pipeline import (
    CLIP_MAX_LENGTH,
    build_tiny_flux_pipeline,
    build_tiny_text_encoders,
    build_tiny_tokenizers,
    build_tiny_vae,
    write_tiny_flux_pipeline,
)
from squareq.slab.errors import SlabError

SAMPLE = dict(height=64, width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16,
              output_type="pt")


def _sample(pipe, prompt="a cat", seed=0):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), **SAMPLE).images


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_flux_pipeline(seed=0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny") / "tiny-flux", seed=0)


def test_builds_are_deterministic_and_seeded(pipe):
    clip, clip_tok, t5, t5_tok = build_tiny_text_encoders(seed=0)
    assert _same_weights(clip, pipe.text_encoder) and _same_weights(t5, pipe.text_encoder_2)
    assert _same_weights(build_tiny_vae(seed=0), pipe.vae)
    prompt = "A neon-lit street, 85mm; zebra"
    assert clip_tok(prompt).input_ids == pipe.tokenizer(prompt).input_ids
    assert t5_tok(prompt).input_ids == pipe.tokenizer_2(prompt).input_ids
    # The seed matters: another seed gives other weights.
    other_clip, _, other_t5, _ = build_tiny_text_encoders(seed=1)
    assert not _same_weights(other_clip, clip) and not _same_weights(other_t5, t5)
    assert not _same_weights(build_tiny_vae(seed=1), pipe.vae)


def test_tokenizers_follow_clip_and_t5_conventions():
    clip_tok, t5_tok = build_tiny_tokenizers()
    assert clip_tok.model_max_length == CLIP_MAX_LENGTH and t5_tok.model_max_length == 512
    ids = clip_tok("a cat", padding="max_length", max_length=8, truncation=True).input_ids
    assert clip_tok.convert_ids_to_tokens(ids) == (
        ["<|startoftext|>", "a", "cat"] + ["<|endoftext|>"] * 5)  # CLIP pads with eos
    ids = t5_tok("a cat", padding="max_length", max_length=6, truncation=True).input_ids
    assert t5_tok.convert_ids_to_tokens(ids) == ["a", "cat", "</s>", "<pad>", "<pad>", "<pad>"]
    assert (t5_tok.pad_token_id, t5_tok.eos_token_id) == (0, 1)  # T5's real ids
    # Words outside the vocabulary fall back to characters; only non-ASCII text is unknown.
    zebra = clip_tok("zebra", add_special_tokens=False).input_ids
    assert clip_tok.convert_ids_to_tokens(zebra) == ["z", "##e", "##b", "##r", "##a"]
    assert clip_tok.decode(zebra) == "zebra"
    assert clip_tok.convert_ids_to_tokens(clip_tok("héllo", add_special_tokens=False).input_ids) == ["[UNK]"]
    # Truncation keeps the closing eos, where CLIPTextModel pools.
    long = clip_tok(" ".join(["cat"] * 200), padding="max_length", max_length=CLIP_MAX_LENGTH,
                    truncation=True).input_ids
    assert len(long) == CLIP_MAX_LENGTH and long[-1] == clip_tok.eos_token_id


def test_vae_downsamples_8x_to_4_latent_channels(pipe):
    vae = pipe.vae
    assert pipe.vae_scale_factor == 8
    assert vae.config.latent_channels == TINY_FLUX_CONFIG["in_channels"] // 4 == 4
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(image).latent_dist.sample(generator=torch.Generator().manual_seed(0))
        decoded = vae.decode(latents).sample
    assert latents.shape == (1, 4, 8, 8)
    assert decoded.shape == (1, 3, 64, 64) and torch.isfinite(decoded).all()


def test_packed_latents_are_transformer_tokens(pipe):
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    packed = pipe._pack_latents(latents, 1, 4, 8, 8)
    assert packed.shape == (1, 16, TINY_FLUX_CONFIG["in_channels"])  # 2x2 patches: 4x4 tokens of 4*4 channels
    prompt_embeds, pooled, text_ids = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
    with torch.no_grad():
        out = pipe.transformer(
            hidden_states=packed, encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
            timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), txt_ids=text_ids,
            img_ids=pipe._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)).sample
    assert out.shape == packed.shape and torch.isfinite(out).all()
    assert pipe._unpack_latents(packed, 64, 64, pipe.vae_scale_factor).equal(latents)


def test_encode_prompt_shapes_and_content(pipe):
    prompt_embeds, pooled, text_ids = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=16)
    assert prompt_embeds.shape == (1, 16, TINY_FLUX_CONFIG["joint_attention_dim"])
    assert pooled.shape == (1, TINY_FLUX_CONFIG["pooled_projection_dim"])
    assert text_ids.shape == (16, 3)
    # The prompt reaches both embeddings.
    other_embeds, other_pooled, _ = pipe.encode_prompt("a dog", prompt_2=None, max_sequence_length=16)
    assert not torch.allclose(other_embeds, prompt_embeds) and not torch.allclose(other_pooled, pooled)
    # CLIP pools at the closing eos (as CLIP-L does), not at some other token.
    ids = pipe.tokenizer("a cat", padding="max_length", max_length=CLIP_MAX_LENGTH, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = pipe.text_encoder(ids).last_hidden_state
    assert torch.equal(pooled[0], hidden[0, 3])  # <|startoftext|> a cat <|endoftext|>


def test_pipeline_samples_an_image(pipe):
    image = _sample(pipe)
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all() and image.std() > 0.01  # not a constant (e.g. fully clamped) image
    assert torch.equal(image, _sample(pipe))  # fixed generator, same image


def test_saved_folder_reloads_offline_with_identical_outputs(pipe, saved):
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    assert sorted(p.name for p in saved.parent.iterdir()) == ["tiny-flux"]  # no temporary leftovers
    weights = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*")
                     if p.suffix in (".safetensors", ".bin", ".pt"))
    assert weights == ["text_encoder/model.safetensors", "text_encoder_2/model.safetensors",
                       "transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"]

    reloaded = FluxPipeline.from_pretrained(saved, local_files_only=True)
    reloaded.set_progress_bar_config(disable=True)
    # Loaded tensors view memory-mapped files, whose alignment can send CPU kernels down other SIMD paths (the
    # sampled image differed by 1.5e-6 on torch 2.13); in fresh memory the same weights give the same bits.
    for name in ("vae", "text_encoder", "text_encoder_2", "transformer"):
        for tensor in getattr(reloaded, name).state_dict(keep_vars=True).values():
            tensor.data = tensor.data.clone()
    assert torch.equal(_sample(reloaded), _sample(pipe))

    assert _same_weights(AutoencoderKL.from_pretrained(saved / "vae", local_files_only=True), pipe.vae)
    assert _same_weights(FluxTransformer2DModel.from_pretrained(saved / "transformer", local_files_only=True),
                         pipe.transformer)
    assert _same_weights(CLIPTextModel.from_pretrained(saved / "text_encoder", local_files_only=True),
                         pipe.text_encoder)
    assert _same_weights(T5EncoderModel.from_pretrained(saved / "text_encoder_2", local_files_only=True),
                         pipe.text_encoder_2)
    for sub, tok in (("tokenizer", pipe.tokenizer), ("tokenizer_2", pipe.tokenizer_2)):
        loaded = AutoTokenizer.from_pretrained(saved / sub, local_files_only=True)
        assert loaded.model_max_length == tok.model_max_length
        assert loaded("a zebra, 85mm").input_ids == tok("a zebra, 85mm").input_ids


def test_write_refuses_to_overwrite_unless_asked(saved):
    before = (saved / "model_index.json").read_bytes()
    with pytest.raises(SlabError):
        write_tiny_flux_pipeline(saved)
    assert (saved / "model_index.json").read_bytes() == before
    assert write_tiny_flux_pipeline(saved, seed=0, overwrite=True) == saved
    assert sorted(p.name for p in saved.parent.iterdir()) == ["tiny-flux"]
