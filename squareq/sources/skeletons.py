"""A model folder's class built on the meta device from its config alone (the skeleton), and its weights files.

A folder is a diffusers model (``_class_name``), a transformers model (``architectures``/``model_type``) or a
pipeline whose ``transformer/`` is taken; ``--model-class`` builds another class of the same library instead. A
transformers checkpoint saved from the base model is matched to a head class (or the reverse) as ``from_pretrained``
matches it.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..models import ModelError
from ..models.base import PIPELINE_DENOISER, diffusers_class, read_json_object
from ..models.skeleton import build_meta, build_within
from .boundary import reading
from .local_files import refuse_pickled
from .tensors import Renamed, Tensors, few, header_shapes

log = logging.getLogger("squareq.sources")

WHAT_TO_PASS = "pass a Hugging Face Hub ID, a diffusers folder, a BFL .safetensors file or tiny-flux"


def folder_model(folder: Path, model_class: str | None = None) -> tuple[nn.Module, Path, Path | None]:
    """The model a folder holds, built on the meta device from its config alone (as ``model_class`` when given): the
    skeleton, the model's own folder (a pipeline's ``transformer/``) and the pipeline folder around it (None when
    there is none)."""
    pipeline = None
    if (folder / "model_index.json").is_file():
        if not (folder / PIPELINE_DENOISER).is_dir():
            raise ModelError(f"{folder} is a pipeline folder without transformer/; pass one of its component "
                             f"folders (e.g. {folder / 'text_encoder'}) with --blocks ATTR.")
        pipeline, folder = folder, folder / PIPELINE_DENOISER
    elif (folder.parent / "model_index.json").is_file():
        pipeline = folder.parent
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json, so it is not a diffusers or transformers model folder; "
                         f"{WHAT_TO_PASS}.")
    config = read_json_object(config_file, "re-save the model")
    if "_class_name" in config:
        build = lambda: _diffusers_skeleton(folder, config, model_class)  # noqa: E731
    elif "architectures" in config or "model_type" in config:
        build = lambda: _transformers_skeleton(folder, model_class)  # noqa: E731
    else:
        raise ModelError(f"{config_file} has neither _class_name (diffusers) nor architectures/model_type "
                         f"(transformers); {WHAT_TO_PASS}.")
    tensors = _tensor_count(folder)
    with reading(f"the model described by {config_file}", "check that file, or download the model again"):
        skeleton = build_within(build, tensors, f"{config_file} describes far more layers than the {tensors} tensors "
                                "of its weights files hold (an edited layer count?), so it was not built; download "
                                "the model again or restore its config.json")
    return skeleton, folder, pipeline


def _tensor_count(folder: Path) -> int | None:
    """How many tensors the folder's weights files hold (None: no weights yet, as before a Hub download, or files
    the loader will refuse with their own sentence)."""
    try:
        files = folder_weights(folder)
        return sum(len(header_shapes(f)) for f in files) if files else None
    except ModelError:
        return None


def _diffusers_skeleton(folder: Path, config: dict, model_class: str | None = None) -> nn.Module:
    import diffusers

    if model_class:
        cls = _chosen_class(model_class, "diffusers", diffusers_class, diffusers.ModelMixin)
        return _built_as(model_class, folder, lambda: cls.from_config(config))
    name = config["_class_name"]
    cls = diffusers_class(name)
    if cls is None or not hasattr(cls, "from_config"):
        raise ModelError(f"{folder / 'config.json'} names the class {name!r}, which diffusers "
                         f"{diffusers.__version__} does not have; upgrade diffusers or {WHAT_TO_PASS}.")
    return build_meta(lambda: cls.from_config(config))


def _transformers_skeleton(folder: Path, model_class: str | None = None) -> nn.Module:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"transformers cannot read {folder / 'config.json'} ({exc}); upgrade transformers "
                         "or fix the config.") from None
    if model_class:
        cls = _chosen_class(model_class, "transformers", lambda n: getattr(transformers, n, None),
                            transformers.PreTrainedModel)
        return _built_as(model_class, folder, lambda: cls(config))
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if cls is not None:
            return build_meta(lambda cls=cls: cls(config))
    try:
        return build_meta(lambda: transformers.AutoModel.from_config(config))
    except ValueError as exc:
        raise ModelError(f"transformers has no model class for {folder / 'config.json'} ({exc}).") from None


def _chosen_class(name: str, library: str, lookup: Callable[[str], Any], base: type) -> type:
    """The class --model-class names, from ``library`` (``lookup`` finds it by name; ``base``: what it must be)."""
    cls = lookup(name) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ModelError(f"--model-class {name} names no {library} model class; pass one such as "
                         f"{'BertModel' if library == 'transformers' else 'FluxTransformer2DModel'}, or leave "
                         "--model-class out to build the class config.json names.")
    return cls


def _built_as(name: str, folder: Path, build: Callable[[], nn.Module]) -> nn.Module:
    """The --model-class ``name`` built from ``folder``'s config; a class of another model type fails in its own
    constructor, which becomes one sentence."""
    try:
        return build_meta(build)
    except Exception as exc:  # noqa: BLE001 - whatever that class's constructor raises for a foreign config
        raise ModelError(f"--model-class {name} cannot be built from {folder / 'config.json'} ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:100]}); pass a class of that config's model type, or leave "
                         "--model-class out.") from None


def fit_base_prefix(skeleton: nn.Module, tensors: Tensors, chosen: bool) -> tuple[nn.Module, Tensors]:
    """Match a transformers checkpoint saved from the base model to a head class, or the reverse, as
    ``from_pretrained`` does: the base model's prefix is added to or taken off the checkpoint's names. A checkpoint
    with none of the head's tensors under a config naming a head class (sentence-transformers models) builds the base
    model instead, as ``AutoModel`` does, unless ``chosen`` (--model-class): a slab must not keep a random head."""
    from transformers import PreTrainedModel

    prefix = getattr(skeleton, "base_model_prefix", "")
    if not isinstance(skeleton, PreTrainedModel) or not isinstance(prefix, str) or not prefix:
        return skeleton, tensors
    dot, expected = prefix + ".", list(skeleton.state_dict(keep_vars=True))
    has, expects = any(k.startswith(dot) for k in tensors.shapes), any(n.startswith(dot) for n in expected)
    if has and not expects:
        return skeleton, Renamed(tensors, strip=dot)
    if not expects or has:
        return skeleton, tensors
    base = getattr(skeleton, prefix, None)
    head = [n for n in expected if not n.startswith(dot)]
    if not chosen and isinstance(base, PreTrainedModel) and not any(n in tensors.shapes for n in head):
        log.info("%s holds a %s without its head, so it is compiled as %s, as AutoModel loads it.", tensors.label,
                 type(skeleton).__name__, type(base).__name__)
        return _built_base(base), tensors
    return skeleton, Renamed(tensors, add=dot)


def base_for_blocks(skeleton: nn.Module, blocks) -> nn.Module:
    """Before a Hub repository's weights are fetched, which class it compiles as is a guess: the base model when
    ``blocks`` name lists of the base and not of the head class its config names (a sentence-transformers model)."""
    prefix = getattr(skeleton, "base_model_prefix", "")
    base = getattr(skeleton, prefix, None) if isinstance(prefix, str) and prefix else None
    names = [blocks] if isinstance(blocks, str) else list(blocks or ())
    if base is None or not names or not isinstance(base, nn.Module) or base is skeleton:
        return skeleton
    with contextlib.suppress(AttributeError):
        for n in names:
            skeleton.get_submodule(n.strip())
        return skeleton
    return _built_base(base)


def _built_base(base: nn.Module) -> nn.Module:
    """The base model's class built afresh from its config, not copied out of the head class: a head may build its
    base without parts the base class has (BERT's masked-LM head leaves out the pooler)."""
    return build_meta(lambda: type(base)(base.config))


def folder_weights(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the index's shards, else the one weights file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"), key=lambda p: (len(p.name), p.name))
    if indexes:
        index = indexes[0]  # shortest name: the variant-free index when fp16 variants sit beside it
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ModelError(f"{index} is not a safetensors index (no weight_map); re-save the model.") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelError(f"{index} lists the shard {f.name}, which is not in {folder}; copy the missing shard.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if len(files) > 1:
        standard = [f for f in files if f.name in ("diffusion_pytorch_model.safetensors", "model.safetensors")]
        if len(standard) != 1:
            raise ModelError(f"{folder} holds several safetensors files ({few(f.name for f in files)}) and no "
                             "*.safetensors.index.json; keep one weights file or add the index.")
        files = standard
    if not files:
        refuse_pickled(folder)
        raise ModelError(f"{folder} has no *.safetensors weights; {WHAT_TO_PASS}.")
    return files
