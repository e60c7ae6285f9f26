"""The files a user holds, written for the benchmarks: a pipeline's VAE and text encoders saved as the cached
snapshot of its Hub repository (as ``hf download`` leaves it), so that squareq resolves the Hub ID from
``HF_HUB_CACHE`` with ``HF_HUB_OFFLINE=1`` through its own loaders (benchmarks/cards.py)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

# the repository a shape key's pipeline is released as (its ID is what a user passes with --model); a shape key is
# benchmarks/train_step.py's --family: a family, or a model of one at shapes of its own (wan2.2-5b)
REPOS = {"flux": "black-forest-labs/FLUX.1-dev", "flux2": "black-forest-labs/FLUX.2-dev",
         "qwen-image": "Qwen/Qwen-Image", "wan": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
         "wan2.2-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "hunyuan-video": "hunyuanvideo-community/HunyuanVideo"}
COMMIT = "0000000000000000000000000000000000000000"  # the snapshot's stand-in revision (refs/main points at it)


def snapshot_of(cache: Path, repo: str, commit: str = COMMIT) -> Path:
    return Path(cache) / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def write_hub_snapshot(cache: Path, pipe, repo: str, commit: str = COMMIT, then=None) -> Path:
    """``pipe`` (its transformer None: the slab is the denoiser) saved as safetensors into the cached snapshot of
    ``repo`` at ``commit``, its main branch; the snapshot folder. ``then(snapshot)``: what the saved folder needs
    besides (an edit pipeline's processor in the Hub's layout). refs/main is written last: a snapshot without it
    was cut short and is written again."""
    snapshot = snapshot_of(cache, repo, commit)
    pipe.save_pretrained(snapshot, safe_serialization=True)
    if then is not None:
        then(snapshot)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(commit)
    return snapshot


def has_snapshot(cache: Path, repo: str) -> bool:
    return (snapshot_of(cache, repo).parents[1] / "refs" / "main").is_file()


@contextlib.contextmanager
def hub_cache(cache: Path):
    """Within: Hub IDs resolve from ``cache`` only (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``, read by squareq at
    use)."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ldm_vae_name(name: str, up_blocks: int) -> str:
    """A diffusers AutoencoderKL tensor name as the original autoencoder (BFL's ``ae.safetensors``) names it, which
    diffusers' single-file loader converts back."""
    import re

    name = re.sub(r"mid_block\.resnets\.(\d)", lambda m: f"mid.block_{int(m[1]) + 1}", name)
    name = name.replace("mid_block.attentions.0.", "mid.attn_1.").replace("attn_1.group_norm", "attn_1.norm")
    for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
        name = name.replace(f"attn_1.{ours}.", f"attn_1.{theirs}.")
    name = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", name)
    name = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", name)
    # the decoder's levels count from the lowest resolution in diffusers, from the highest in the original
    name = re.sub(r"up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
                  lambda m: f"up.{up_blocks - 1 - int(m[1])}.{'block' if m[2] == 'resnets' else 'upsample'}.", name)
    return name.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")


def ldm_vae_state(vae) -> dict:
    """A VAE's tensors under the original autoencoder's names (its attention projections as 1x1 convolutions), as
    ComfyUI's ``ae.safetensors`` holds them; tests/user_files.py writes its stand-in's file with it too."""
    state = vae.state_dict()
    up_blocks = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("decoder.up_blocks."))
    ldm = {}
    for name, t in state.items():
        key = _ldm_vae_name(name, up_blocks)
        ldm[key] = (t[:, :, None, None] if ".attn_1." in key and name.endswith("weight") and t.ndim == 2
                    else t).contiguous()
    return ldm


def write_comfyui_encoders(pipe, folder: Path) -> dict[str, Path]:
    """FLUX.1 ``pipe``'s CLIP-L, T5 (fp16) and VAE as ComfyUI's single files in ``folder`` (``clip_l.safetensors``,
    ``t5xxl_fp16.safetensors``, ``ae.safetensors``; the fourth, the transformer's, is what the slab replaces), by
    squareq's flag (``clip_l``, ``t5``, ``vae``)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"clip_l": folder / "clip_l.safetensors", "t5": folder / "t5xxl_fp16.safetensors",
             "vae": folder / "ae.safetensors"}
    clip = {k if k.startswith("text_model.") else f"text_model.{k}": v.contiguous()
            for k, v in pipe.text_encoder.state_dict().items()}
    width = pipe.text_encoder.config.hidden_size
    clip["text_projection.weight"] = torch.eye(width, dtype=pipe.text_encoder.dtype)  # CLIP-L's files carry one
    save_file(clip, str(files["clip_l"]))
    save_file({k: v.half().contiguous() for k, v in pipe.text_encoder_2.state_dict().items()
               if k != "encoder.embed_tokens.weight"}, str(files["t5"]))  # stored once, as shared.weight
    save_file(ldm_vae_state(pipe.vae), str(files["vae"]))
    return files
