"""The built-in tiny FLUX model (`tiny-flux`): the real diffusers architecture at toy size, offline.

Weights are seeded, so every machine builds the same model. Trained diffusion transformers carry a
few hidden channels with activations and weights far larger than the rest; quantization quality
hinges on them, so the tiny model plants such outlier channels on purpose (see OUTLIER_* below).
"""
from __future__ import annotations

import torch

TINY_FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=48,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(8, 12, 12),
)

OUTLIER_CHANNELS = 3  # hidden channels made into outliers
OUTLIER_ACT_GAIN = 12.0  # embedder rows feeding them: large activations in the residual stream
OUTLIER_WEIGHT_GAIN = 4.0  # input columns reading them in block linears: weight outliers
# Two planted sensitive layers, as trained models have a few:
# the MLP of the first double block gets two hidden units 60x larger, so `ff.net.2` reads
# activation outliers; the last single block's output projection gets two output rows 300x larger
# (a group-scale spread no 4- or 6-bit grid tolerates under the default thresholds).
MLP_OUTLIER_LAYER, MLP_OUTLIER_GAIN = "transformer_blocks.0.ff.net.0.proj", 60.0
ROW_OUTLIER_LAYER, ROW_OUTLIER_GAIN = "single_transformer_blocks.1.proj_out", 300.0


def outlier_channels(hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randperm(hidden, generator=g)[:OUTLIER_CHANNELS]


def build_tiny_flux(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A ``FluxTransformer2DModel`` with the tiny config, seeded init and planted outlier channels."""
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FluxTransformer2DModel(**TINY_FLUX_CONFIG)
    hidden = TINY_FLUX_CONFIG["attention_head_dim"] * TINY_FLUX_CONFIG["num_attention_heads"]
    idx = outlier_channels(hidden, seed)
    with torch.no_grad():
        for emb in (model.x_embedder, model.context_embedder):
            emb.weight[idx] *= OUTLIER_ACT_GAIN
            emb.bias[idx] *= OUTLIER_ACT_GAIN
        for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
            for mod in block.modules():
                if isinstance(mod, torch.nn.Linear) and mod.in_features == hidden:
                    mod.weight[:, idx] *= OUTLIER_WEIGHT_GAIN
        mlp = model.get_submodule(MLP_OUTLIER_LAYER)
        mlp.weight[:2] *= MLP_OUTLIER_GAIN
        mlp.bias[:2] = mlp.bias[:2].abs() * MLP_OUTLIER_GAIN
        model.get_submodule(ROW_OUTLIER_LAYER).weight[:2] *= ROW_OUTLIER_GAIN
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_flux_inputs(batch: int = 1, side: int = 8, text_tokens: int = 16, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> dict:
    """Seeded forward inputs for the tiny model: ``side``² image tokens and ``text_tokens`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    cfg = TINY_FLUX_CONFIG
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    return dict(
        hidden_states=torch.randn(batch, side * side, cfg["in_channels"], generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg["joint_attention_dim"], generator=g).to(dtype),
        pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"], generator=g).to(dtype),
        timestep=torch.full((batch,), 0.5, dtype=dtype),
        guidance=torch.full((batch,), 3.5, dtype=dtype),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(text_tokens, 3),
    )
