"""Real diffusers pipeline folders around the built-in tiny denoisers (seeded, offline), for the trainer's
pipeline-folder path: each family's own pipeline class, text encoders and tokenizers, VAE and scheduler."""
from pathlib import Path

import torch

from squareq.models import load_builtin
from squareq.models.tiny_pipeline import (
    build_tiny_tokenizers,
    build_tiny_vae,
    tiny_clip_config,
    tiny_t5_config,
)

from ..text_models import char_tokenizer


def _clip(tokenizer, width: int, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(CLIPTextConfig(**{**tiny_clip_config(len(tokenizer), width), "num_attention_heads": 2})).eval()


def _t5(tokenizer, width: int, umt5: bool = False, layers: int = 2):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config = {**tiny_t5_config(len(tokenizer), width), "num_layers": layers}
    if umt5:
        return UMT5EncoderModel(UMT5Config(**config)).eval()
    return T5EncoderModel(T5Config(**config)).eval()


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0]).eval()


def _flux2_parts():
    """FLUX.2's pipeline parts at toy size: a Mistral-3 text encoder (31 layers, since the pipeline reads the hidden
    states of layers 10, 20 and 30), a character tokenizer whose chat template keeps the user's text, the FLUX.2 VAE,
    and a transformer whose text width is the three stacked layers' (3 x 16)."""
    import diffusers
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tokenizer = char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{% for c in m['content'] %}"
                               "{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}")
    text = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=31, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=16, head_dim=8)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision)).eval()
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                                       norm_num_groups=4).eval()
    transformer = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                                    timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4)).eval()
    return dict(vae=vae, text_encoder=encoder, tokenizer=tokenizer, transformer=transformer)


def _qwen_image_parts(denoiser, layers: int = 2):
    """Qwen-Image's pipeline parts at toy size: a Qwen2.5-VL text encoder as wide as the transformer's text input, a
    character tokenizer and the Qwen-Image (video-style) VAE."""
    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                num_key_value_heads=1, bos_token_id=2, eos_token_id=3, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0]).eval()
    return dict(vae=vae, text_encoder=encoder, tokenizer=char_tokenizer(), transformer=denoiser)


def write_qwen_image_edit_folder(folder: Path, plus: bool = False, text_layers: int = 2, seed: int = 11) -> Path:
    """A QwenImageEditPipeline folder (``plus``: QwenImageEditPlusPipeline) around tiny-qwen-image, in the Hub's
    layout: a Qwen2.5-VL text encoder with a vision tower, its character tokenizer with Qwen's vision tokens, and
    ``processor/`` holding that tokenizer and a Qwen2-VL image processor (at most 16 vision tokens an image) under
    model_index.json's ``["transformers", "Qwen2VLProcessor"]``, as Qwen/Qwen-Image-Edit names it."""
    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from squareq.sources.vl_processor import add_vision_tokens, image_only_processor, save_in_hub_layout

    torch.manual_seed(seed)
    denoiser, _ = load_builtin("tiny-qwen-image")
    parts = _qwen_image_parts(denoiser, text_layers)
    tokenizer = char_tokenizer()
    ids = add_vision_tokens(tokenizer)
    config = parts["text_encoder"].config
    parts["text_encoder"] = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=config.text_config.to_dict(), vision_config=config.vision_config.to_dict(), **ids)).eval()
    images = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), processor=image_only_processor(images, tokenizer),
        **{**parts, "tokenizer": tokenizer}).save_pretrained(folder, safe_serialization=True)
    save_in_hub_layout(folder, images, tokenizer)
    return folder


def _z_image_parts(denoiser, layers: int = 2):
    """Z-Image's pipeline parts at toy size: a Qwen3 text encoder as wide as the transformer's caption features, a
    character tokenizer whose chat template keeps the user's text, and the FLUX-style toy VAE (4 latent channels)."""
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    encoder = Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=denoiser.config.cap_feat_dim, intermediate_size=32,
                                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     bos_token_id=2, eos_token_id=3, pad_token_id=0)).eval()
    return dict(vae=build_tiny_vae(), text_encoder=encoder, tokenizer=tokenizer, transformer=denoiser)


def _ltx_video_vae():
    """LTX-Video's VAE at toy size: 32x spatial (patch 4, three 2x stages), 8 latent channels as tiny-ltx-video takes."""
    from diffusers import AutoencoderKLLTXVideo

    return AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                 decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1, 1, 1),
                                 spatio_temporal_scaling=(True, True, True, False),
                                 decoder_spatio_temporal_scaling=(True, True, True, False),
                                 decoder_inject_noise=(False,) * 5, patch_size=4, patch_size_t=1).eval()


