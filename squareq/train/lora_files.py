"""Writing LoRA files: the diffusers/PEFT file SquareQ writes by default, each family's kohya/ComfyUI file (and
LyCORIS's for a LoKr or LoHa; the layouts: train/layouts/), and the PEFT adapter folder of a LoKr or LoHa.

**diffusers layout** (``save_diffusers_lora``): ``<dir>/pytorch_lora_weights.safetensors`` with keys
``transformer.<layer>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank], bf16 by default. The
safetensors header carries the adapter metadata exactly as diffusers 0.42 writes it
(``LoraBaseMixin.write_lora_layers``, diffusers/loaders/lora_base.py): ``"format": "pt"`` and
``"lora_adapter_metadata"``, a JSON object of ``LoraConfig`` arguments whose keys carry the component
prefix (``"transformer.r"``, ``"transformer.lora_alpha"``, ...). ``load_lora_adapter(prefix="transformer")``
and ``FluxPipeline.load_lora_weights`` strip that prefix and build ``LoraConfig(**metadata)`` from it, so the
scale alpha/rank is applied on load; without the metadata diffusers would assume alpha = rank (scale 1).
SquareQ's own provenance sits beside it in the header under ``squareq.*`` keys (diffusers reads only its key).

**PEFT adapter folder** (``save_peft_adapter``): ``adapter_model.safetensors`` and ``adapter_config.json`` as
PEFT's ``save_pretrained`` writes them.

Reading a file back is train/lora_reader.py; putting one on a model for sampling, train/lora_attach.py.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..runtime.peft_lora import LoraVariant
from ..slab.atomic import atomic_write_bytes
from ..slab.safetensors_file import safetensors_bytes
from .layouts import layout_for
from .layouts.lycoris import NETWORK_MODULE as LYCORIS_MODULE
from .layouts.lycoris import adapter_kind, lycoris_tensors
from .layouts.modules import ALPHA as KOHYA_ALPHA
from .lora_factors import LORA_A, LORA_B, MAGNITUDE, LoraFileError, dora_magnitudes, factor_pairs, plain_number
from .lora_metadata import MODELSPEC_VERSION, architecture

# The names diffusers uses (diffusers/loaders/lora_base.py: LORA_WEIGHT_NAME_SAFE, LORA_ADAPTER_METADATA_KEY;
# lora_pipeline.py: FluxLoraLoaderMixin.transformer_name). Repeated so that saving does not import diffusers'
# loaders; a test checks they still agree.
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
PREFIX = "transformer"
# the denoiser's component: transformers, SD 1.5 / SDXL's UNet, Würstchen's prior and decoder
PREFIXES = ("transformer", "unet", "prior", "decoder")

FORMAT_NAME = "squareq-lora"
FORMAT_VERSION = 1
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"

_SAVE_DTYPES = (torch.bfloat16, torch.float32)


def _provenance(layout: str, rank: int, alpha: float, targets, extra: Mapping[str, Any] | None) -> dict[str, str]:
    """SquareQ's own header keys (safetensors metadata is str -> str, so values are JSON)."""
    if isinstance(targets, str):
        targets = [targets]
    meta = {
        "squareq.format": FORMAT_NAME,
        "squareq.format_version": str(FORMAT_VERSION),
        "squareq.layout": layout,
        "squareq.version": __version__,
        "squareq.rank": json.dumps(int(rank)),
        "squareq.alpha": json.dumps(plain_number(alpha)),
        "squareq.targets": json.dumps(list(targets)),
    }
    for key, value in (extra or {}).items():
        meta[f"squareq.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return meta


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _SAVE_DTYPES:
        raise LoraFileError(f"dtype={dtype} cannot be saved; choose torch.bfloat16 (the default) or torch.float32.")


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    # temporary name in the same folder, fsync, rename: a crash never leaves a half-written LoRA under the real name
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, safetensors_bytes(tensors, metadata))
    return path


