"""Putting a LoRA on a runtime model (``squareq.runtime.load``) for sampling: the factors ``load_lora`` read
(``attach_lora``; a DoRA LoRA through PEFT's layers), or a PEFT LoKr/LoHa adapter folder as it is
(``attach_peft_adapter``). Every layer is checked before any is changed, and a factor that does not fit the slab's
layer is refused naming the file's own key."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .layouts.read import key_of
from .lora_factors import LORA_A, LORA_B, MAGNITUDE, LoraFileError, few_names
from .lora_reader import lycoris_settings, read_peft_adapter


def attach_lora(model: torch.nn.Module, lora: Mapping[str, torch.Tensor],
                info: Mapping[str, Any]) -> list[torch.nn.Parameter]:
    """Give a runtime model (``squareq.runtime.load``) the factors ``load_lora`` read: each layer gets its own rank
    and the file's alpha, so its scale is alpha / rank as in the file. Returns the factor parameters."""
    from ..runtime import QuantLinear

    if info.get("use_dora"):
        return _attach_dora(model, lora, info)
    modules = {}
    for layer in sorted({k[: -len(LORA_A)] for k in lora if k.endswith(LORA_A)}):
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            module = None
        if not isinstance(module, QuantLinear):
            raise LoraFileError(f"the LoRA names layer {layer}, which is not a quantized layer of this "
                                f"{type(model).__name__}; it was trained for another model.")
        rank = lora[layer + LORA_A].shape[0]
        _check_shape(info, layer + LORA_A, lora[layer + LORA_A], (rank, module.in_features))
        _check_shape(info, layer + LORA_B, lora[layer + LORA_B], (module.out_features, rank))
        modules[layer] = module
    params = []  # every layer checked first, so a refused LoRA leaves the model as it was
    for layer, module in modules.items():
        a, b = lora[layer + LORA_A], lora[layer + LORA_B]
        module.add_lora(a.shape[0], float(info["alpha"]), device=module.scratch.buffer.device)
        with torch.no_grad():
            module.lora_A.weight.copy_(a)
            module.lora_B.weight.copy_(b)
        params += [module.lora_A.weight, module.lora_B.weight]
    return params


def _attach_dora(model: torch.nn.Module, lora: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> list:
    """A DoRA LoRA goes on through PEFT's layers (runtime.add_lora with the DoRA variant), one rank for all."""
    from ..runtime import LoraVariant, add_lora, lora_parameters

    layers = sorted({k[: -len(LORA_A)] for k in lora if k.endswith(LORA_A)})
    ranks = {int(lora[layer + LORA_A].shape[0]) for layer in layers}
    if len(ranks) > 1:
        raise LoraFileError(f"the DoRA LoRA has layers of ranks {sorted(ranks)}; SquareQ applies DoRA at one rank, so "
                            "train or save it with one rank for every layer.")
    try:
        add_lora(model, rank=ranks.pop(), alpha=float(info["alpha"]), targets=layers, variant=LoraVariant(dora=True))
    except ValueError as exc:
        raise LoraFileError(f"the LoRA names layers this {type(model).__name__} does not have ({exc}); it was trained "
                            "for another model.") from None
    params = lora_parameters(model)
    if set(params) != set(lora):
        raise LoraFileError(f"the LoRA's layers ({few_names(layers)}) are not all quantized layers of this "
                            f"{type(model).__name__}; it was trained for another model.")
    for name, p in params.items():
        _check_shape(info, name, lora[name], tuple(p.shape))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(lora[name])
    return list(params.values())


def _check_shape(info: Mapping[str, Any], name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
    """Refuse a factor that does not fit the slab's layer, naming the file's key: ``copy_`` would raise a bare
    RuntimeError, or broadcast a [rank, 1] factor over the layer without a word."""
    if tuple(tensor.shape) == tuple(want):
        return
    layer = _layer_of(name)[0]
    raise LoraFileError(f"{info.get('file', 'the LoRA')}: {_file_key(info, name)} is {list(tensor.shape)} but the "
                        f"slab's layer {layer} takes {list(want)}; the LoRA was trained for another model, so pass one "
                        "trained on the model this slab was compiled from.")


def _file_key(info: Mapping[str, Any], name: str) -> str:
    """The key a runtime factor name (``<layer>.lora_A.weight``) has in the file ``load_lora`` read."""
    layer, suffix = _layer_of(name)
    if info.get("layout") != "kohya" or suffix not in (LORA_A, LORA_B):
        return info.get("key_prefix", "") + name
    try:
        key = key_of(info.get("family") or "flux", layer, suffix)
    except LoraFileError:
        return name
    return f"{key} (its part for layer {layer})"


def _layer_of(name: str) -> tuple[str, str]:
    """(layer, suffix) of a runtime factor name: ``.lora_A.weight``, ``.lora_B.weight`` or the DoRA magnitude."""
    suffix = next((s for s in (LORA_A, LORA_B, MAGNITUDE) if name.endswith(s)), "")
    return name[: len(name) - len(suffix)], suffix


def attach_peft_adapter(model: torch.nn.Module, folder) -> list[torch.nn.Parameter]:
    """Put the LoKr or LoHa adapter of a PEFT folder on a runtime model (``squareq.runtime.load``), as
    ``lora_type`` trained it: its rank, alpha, factor and layers from ``adapter_config.json``, its factors from
    ``adapter_model.safetensors``. Returns the adapter's parameters. :class:`LoraFileError` for a folder that is not
    one (another PEFT type, factors that do not fit)."""
    from ..runtime import LoraVariant, add_lora, lora_parameters

    folder = Path(folder)
    named, config, _ = read_peft_adapter(folder)
    kind, rank, alpha, layers = lycoris_settings(folder, config)
    variant = LoraVariant(kind=kind, factor=int(config.get("decompose_factor", -1)))
    try:
        params = add_lora(model, rank=rank, alpha=alpha, targets=layers, variant=variant)
    except ValueError as exc:
        raise LoraFileError(f"{folder}: {exc}") from None
    own = lora_parameters(model)
    if set(own) != set(named) or any(own[n].shape != named[n].shape for n in own):
        missing = sorted(set(own) ^ set(named)) or [n for n in own if own[n].shape != named[n].shape]
        raise LoraFileError(f"{folder} does not fit this model's {kind} layers (e.g. {missing[0]}); it was trained on "
                            "another slab's model, so sample with that slab.")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(named[name].float())
    return params
