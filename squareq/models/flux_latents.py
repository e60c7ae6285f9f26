"""FLUX.1's latent layout: 2x2 patches of the VAE latent become transformer tokens, with their position ids.

The trainer (packing cached latents) and the compiler (calibrating on a training cache) both need it; it is
exactly what diffusers' ``FluxPipeline`` does (tests/train/test_objective.py checks against it).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens (FLUX 2x2 patchify, as FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack into 2x2 patches, got {h}x{w}.")
    x = latents.view(b, c, h // 2, 2, w // 2, 2)
    # Token order is row-major over patches; each token holds (channel, dy, dx) in that order.
    x = x.permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents`: [B, (H/2)(W/2), 4C] -> [B, C, H, W] for latent ``height`` x ``width``."""
    b, n, d = tokens.shape
    if height % 2 or width % 2 or n != (height // 2) * (width // 2) or d % 4:
        raise ValueError(
            f"tokens of shape {tuple(tokens.shape)} do not pack a {height}x{width} latent "
            f"(expected {(height // 2) * (width // 2)} tokens of a multiple of 4 features)."
        )
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def image_ids(height: int, width: int, device=None, dtype=torch.float32, index: int = 0, axes: int = 3) -> torch.Tensor:
    """Position ids [(H/2)(W/2), ``axes``] for a ``height`` x ``width`` latent: (``index``, patch row, patch column),
    and zeros after (FLUX.2's fourth axis, L). Index 0 for the image drawn; an edit pair's control images have their
    family's (FLUX.1 Kontext's 1, FluxKontextPipeline's ``image_ids[..., 0] = 1``; FLUX.2's 10 + 10k)."""
    rows, cols = height // 2, width // 2
    ids = torch.zeros(rows, cols, axes, device=device, dtype=dtype)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(rows, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(cols, device=device, dtype=dtype)[None, :]
    return ids.reshape(rows * cols, axes)


def packed_with_controls(x_t: torch.Tensor, controls: list[torch.Tensor], index: Callable[[int], int],
                         axes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens [target | control_0 | control_1 | ...], each latent 2x2-packed alike, and their position ids: the
    target's first coordinate 0, the k-th control's ``index(k)``, each on its own grid from 0 (the edit pipelines'
    ``torch.cat([latents, image_latents], dim=1)`` and ids)."""
    tokens = [pack_latents(x_t)] + [pack_latents(c.to(x_t.dtype)) for c in controls]
    ids = [image_ids(*x_t.shape[-2:], device=x_t.device, axes=axes)] + [
        image_ids(*c.shape[-2:], device=x_t.device, index=index(k), axes=axes) for k, c in enumerate(controls)]
    return torch.cat(tokens, dim=1), torch.cat(ids)


def text_ids(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids [n, 3] for ``n`` text tokens: all zeros (FLUX gives text no spatial position)."""
    return torch.zeros(n, 3, device=device, dtype=dtype)