def _adapter_json(layers, rank: int, alpha: float, prefix: str | None, variant: LoraVariant | None = None) -> str:
    """The adapter config in a safetensors header (``prefix.key`` as a pipeline writes it, bare keys as a model's
    ``save_lora_adapter`` does when ``prefix`` is None)."""
    # The LoraConfig arguments diffusers would infer itself (utils/peft_utils.py get_peft_kwargs), with the real
    # alpha. target_modules lists exact layer names, so PEFT wraps only the layers that have factors (a pattern
    # such as "proj_out" would also wrap the model's final projection, left without weights).
    config = {
        "r": int(rank),
        "lora_alpha": plain_number(alpha),
        "target_modules": sorted(layers),
        # diffusers' own form for a layer whose rank differs ("^<layer>", anchored so that "single_" prefixes
        # do not match); empty for anything runtime.add_lora made
        "rank_pattern": {f"^{n}": int(a.shape[0]) for n, (a, _) in sorted(layers.items()) if a.shape[0] != rank},
        "alpha_pattern": {},
        "use_dora": bool(variant and variant.dora),
        "use_rslora": bool(variant and variant.rslora),
        "lora_dropout": float(variant.dropout if variant else 0.0),
        "lora_bias": False,
    }
    keyed = {f"{prefix}.{k}" if prefix else k: v for k, v in config.items()}
    return json.dumps(keyed, indent=2, sort_keys=True)


def adapter_metadata(lora: Mapping[str, torch.Tensor], rank: int, alpha: float,
                     variant: LoraVariant | None = None) -> dict[str, str]:
    """Header metadata that keeps a runtime-named LoRA's alpha and variant (a checkpoint's ``lora.safetensors``), so
    reading or exporting it gives the trained scale, not alpha = rank."""
    return {ADAPTER_METADATA_KEY: _adapter_json(factor_pairs(lora, "the LoRA state dict"), rank, alpha, None, variant)}


def save_diffusers_lora(lora: Mapping[str, torch.Tensor], out_dir, rank: int, alpha: float, targets,
                        extra_metadata: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                        prefix: str = PREFIX, header: Mapping[str, str] | None = None,
                        variant: LoraVariant | None = None) -> Path:
    """Write ``out_dir/pytorch_lora_weights.safetensors`` for ``<Family>Pipeline.load_lora_weights(out_dir)``.

    ``lora`` is ``runtime.lora_state_dict(model)``; ``rank``/``alpha``/``targets`` are what ``add_lora`` was given
    (scale alpha/rank). ``extra_metadata`` (e.g. ``{"base_model_signature": ...}``) is recorded under
    ``squareq.<key>``; ``header`` (train/lora_metadata.py's ``modelspec.*`` and ``ss_*`` keys) as it is.
    ``prefix`` is the denoiser's pipeline component (``unet`` for SD 1.5 / SDXL). Returns the file's path.

    Alpha travels in the adapter metadata only: diffusers' FLUX loader refuses a file that has both that metadata
    and ``.alpha`` tensors, and other families' loaders do not read ``.alpha`` tensors at all. ComfyUI reads alpha
    from ``.alpha`` tensors alone, so for it write the kohya layout beside this file (``save_kohya_lora``).
    ``variant`` records rsLoRA (scale alpha/sqrt(rank)) and dropout in the adapter config; a DoRA LoRA's
    ``<layer>.lora_magnitude_vector`` tensors are written as PEFT writes them, with ``use_dora`` set.
    """
    if prefix not in PREFIXES:
        raise LoraFileError(f"prefix {prefix!r}: a diffusers LoRA names the denoiser {' or '.join(PREFIXES)}.")
    _check_dtype(dtype)
    layers = factor_pairs(lora, "the LoRA state dict")
    magnitudes = dora_magnitudes(lora, layers, "the LoRA state dict")
    if bool(magnitudes) != bool(variant and variant.dora):
        raise LoraFileError("the LoRA state dict " + ("has DoRA magnitudes but the variant is not DoRA" if magnitudes
                            else "has no DoRA magnitudes but the variant is DoRA") + "; pass the variant it was "
                            "trained with.")
    metadata = dict(header or {})
    metadata.update({"format": "pt", ADAPTER_METADATA_KEY: _adapter_json(layers, rank, alpha, prefix, variant)})
    metadata.update(_provenance("diffusers", rank, alpha, targets, extra_metadata))
    tensors = {}
    for layer in sorted(layers):
        a, b = layers[layer]
        tensors[f"{prefix}.{layer}{LORA_A}"] = a.detach().to("cpu", dtype).contiguous()
        tensors[f"{prefix}.{layer}{LORA_B}"] = b.detach().to("cpu", dtype).contiguous()
        if layer in magnitudes:
            # fp32 whatever ``dtype``: a magnitude is a whole row's norm, so its rounding would scale the row's output
            tensors[f"{prefix}.{layer}{MAGNITUDE}"] = magnitudes[layer].detach().to("cpu", torch.float32).contiguous()
    return _write(Path(out_dir) / WEIGHT_NAME, tensors, metadata)


