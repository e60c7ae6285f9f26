"""The VAE's activations while it encodes the cache's largest entry, and its tiling: how many frames of feature maps a
video VAE keeps alive at once (diffusers' Wan VAE encodes a first frame, then 4 at a time; HunyuanVideo's encodes in
windows of frames), and the smaller tiles its ``enable_tiling`` splits a large frame into, where the whole frame does
not fit the budget."""
from __future__ import annotations

from torch import nn

# bytes of the VAE encoder's feature maps per image pixel at 2 bytes an element: a 128-channel map at full resolution,
# about four alive at once (the FLUX.1 VAE's down path); the video VAEs' causal convolutions keep a cache beside it
VAE_BYTES_PER_PIXEL = 2048
# diffusers' AutoencoderKLWan encodes the first frame, then chunks of 4 with a cache of the last 2 frames of each
# causal convolution's input: about 6 frames of feature maps alive, whatever the clip's length
WAN_FRAMES_AT_ONCE = 6


def frames_at_once(vae: nn.Module, frames: int) -> int:
    """The frames of ``vae``'s feature maps alive at once while it encodes ``frames`` frames."""
    if type(vae).__name__ == "AutoencoderKLWan":
        return min(frames, WAN_FRAMES_AT_ONCE)
    window = getattr(vae, "tile_sample_min_num_frames", None)
    # HunyuanVideo's encodes windows of frames when framewise (its default); LTX-Video's reads the decoding switch
    framewise = getattr(vae, "use_framewise_encoding", False) if type(vae).__name__ != "AutoencoderKLLTXVideo" \
        else getattr(vae, "use_framewise_decoding", False)
    return min(frames, window + 1) if window and framewise else frames


def can_tile(vae: nn.Module) -> bool:
    """Whether ``vae`` splits a frame into tiles when asked (diffusers' ``enable_tiling``)."""
    return callable(getattr(vae, "enable_tiling", None)) and hasattr(vae, "tile_sample_min_height")


def vae_workspace(vae: nn.Module | None, pixels: int, frames: int = 1, tiled: bool = False) -> int:
    """Activation bytes of ``vae`` encoding ``frames`` frames of ``pixels`` pixels each, whole or ``tiled`` (a tile of
    ``tile_sample_min_height`` × ``tile_sample_min_width`` pixels at a time); ``vae`` None: an image VAE."""
    if vae is None:
        return VAE_BYTES_PER_PIXEL * pixels * frames
    if tiled:
        pixels = min(pixels, int(vae.tile_sample_min_height) * int(vae.tile_sample_min_width))
    return VAE_BYTES_PER_PIXEL * pixels * frames_at_once(vae, frames)
