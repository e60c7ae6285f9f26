"""LoRA on a loaded model's QuantLinear layers, chosen by name the way PEFT's ``target_modules`` chooses.

A target matches a layer whose name equals it or ends with ``.<target>``; the default is FLUX's attention
projections, as in the diffusers FLUX LoRA scripts. Factors are fp32 master weights on the runtime's
device for the whole run (they are never streamed); under bf16 autocast they compute in bf16.
"""
from __future__ import annotations

import torch
from torch import nn

from .block_compile import trace_quantized_layers
from .peft_lora import LoraVariant, add_peft_lora, add_peft_lycoris, file_name, is_lora_parameter
from .qlinear import QuantLinear

DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def matches(name: str, targets) -> bool:
    """PEFT target_modules rule: the name equals a target or ends with ``.<target>``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def add_lora(model: nn.Module, rank: int = 16, alpha: float | None = None, targets=DEFAULT_TARGETS,
             seed: int = 0, variant: LoraVariant | None = None, peft: bool = False) -> list[nn.Parameter]:
    """Attach rank-``rank`` LoRA factors (scale alpha/rank; alpha defaults to rank) to every QuantLinear whose
    name matches ``targets``; return the new trainable parameters.

    A plain LoRA uses SquareQ's own layer (the factors sit on the QuantLinear); ``variant`` (DoRA, rsLoRA,
    dropout), or ``peft=True`` for a plain one, wraps the layers in PEFT's LoRA layers instead (peft_lora.py)."""
    if rank < 1:
        raise ValueError(f"rank={rank}: a LoRA rank must be at least 1.")
    if isinstance(targets, str):
        targets = (targets,)
    alpha = float(alpha if alpha is not None else rank)
    layers = [name for name, module in model.named_modules()
              if isinstance(module, QuantLinear) and matches(name, targets)]
    if not layers:
        raise ValueError(f"no quantized layer of {type(model).__name__} matches the LoRA targets {list(targets)}; "
                         "name layers as PEFT target_modules do (e.g. to_q, attn.to_out.0).")
    variant = variant or LoraVariant()
    if peft or not variant.plain:
        adder = add_peft_lora if variant.kind == "lora" else add_peft_lycoris
        params = adder(model, layers, rank, alpha, variant, seed)
        if _compiled(model):  # PEFT's new wrappers run eagerly (runtime/block_compile.py)
            trace_quantized_layers(model)
        return params
    g = torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    for name in layers:
        module = model.get_submodule(name)
        module.add_lora(rank, alpha, generator=g, device=module.scratch.buffer.device)
        params += [module.lora_A.weight, module.lora_B.weight]
    return params


def _compiled(model: nn.Module) -> bool:
    from .loader import RUNTIME_ATTR  # loader imports this module's users; here at call time only

    return getattr(getattr(model, RUNTIME_ATTR, None), "compiled", False)


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every LoRA parameter of ``model`` by its name in a LoRA file (``<layer>.lora_A.weight``, and
    ``<layer>.lora_magnitude_vector`` for DoRA), whichever layer holds it."""
    return {file_name(n): p for n, p in model.named_parameters() if is_lora_parameter(n)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the LoRA factors on the CPU, in PEFT naming relative to the model."""
    return {n: p.detach().to("cpu", copy=True) for n, p in lora_parameters(model).items()}