def save_kohya_lora(lora: Mapping[str, torch.Tensor], path, rank: int, alpha: float, targets=(),
                    extra_metadata: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                    header: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None) -> Path:
    """Write the kohya/ComfyUI layout of ``lora`` for its family (``extra_metadata["family"]``, FLUX.1 when absent;
    train/layouts/) to the file ``path`` (``.safetensors``); returns it. A LoKr or LoHa (``<layer>.lokr_w1``, ...) is
    written in LyCORIS's layout (layouts/lycoris.py). ``config``: the model's config, which sizes the modules a
    layout needs beyond the LoRA's own (Wan's, HunyuanVideo's).

    Factors are stored in ``dtype`` (bf16 by default), ``.alpha`` in fp32. The header carries ``header`` (the
    ``modelspec.*`` and ``ss_*`` keys of a training run) without any ``lora_adapter_metadata`` (diffusers would apply
    alpha from it a second time), the layout's ``ss_network_*`` keys (``ss_network_dim`` is the training rank, before
    fusion), its ``modelspec.implementation`` and SquareQ's provenance.
    """
    _check_dtype(dtype)
    path = Path(path)
    if path.suffix != ".safetensors":
        raise LoraFileError(f"{path}: a kohya LoRA is written as a .safetensors file; give a path ending in "
                            ".safetensors.")
    family = (extra_metadata or {}).get("family", "flux")
    layout = layout_for(family, str(path))
    kind = adapter_kind(lora)
    if kind is None:
        tensors, module = layout.write(lora, alpha, config), layout.network_module
    else:
        tensors, module = lycoris_tensors(lora, rank, alpha, layout), LYCORIS_MODULE
    tensors = {k: (v if k.endswith(KOHYA_ALPHA) else v.to(dtype)).contiguous() for k, v in tensors.items()}
    metadata = {k: v for k, v in (header or {}).items() if k != ADAPTER_METADATA_KEY}
    metadata.setdefault("modelspec.sai_model_spec", MODELSPEC_VERSION)
    metadata.setdefault("modelspec.architecture", f"{architecture(family, config)[0]}/{kind or 'lora'}")
    metadata.update({
        "format": "pt",
        "modelspec.implementation": layout.implementation,
        "ss_network_module": module,
        "ss_network_dim": str(int(rank)),
        "ss_network_alpha": str(plain_number(alpha)),
    })
    if kind is not None:
        metadata.setdefault("ss_network_args", json.dumps({"algo": kind}))
    metadata.update(_provenance("lycoris" if kind else "kohya", rank, alpha, targets, extra_metadata))
    return _write(path, tensors, metadata)


def save_peft_adapter(lora: Mapping[str, torch.Tensor], folder, config: Mapping[str, Any],
                      header: Mapping[str, str] | None = None, dtype: torch.dtype = torch.bfloat16,
                      extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``folder/adapter_model.safetensors`` and ``adapter_config.json`` as PEFT's ``save_pretrained`` writes
    them, for ``PeftModel.from_pretrained(denoiser, folder)``: the LoKr or LoHa factors of ``lora``
    (``runtime.lora_state_dict``; ``<layer>.lokr_w1``, ...) under ``base_model.model.``, and ``config``
    (runtime/peft_lora.py ``lycoris_config``); ``extra_metadata`` as SquareQ's provenance in the weights' header, as
    :func:`save_diffusers_lora` records it. Each file is written atomically, the weights first: the config, which
    :func:`is_peft_adapter` looks for, marks a whole folder. Returns the folder."""
    _check_dtype(dtype)
    folder = Path(folder)
    tensors = {f"base_model.model.{name}": t.detach().to("cpu", dtype).contiguous() for name, t in sorted(lora.items())}
    provenance = _provenance("peft", int(config.get("r", 0)), float(config.get("alpha", 0)),
                             config.get("target_modules", ()), extra_metadata) if extra_metadata else {}
    _write(folder / PEFT_WEIGHTS, tensors, {"format": "pt", **(header or {}), **provenance})
    atomic_write_bytes(folder / PEFT_CONFIG, (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode())
    return folder


def is_peft_adapter(path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (:func:`save_peft_adapter`'s)."""
    return Path(path).is_dir() and (Path(path) / PEFT_CONFIG).is_file()
