"""LoRA variants through PEFT's own layers: DoRA, rsLoRA and LoRA dropout on a runtime model's QuantLinear, and
LyCORIS' LoKr (Kronecker factors) and LoHa (Hadamard product of two low-rank pairs) as PEFT implements them.

PEFT's ``lora.Linear`` wraps a QuantLinear through ``LoraConfig``'s custom-module mapping; its forward calls the
QuantLinear (dequantize and matmul, streamed or not) and adds the adapter, so every variant PEFT has works as PEFT
defines it. Three things make that hold on a streamed model:

* the QuantLinear's packed weight is named ``quantized`` (a ``qweight`` attribute makes PEFT treat it as GPTQ);
* biases are bound to the QuantLinear found at load (runtime/loader.py), not looked up by a name PEFT changes;
* DoRA reads the base weight's values when it is attached: each block is brought into a slot while PEFT wraps its
  layers, and those layers report their real weight (``QuantLinear.exact_weight``).

Factors are fp32 masters, initialised from ``seed`` exactly as :func:`squareq.runtime.lora.add_lora` initialises its
own, so a plain LoRA through PEFT starts where the fast path starts. Parameter names are reported in the file
naming (``<layer>.lora_A.weight``, ``<layer>.lora_magnitude_vector``) by :func:`file_name`.

PEFT builds a LoKr or LoHa layer only around an ``nn.Linear`` (it reads the base layer's sizes, weight shape, device
and dtype to shape and place the factors): :func:`add_peft_lycoris` builds each around a weightless stand-in
(:class:`_Shape`) and then sets the QuantLinear as its base layer, which is all its forward calls. Their parameters
are named as PEFT saves them (``<layer>.lokr_w1``, ``<layer>.hada_w1_a``, ...).
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..extras import pip_command
from .qlinear import QuantLinear, lora_a_init

ADAPTER = "default"


class PeftMissing(ImportError):
    """DoRA, rsLoRA or dropout was asked for and peft is not installed; the message says how to install it."""


def require_peft() -> None:
    """Raise :class:`PeftMissing` unless peft can be imported (checked before a run loads anything)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise PeftMissing("DoRA, rsLoRA and LoRA dropout go through PEFT's layers, and the peft package is not "
                          f"installed: {pip_command('peft')} (or pip install peft), or train a plain "
                          "LoRA.") from None
_PEFT_SUFFIX = re.compile(r"\.(lora_A|lora_B)\.default\.weight$")
_LYCORIS = re.compile(r"\.((?:lokr|hada)_[wt][12](?:_[ab])?)\.default$")
KINDS = ("lora", "lokr", "loha")
_MAGNITUDE = re.compile(r"\.lora_magnitude_vector\.default\.weight$")


@dataclass(frozen=True)
class LoraVariant:
    """What differs from a plain LoRA: DoRA's magnitude vector, rsLoRA's scale alpha/sqrt(rank), dropout on the
    adapter's input while training; or another kind of adapter (``kind`` lokr or loha; ``factor``: LoKr's
    ``decompose_factor``, -1 for the most balanced split)."""

    dora: bool = False
    rslora: bool = False
    dropout: float = 0.0
    kind: str = "lora"
    factor: int = -1

    @property
    def plain(self) -> bool:
        return self.kind == "lora" and not (self.dora or self.rslora or self.dropout)


def file_name(name: str) -> str:
    """A PEFT parameter name in the LoRA file naming: ``x.lora_A.default.weight`` -> ``x.lora_A.weight``,
    ``x.lora_magnitude_vector.default.weight`` -> ``x.lora_magnitude_vector`` (what PEFT itself saves)."""
    return _LYCORIS.sub(r".\1", _MAGNITUDE.sub(".lora_magnitude_vector", _PEFT_SUFFIX.sub(r".\1.weight", name)))


def is_lora_parameter(name: str) -> bool:
    return (".lora_A." in name or ".lora_B." in name or ".lora_magnitude_vector." in name
            or _LYCORIS.search(name) is not None)


def _bound(module: nn.Module):
    """Keep a streamed block in a slot (its layers bound) for the duration; nothing to do for other modules."""
    from .blocks import BlockRunner
    from .streamer import FORWARD

    runner = module.__dict__.get("forward")
    return runner.in_slot(FORWARD, training=False) if isinstance(runner, BlockRunner) else contextlib.nullcontext()


def _regions(model: nn.Module, layers: list[str]) -> list[tuple[str, list[str]]]:
    """``layers`` grouped by the name of the slab block holding them (names relative to it); the rest under ""."""
    from .loader import runtime_of

    blocks = [b.name for b in runtime_of(model).manifest.blocks]
    grouped: dict[str, list[str]] = {}
    for layer in layers:
        owner = next((b for b in blocks if layer.startswith(b + ".")), "")
        grouped.setdefault(owner, []).append(layer[len(owner) + 1:] if owner else layer)
    return list(grouped.items())