def _hunyuan_video_parts(denoiser, clip_tok, layers: int = 3):
    """HunyuanVideo's pipeline parts at toy size: a Llama text encoder as wide as the transformer's text input (the
    pipeline reads its second-to-last layer), a character tokenizer, CLIP for the pooled projection, and the
    HunyuanVideo VAE (8x spatial, 4x temporal)."""
    import diffusers
    from transformers import LlamaConfig, LlamaModel

    cfg = denoiser.config
    llama = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=cfg.text_embed_dim, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   bos_token_id=2, eos_token_id=3, pad_token_id=0)).eval()
    vae = diffusers.AutoencoderKLHunyuanVideo(latent_channels=cfg.in_channels, block_out_channels=(8, 8, 8, 8),
                                              layers_per_block=1, norm_num_groups=4,
                                              down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                              up_block_types=("HunyuanVideoUpBlock3D",) * 4).eval()
    return dict(text_encoder=llama, tokenizer=char_tokenizer(), transformer=denoiser, vae=vae,
                text_encoder_2=_clip(clip_tok, cfg.pooled_projection_dim), tokenizer_2=clip_tok)


def build_pipeline(name: str, prediction_type: str = "epsilon", text_layers: int = 2):
    """The diffusers pipeline of built-in model ``name`` (tiny-sd15, tiny-sdxl, tiny-sd3, tiny-chroma, tiny-wan,
    tiny-qwen-image, tiny-z-image, tiny-ltx-video, tiny-hunyuan-video, tiny-flux) or of a toy FLUX.2 (tiny-flux2: its own transformer, whose text width fits a Mistral encoder).
    ``text_layers``: the T5, UMT5 and Qwen2.5-VL text encoders' layers (FLUX.2's Mistral has 31)."""
    import diffusers

    torch.manual_seed(11)
    if name == "tiny-flux":  # FLUX.1's folder: the tiny-flux pipeline, its T5 ``text_layers`` deep
        from squareq.models import build_tiny_flux_pipeline

        pipe = build_tiny_flux_pipeline()
        pipe.text_encoder_2 = _t5(pipe.tokenizer_2, pipe.text_encoder_2.config.d_model, layers=text_layers)
        return pipe
    if name == "tiny-flux2":
        return diffusers.Flux2Pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), **_flux2_parts())
    denoiser, _ = load_builtin(name)
    clip_tok, t5_tok = build_tiny_tokenizers()
    flow = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ddpm = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                   prediction_type=prediction_type)
    if name == "tiny-sd15":
        return diffusers.StableDiffusionPipeline(vae=build_tiny_vae(), text_encoder=_clip(clip_tok, 32),
                                                 tokenizer=clip_tok, unet=denoiser, scheduler=ddpm, safety_checker=None,
                                                 feature_extractor=None, requires_safety_checker=False)
    if name == "tiny-sdxl":
        return diffusers.StableDiffusionXLPipeline(vae=build_tiny_vae(), text_encoder=_clip(clip_tok, 16),
                                                   text_encoder_2=_clip(clip_tok, 16, projection=True),
                                                   tokenizer=clip_tok, tokenizer_2=clip_tok, unet=denoiser,
                                                   scheduler=ddpm)
    if name == "tiny-sd3":
        return diffusers.StableDiffusion3Pipeline(transformer=denoiser, scheduler=flow, vae=build_tiny_vae(),
                                                  text_encoder=_clip(clip_tok, 8, projection=True), tokenizer=clip_tok,
                                                  text_encoder_2=_clip(clip_tok, 8, projection=True),
                                                  tokenizer_2=clip_tok, text_encoder_3=_t5(t5_tok, 32),
                                                  tokenizer_3=t5_tok)
    if name == "tiny-chroma":
        return diffusers.ChromaPipeline(scheduler=flow, vae=build_tiny_vae(), text_encoder=_t5(t5_tok, 32),
                                        tokenizer=t5_tok, transformer=denoiser)
    if name == "tiny-qwen-image":
        return diffusers.QwenImagePipeline(scheduler=flow, **_qwen_image_parts(denoiser, text_layers))
    if name == "tiny-z-image":
        return diffusers.ZImagePipeline(scheduler=flow, **_z_image_parts(denoiser, text_layers))
    if name == "tiny-ltx-video":
        return diffusers.LTXPipeline(scheduler=flow, vae=_ltx_video_vae(), tokenizer=t5_tok, transformer=denoiser,
                                     text_encoder=_t5(t5_tok, denoiser.config.caption_channels, layers=text_layers))
    if name == "tiny-hunyuan-video":
        return diffusers.HunyuanVideoPipeline(scheduler=flow, **_hunyuan_video_parts(denoiser, clip_tok, text_layers + 1))
    if name == "tiny-wan":
        return diffusers.WanPipeline(tokenizer=t5_tok, text_encoder=_t5(t5_tok, 32, umt5=True, layers=text_layers),
                                     transformer=denoiser,
                                     vae=_wan_vae(), scheduler=flow)
    raise KeyError(name)


