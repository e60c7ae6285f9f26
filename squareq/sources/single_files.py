"""Encoders from single files, as ComfyUI and kohya users hold them (``clip_l.safetensors``,
``t5xxl_fp16.safetensors`` or ``t5xxl_fp8_e4m3fn.safetensors``, ``ae.safetensors``), each loaded by the library that
knows its layout, with the config of the component it replaces from the pipeline folder:

- a diffusers model (the VAE, in the original ``ae.safetensors`` layout): diffusers' ``from_single_file``;
- a transformers model (CLIP and T5, whose single files are transformers' own layout; CLIP-L's older
  ``text_model.`` names included): transformers' ``from_pretrained``, reading the file where it would read
  ``model.safetensors``, which also upcasts an fp8 file to the dtype asked for.

A file that leaves any weight of its component unset is refused: a randomly initialized encoder would quietly encode
wrong latents or captions. ComfyUI's *scaled* fp8 files (a ``scaled_fp8`` marker and per-tensor scales) are refused
too, since their weights mean something only with ComfyUI's own scaling.
"""
from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from ..slab.errors import brief
from .encoder_source import EncoderError, EncoderSource, cli_flag, file_components
from .file_kind import unreadable


def load_single_files(source: EncoderSource, folder: Path, index: Mapping, dtype: torch.dtype,
                      only: tuple[str, ...] | None = None,
                      dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.nn.Module]:
    """The components of the pipeline in ``folder`` (``index``: its model_index.json) that ``source.files`` replace,
    loaded in ``dtype`` (``dtypes``: a component's own, by name; ``only``: these flags alone), by component name:
    ready to pass to ``from_pretrained``."""
    files = {k: v for k, v in source.files if only is None or k in only}
    parts = file_components(index, list(files))
    loaded = {}
    for name, path in files.items():
        component = parts[name]
        library, class_name = index[component]
        loaded[component] = load_component(Path(path), cli_flag(name), library, class_name, folder, component,
                                           (dtypes or {}).get(component, dtype))
    return loaded


def load_component(path: Path, what: str, library: str, class_name: str, folder: Path, component: str,
                   dtype: torch.dtype) -> torch.nn.Module:
    """``path`` as the pipeline's ``component`` (a ``library.class_name``, configured by ``folder/component``)."""
    keys = _header_keys(path, what)
    if "scaled_fp8" in keys or any(k.endswith(".scale_weight") for k in keys):
        raise EncoderError(f"{what} {path} is one of ComfyUI's scaled fp8 files, whose weights need ComfyUI's own "
                           "scales; pass the fp16 or plain fp8 (e4m3fn) file instead.")
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise EncoderError(f"{folder / 'model_index.json'} names {library}.{class_name} for {component}, which is not "
                           "installed; upgrade diffusers and transformers.") from None
    from diffusers.loaders.single_file_model import FromOriginalModelMixin
    from transformers import PreTrainedModel

    try:
        if issubclass(cls, FromOriginalModelMixin):
            model, unset = _diffusers_single_file(cls, path, folder, component, dtype)
        elif issubclass(cls, PreTrainedModel):
            model, unset = _transformers_file(cls, path, folder, component, dtype)
        else:
            raise EncoderError(f"{what}: {component} is a {class_name}, which neither diffusers' from_single_file nor "
                               "transformers loads from a single file; leave the flag out.")
    except EncoderError:
        raise
    except Exception as exc:  # the loaders raise types of their own (diffusers: SingleFileComponentError, ...)
        unset = [brief(exc)]
    if unset:
        raise EncoderError(f"{what} {path} does not hold the {class_name} that {folder / component} configures "
                           f"({unset[0]}); check the file and the flag.") from None
    return model.eval()


def _header_keys(path: Path, what: str) -> list[str]:
    from safetensors import safe_open

    if not path.is_file():
        raise EncoderError(f"{what} {path} does not exist; pass the encoder's .safetensors file.")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a file that is not one
        raise EncoderError(f"{what} {unreadable(path, exc)}; pass the encoder's .safetensors file.") from None


def _diffusers_single_file(cls, path: Path, folder: Path, component: str, dtype):
    """diffusers' from_single_file with the component's config; the model and what it left unset."""
    model = cls.from_single_file(str(path), config=str(folder), subfolder=component, torch_dtype=dtype,
                                 local_files_only=True)
    unset = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    return model, [f"{len(unset)} weights not in the file, e.g. {unset[0]}"] if unset else []


def _transformers_file(cls, path: Path, folder: Path, component: str, dtype):
    """transformers' own loader, pointed at a folder that holds the component's config and the file as its weights
    (links, so nothing is copied: the T5-XXL file is 9.5 GB); the model and what it left unset."""
    with tempfile.TemporaryDirectory(prefix="squareq-encoder-") as tmp:
        os.symlink((folder / component / "config.json").resolve(), Path(tmp) / "config.json")
        os.symlink(path.resolve(), Path(tmp) / "model.safetensors")
        model, info = cls.from_pretrained(tmp, torch_dtype=dtype, local_files_only=True, output_loading_info=True,
                                          use_safetensors=True)
    missing = [k for k in info.get("missing_keys", ()) if k]
    mismatched = [m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", ())]
    unset = missing + mismatched
    return model, [f"{len(unset)} weights missing or misshapen, e.g. {unset[0]}"] if unset else []