def add_peft_lora(model: nn.Module, layers: list[str], rank: int, alpha: float, variant: LoraVariant,
                  seed: int = 0) -> list[nn.Parameter]:
    """Wrap the QuantLinear ``layers`` (full names, in model order) of a runtime model in PEFT LoRA layers with
    ``variant``; return the trainable parameters (factors, and DoRA's magnitudes) in that order."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.layer import Linear as PeftLinear

    generator = torch.Generator().manual_seed(seed)
    starts = {}  # add_lora's init of every lora_A, drawn in add_lora's order, so both paths start alike
    for name in layers:
        base = model.get_submodule(name)
        base.exact_weight = variant.dora
        starts[name] = lora_a_init(rank, base.in_features, generator)
    for owner, names in _regions(model, layers):
        region = model.get_submodule(owner) if owner else model
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=variant.dropout, use_dora=variant.dora,
                            use_rslora=variant.rslora, bias="none",
                            # exactly these layers: a suffix pattern would also take e.g. the model's own proj_out
                            target_modules="^(?:" + "|".join(re.escape(n) for n in names) + ")$")
        config._register_custom_module({QuantLinear: PeftLinear})
        with _bound(region), warnings.catch_warnings():  # DoRA's magnitudes start from the base weight's row norms
            # PEFT warns of any layer type it does not know; QuantLinear is the one this module maps, on purpose
            warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
            inject_adapter_in_model(config, region, adapter_name=ADAPTER)
            for name in names:
                _start(region.get_submodule(name), starts[f"{owner}.{name}" if owner else name], variant)
    params = []
    for name in layers:
        wrapper = model.get_submodule(name)
        params += [wrapper.lora_A[ADAPTER].weight, wrapper.lora_B[ADAPTER].weight]
        if variant.dora:
            params.append(wrapper.lora_magnitude_vector[ADAPTER].weight)
    for p in params:
        p.requires_grad_(True)
    return params


def _start(wrapper: nn.Module, a: torch.Tensor, variant: LoraVariant) -> None:
    """fp32 factors from ``a`` and a zero B; DoRA's magnitude measured again from them in fp32 (PEFT measured it
    with its bf16 copies, which would start the model a rounding away from the base)."""
    for part in (wrapper.lora_A, wrapper.lora_B, wrapper.lora_magnitude_vector):
        part.float()
    with torch.no_grad():
        wrapper.lora_A[ADAPTER].weight.copy_(a)
        wrapper.lora_B[ADAPTER].weight.zero_()
    if variant.dora:
        with torch.no_grad():
            wrapper.lora_magnitude_vector[ADAPTER].update_layer(
                base_layer=wrapper.get_base_layer(), lora_A=wrapper.lora_A[ADAPTER].weight,
                lora_B=wrapper.lora_B[ADAPTER].weight, scaling=wrapper.scaling[ADAPTER])


class _Shape(nn.Linear):
    """What PEFT's LoKr and LoHa layers read of their base layer while they build their factors: nn.Linear's type, the
    sizes, and a weight's shape, device and dtype (fp32, the factors' master type); it holds no weight."""

    def __init__(self, layer: QuantLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        empty = torch.empty((), dtype=torch.float32, device=layer.scratch.buffer.device)
        self.weight = nn.Parameter(empty.expand(self.out_features, self.in_features), requires_grad=False)
        self.bias = None


def add_peft_lycoris(model: nn.Module, layers: list[str], rank: int, alpha: float, variant: LoraVariant,
                     seed: int = 0) -> list[nn.Parameter]:
    """Wrap the QuantLinear ``layers`` (full names, in model order) in PEFT's LoKr or LoHa layers (``variant.kind``),
    factors in fp32 initialised as PEFT initialises them (the delta starts at zero) from ``seed``; return the
    trainable parameters in that order."""
    require_peft()
    from peft.tuners.loha.layer import Linear as LoHaLinear
    from peft.tuners.lokr.layer import Linear as LoKrLinear

    config = _peft_config(variant, rank, alpha)
    layer_class = LoKrLinear if variant.kind == "lokr" else LoHaLinear
    params = []
    with torch.random.fork_rng(devices=[]):  # PEFT draws from the global generator, on the host: seeded, restored
        torch.manual_seed(seed)
        for name in layers:
            base = model.get_submodule(name)
            wrapper = layer_class(_Shape(base), ADAPTER, config, r=rank, alpha=alpha)
            wrapper.base_layer = base  # all the wrapper's forward calls of it
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, wrapper)
            own = [p for n, p in wrapper.named_parameters() if not n.startswith("base_layer.")]
            for p in own:
                p.requires_grad_(True)
            params += own
    return params


def lycoris_config(variant: LoraVariant, rank: int, alpha: float, layers: list[str]) -> dict:
    """The ``adapter_config.json`` PEFT writes for these factors (``PeftModel.from_pretrained`` reads it back)."""
    config = _peft_config(variant, rank, alpha).to_dict()
    return {**config, "peft_type": str(config["peft_type"].value), "target_modules": sorted(layers)}


def _peft_config(variant: LoraVariant, rank: int, alpha: float):
    """PEFT's LoKr or LoHa config for ``variant``: the one the layers are built from and the file records."""
    from peft import LoHaConfig, LoKrConfig

    if variant.kind == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, decompose_factor=variant.factor)
    return LoHaConfig(r=rank, alpha=alpha)