def write_pipeline(name: str, folder: Path, prediction_type: str = "epsilon", text_layers: int = 2) -> Path:
    """``build_pipeline(name)`` saved as a diffusers folder (safetensors)."""
    build_pipeline(name, prediction_type, text_layers).save_pretrained(folder, safe_serialization=True)
    return folder


# what the Hub's Würstchen folders declare (warp-ai/wuerstchen-prior, warp-ai/wuerstchen): the "wuerstchen" library,
# which diffusers 0.42 no longer resolves (huggingface/diffusers#14008)
WUERSTCHEN_HUB_INDEX = {
    "prior": {"_class_name": "WuerstchenPriorPipeline", "_diffusers_version": "0.21.0.dev0", "latent_mean": 42.0,
              "latent_std": 1.0, "resolution_multiple": 42.67, "prior": ["wuerstchen", "WuerstchenPrior"],
              "scheduler": ["diffusers", "DDPMWuerstchenScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
              "tokenizer": ["transformers", "CLIPTokenizerFast"]},
    "decoder": {"_class_name": "WuerstchenDecoderPipeline", "_diffusers_version": "0.21.0.dev0",
                "decoder": ["wuerstchen", "WuerstchenDiffNeXt"], "latent_dim_scale": 10.67,
                "scheduler": ["diffusers", "DDPMWuerstchenScheduler"],
                "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizerFast"],
                "vqgan": ["wuerstchen", "PaellaVQModel"]},
}


def write_wuerstchen_folders(folder: Path, seed: int = 11) -> tuple[Path, Path]:
    """The prior's and the decoder's pipeline folders around the tiny Würstchen denoisers, in the Hub's layout: each
    stage's CLIP as wide as its denoiser's text input, a toy Stage A (PaellaVQ, 4x), the Hub's model_index.json."""
    import json

    from diffusers import DDPMWuerstchenScheduler
    from diffusers.pipelines.deprecated.wuerstchen import (
        PaellaVQModel,
        WuerstchenDecoderPipeline,
        WuerstchenPriorPipeline,
    )

    torch.manual_seed(seed)
    clip_tok, _ = build_tiny_tokenizers()
    prior, _ = load_builtin("tiny-wuerstchen-prior")
    decoder, _ = load_builtin("tiny-wuerstchen-decoder")
    vqgan = PaellaVQModel(up_down_scale_factor=2, levels=2, bottleneck_blocks=1, embed_dim=8, latent_channels=4,
                          num_vq_embeddings=16).eval()
    pipes = {"prior": WuerstchenPriorPipeline(tokenizer=clip_tok, text_encoder=_clip(clip_tok, prior.config.c_cond),
                                              prior=prior, scheduler=DDPMWuerstchenScheduler()),
             "decoder": WuerstchenDecoderPipeline(tokenizer=clip_tok,
                                                  text_encoder=_clip(clip_tok, decoder.config.clip_embd),
                                                  decoder=decoder, scheduler=DDPMWuerstchenScheduler(), vqgan=vqgan)}
    for stage, pipe in pipes.items():
        pipe.save_pretrained(folder / stage, safe_serialization=True)
        (folder / stage / "model_index.json").write_text(json.dumps(WUERSTCHEN_HUB_INDEX[stage], indent=2))
    return folder / "prior", folder / "decoder"


def lora_in_pipeline(name: str, slab: Path, lora_folder: Path, lora_file: Path) -> tuple[float, float]:
    """How far the diffusers pipeline of ``name``'s denoiser (the slab's weights, dequantized) is from the slab
    streamed with the LoRA ``lora_file``, on the family's calibration inputs, before and after the pipeline's own
    ``load_lora_weights(lora_folder)``: the relative mean squared errors (the LoRA changes the output: the first is
    large; diffusers reads it as trained: the second is small)."""
    from squareq import runtime
    from squareq.slab import open_slab
    from squareq.train.lora_attach import attach_lora
    from squareq.train.lora_reader import load_lora

    model, adapter = load_builtin(name)
    kwargs = adapter.calibration_inputs(model, 1, 3).kwargs
    ours = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))
    attach_lora(ours, *load_lora(lora_file))
    pipe = build_pipeline(name)
    denoiser = getattr(pipe, adapter.component).to(torch.bfloat16)
    denoiser.load_state_dict(open_slab(slab).dequantized_state_dict())

    def run(m):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**kwargs, return_dict=False)[0].float()

    expected, plain = run(ours), run(denoiser)
    runtime.runtime_of(ours).close()
    pipe.load_lora_weights(str(lora_folder))
    rel = lambda x: float((x - expected).pow(2).mean() / expected.pow(2).mean())  # noqa: E731
    return rel(plain), rel(run(denoiser))
