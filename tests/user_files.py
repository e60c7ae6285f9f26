"""A new user's files, made from the built-in tiny FLUX.1 pipeline: the pipeline in a Hugging Face cache (as `hf
download` leaves it), and the four single files ComfyUI and kohya users hold, each in the layout those files use.

The layouts written here are the inverse of what the loaders read, so they are written out by hand:
- ``flux1-dev.safetensors``: BFL's names (squareq.models.flux_bfl, which the compiler reads);
- ``clip_l.safetensors``: transformers' CLIPTextModel names with the ``text_model.`` prefix and the
  ``text_projection.weight`` that CLIP-L's files carry;
- ``t5xxl_fp16.safetensors`` / ``t5xxl_fp8_e4m3fn.safetensors``: transformers' T5EncoderModel names, in fp16 or fp8;
- ``ae.safetensors``: the original (ldm) autoencoder names BFL's ``ae.safetensors`` uses (benchmarks/user_layout.py's
  ``ldm_vae_state``, which cards.py writes its files with).
"""
import importlib.util
from pathlib import Path

import torch
from safetensors.torch import save_file

from squareq.models.flux_bfl import diffusers_to_bfl
from squareq.models.tiny_pipeline import build_tiny_flux_pipeline

STAND_IN_REPO = "black-forest-labs/FLUX.1-dev"  # the tiny pipeline stands in for it in a test's cache
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _user_layout():
    """benchmarks/user_layout.py, which writes ComfyUI's VAE file for cards.py the same way (benchmarks are scripts,
    not a package: loaded by path)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "user_layout.py"
    spec = importlib.util.spec_from_file_location("benchmarks_user_layout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ldm_vae_state = _user_layout().ldm_vae_state


def stand_in_pipeline():
    """The tiny FLUX.1 pipeline with its T5 rounded to fp16, as a T5 that also exists as ``t5xxl_fp16.safetensors``:
    the pipeline and the single files then hold the same numbers."""
    pipe = build_tiny_flux_pipeline()
    with torch.no_grad():
        for p in pipe.text_encoder_2.parameters():
            p.copy_(p.half().float())
    return pipe


def write_hub_cache(cache: Path, pipe, repo: str = STAND_IN_REPO, commit: str = COMMIT) -> Path:
    """``pipe`` saved as the cached snapshot of ``repo`` at ``commit`` (its main branch); the snapshot folder."""
    storage = Path(cache) / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    pipe.save_pretrained(snapshot, safe_serialization=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def write_comfyui_files(pipe, folder: Path, t5_dtype: torch.dtype = torch.float16) -> dict[str, Path]:
    """``pipe``'s transformer, CLIP-L, T5 (in ``t5_dtype``) and VAE as ComfyUI's four files in ``folder``, by flag
    name (``transformer`` for the model file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t5_name = "t5xxl_fp16" if t5_dtype == torch.float16 else "t5xxl_fp8_e4m3fn" if t5_dtype == torch.float8_e4m3fn \
        else f"t5xxl_{str(t5_dtype).split('.')[-1]}"
    files = {"transformer": folder / "flux1-dev.safetensors", "clip_l": folder / "clip_l.safetensors",
             "t5": folder / f"{t5_name}.safetensors", "vae": folder / "ae.safetensors"}
    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(pipe.transformer.state_dict()).items()},
              str(files["transformer"]))
    clip = {k if k.startswith("text_model.") else f"text_model.{k}": v.contiguous()
            for k, v in pipe.text_encoder.state_dict().items()}
    width = pipe.text_encoder.config.hidden_size
    clip["text_projection.weight"] = torch.eye(width)  # CLIP-L's files carry the projection CLIPTextModel leaves out
    save_file(clip, str(files["clip_l"]))
    save_file({k: v.to(t5_dtype).contiguous() for k, v in pipe.text_encoder_2.state_dict().items()
               if k != "encoder.embed_tokens.weight"}, str(files["t5"]))  # stored once, as shared.weight
    save_file(ldm_vae_state(pipe.vae), str(files["vae"]))
    return files
