"""``open_source(MODEL)``: the ``Source`` for a built-in name, a folder, a BFL file or a Hugging Face Hub ID.

MODEL is a built-in name (``tiny-flux``), a diffusers pipeline folder (its ``transformer/`` is used) or model folder, a
transformers model folder, a BFL single-file FLUX.1 checkpoint, or a Hub ID of a pipeline or model (sources/hub.py:
from the local cache, or downloading only the files the compile reads). Bad input raises ``ModelError`` with one
sentence naming the file or tensor and what to do.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from ..models import BUILTIN_MODELS, ModelError, flux_bfl, load_builtin
from ..models.base import PIPELINE_DENOISER
from ..models.skeleton import build_meta
from . import hub
from .model import Source
from .skeletons import WHAT_TO_PASS, base_for_blocks, fit_base_prefix, folder_model, folder_weights
from .tensors import BFLFile, MemoryTensors, SafetensorsFiles, ShapesOnly, header_shapes


def open_source(model: str | os.PathLike, blocks: Sequence[str] | None = None, revision: str | None = None,
                check: Callable[[Source], None] | None = None, model_class: str | None = None) -> Source:
    """Open MODEL: a built-in name, a diffusers pipeline/model folder, a transformers folder, a BFL file or a Hub ID
    (``revision``: its branch, tag or commit).

    ``blocks`` names the ``nn.ModuleList`` attributes holding the blocks (``["encoder.layer"]``) for a
    model without a family adapter (generic mode); None uses the family adapter. ``check`` sees the source before
    any weight is read (a Hub ID's before its weights are downloaded) and may refuse it by raising. ``model_class``
    (--model-class) builds that transformers/diffusers class instead of the one config.json names.
    """
    if isinstance(model, str) and model in BUILTIN_MODELS:
        if revision:
            raise ModelError(f"--revision {revision}: {model} is a built-in model, not a Hugging Face Hub ID.")
        if model_class:
            raise ModelError(f"--model-class {model_class} is for a model folder or Hub ID, and {model} is a built-in "
                             "model; leave --model-class out.")
        source = _open_builtin(model, blocks)
    elif (ref := hub.hub_ref(model, revision)) is not None:
        return _open_hub(ref, blocks, check, model_class)
    elif revision:
        raise ModelError(f"--revision {revision} is for a Hugging Face Hub ID, and {model} is a local path.")
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelError(f"{model} does not exist; {WHAT_TO_PASS}.")
        path = path.resolve()
        if model_class and not path.is_dir():
            raise ModelError(f"--model-class {model_class} is for a diffusers or transformers model folder, and "
                             f"{model} is a file; leave --model-class out.")
        source = _open_folder(path, blocks, model_class) if path.is_dir() else _open_file(path, blocks)
    if check is not None:
        check(source)
    return source


def _open_folder(folder: Path, blocks, model_class: str | None = None) -> Source:
    skeleton, folder, pipeline = folder_model(folder, model_class)
    tensors = SafetensorsFiles(folder_weights(folder), label=str(folder))
    skeleton, tensors = fit_base_prefix(skeleton, tensors, chosen=bool(model_class))
    source = Source(str(folder), skeleton, tensors, blocks)
    source.pipeline, source.folder = pipeline, folder
    return source


def _open_file(path: Path, blocks) -> Source:
    if path.suffix != ".safetensors":
        raise ModelError(f"{path} is not a .safetensors file; SquareQ reads safetensors only, so convert it "
                         f"first or {WHAT_TO_PASS}.")
    shapes = header_shapes(path)
    prefix = flux_bfl.bfl_key_prefix(shapes)
    if prefix is None:
        raise ModelError(f"{path} is not a BFL FLUX.1 checkpoint (it has no double_blocks.0.img_attn.qkv.weight); "
                         "pass its diffusers or transformers model folder (with config.json) instead.")
    tensors = BFLFile(path, prefix, shapes)
    from diffusers import FluxTransformer2DModel

    skeleton = build_meta(lambda: FluxTransformer2DModel(**tensors.config))
    return Source(f"{path} (BFL single file)", skeleton, tensors, blocks)


def _open_builtin(name: str, blocks) -> Source:
    model, _ = load_builtin(name)
    # parameters on meta, buffers real, as build_meta makes them: non-persistent buffers (rotary tables) are
    # in no checkpoint, so the skeleton must keep their values
    skeleton = copy.deepcopy(model).eval()
    for module in skeleton.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                module._parameters[attr] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return Source(name, skeleton, MemoryTensors(model.state_dict(), label=f"built-in {name}"), blocks)


def _open_hub(ref: hub.HubRef, blocks, check, model_class: str | None = None) -> Source:
    """A Hub repository: a pipeline's transformer (its VAE and text encoders are fetched where they are loaded,
    squareq.sources.encoder_source), or a one-model repository's configs, tokenizer and weights. The configs come
    first, so ``check`` can refuse the model before gigabytes of weights are downloaded. The source is named by the
    commit it resolved to, and every fetch reads that commit."""
    folder, index = hub.index_of(ref)
    ref = hub.resolved(ref, folder)
    if index is None:
        configs, weights = ["*.json"], hub.MODEL_FILES
    else:
        if PIPELINE_DENOISER not in hub.pipeline_components(index, (PIPELINE_DENOISER,)):
            raise ModelError(f"{ref} is a {index.get('_class_name', 'pipeline')} without a transformer/ component, "
                             "which SquareQ compiles from a pipeline; download it and pass its denoiser's folder with "
                             "--blocks ATTR.")
        configs, weights = hub.pipeline_patterns([], [PIPELINE_DENOISER]), hub.pipeline_patterns([PIPELINE_DENOISER])
    if check is not None:
        skeleton = folder_model(hub.fetch(ref, configs), model_class)[0]
        skeleton = skeleton if model_class else base_for_blocks(skeleton, blocks)
        check(Source(str(ref), skeleton, ShapesOnly(skeleton, str(ref)), blocks))
    folder = hub.fetch(ref, weights)
    if index is not None:
        hub.require(folder, ref, [PIPELINE_DENOISER], weights=[PIPELINE_DENOISER])
    source = _open_folder(folder, blocks, model_class)
    source.hub = ref
    source.description = str(ref)
    return source
