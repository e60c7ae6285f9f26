"""What every non-diffusers LoRA layout shares: where a runtime layer goes in the file (:class:`Module`), the
tables that say so (:class:`Table`), the stacking of split diffusers layers onto one fused native layer, and the
writer that turns runtime factors into a layout's tensors (:class:`FamilyLayout`).

**Fused native layers.** Where the original checkpoint (the one ComfyUI, kohya and musubi-tuner name modules
after) has one linear for several diffusers layers (q, k and v; a single block's q, k, v and MLP input), a LoRA on
the split layers is the same delta on the fused layer when stacked: lora_down is the parts' A matrices concatenated
along the rank, lora_up is block-diagonal (each part's B in its own rows and rank columns), and alpha is multiplied
by the number of parts so that alpha_fused / (k·r) = alpha / r. A part that was not targeted gets zero rows in
lora_up and no rank. LoHa stacks the same way (each pair of its Hadamard factors is one such LoRA); LoKr cannot (a
stack of Kronecker products is not one), so its layouts name the split layers or refuse them.

**Alpha.** A layout keeps alpha as a scalar ``.alpha`` tensor where its readers consume one; where a reader leaves
``.alpha`` keys behind (diffusers then refuses the file, or applies it twice), the scale alpha/rank is baked into
lora_up instead and no ``.alpha`` is written, which every reader takes as scale 1. No layout's header carries
``lora_adapter_metadata``: diffusers reads it from any safetensors header and would then apply alpha again.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...models.flux_bfl import PLAIN, QKV, QKV_MLP, SWAP
from ..lora_factors import LoraFileError, dora_magnitudes, factor_pairs

__all__ = ["PLAIN", "QKV", "QKV_MLP", "SWAP", "FamilyLayout", "Module", "OneToOne", "Rule", "Style", "Table", "stack"]


@dataclass(frozen=True)
class Module:
    """Where a runtime layer's factors go: the file's module key (prefix included, no factor suffix), the runtime
    layers stacked in that module in row order (one for a 1:1 module), this layer's place among them, and how the
    parts stack (flux_bfl's PLAIN, QKV, QKV_MLP or SWAP)."""

    key: str
    parts: tuple[str, ...]
    part: int = 0
    layout: str = PLAIN


@dataclass(frozen=True)
class Rule:
    """One native module and the diffusers layers it holds; ``{i}`` is a block index in both."""

    native: str
    parts: tuple[str, ...]
    layout: str = PLAIN


def rules(native_prefix: str, diffusers_prefix: str, pairs) -> tuple[Rule, ...]:
    """Rules for a group of modules under one block prefix: ``pairs`` of (native module, diffusers layer or tuple
    of layers[, layout])."""
    out = []
    for native, layers, *layout in pairs:
        layers = (layers,) if isinstance(layers, str) else layers
        out.append(Rule(native_prefix + native, tuple(diffusers_prefix + d for d in layers), *layout))
    return tuple(out)


class Table:
    """Runtime layer name -> :class:`Module`, from :class:`Rule` s; ``key`` makes the file's module key of a native
    module name (``lora_unet_`` and underscores, ``diffusion_model.`` and dots, ...); ``refused`` maps a pattern of
    layers to why the layout cannot hold them."""

    def __init__(self, rules: tuple[Rule, ...], key: Callable[[str], str], refused: Mapping[str, str] | None = None):
        self.key = key
        self.refused = {re.compile(p): why for p, why in (refused or {}).items()}
        self._patterns = []
        for rule in rules:
            for part, layer in enumerate(rule.parts):
                pattern = re.compile("^" + re.escape(layer).replace(r"\{i\}", r"(\d+)") + "$")
                self._patterns.append((pattern, rule, part))

    def module(self, layer: str) -> Module | None:
        for pattern, rule, part in self._patterns:
            m = pattern.match(layer)
            if m:
                index = m.group(1) if pattern.groups else ""
                native, parts = rule.native.replace("{i}", index), tuple(p.replace("{i}", index) for p in rule.parts)
                return Module(self.key(native), parts, part, rule.layout)
        return None

    def reason(self, layer: str) -> str | None:
        return next((why for pattern, why in self.refused.items() if pattern.match(layer)), None)


class OneToOne:
    """Each runtime layer its own module under its own name (a family whose original names are diffusers'):
    ``key`` makes the file's key, ``accept`` says which layers the layout's reader knows."""

    def __init__(self, key: Callable[[str], str], accept: Callable[[str], bool] = lambda layer: True):
        self.key, self.accept = key, accept

    def module(self, layer: str) -> Module | None:
        return Module(self.key(layer), (layer,)) if self.accept(layer) else None

    def reason(self, layer: str) -> None:
        return None


def kohya_key(native: str) -> str:
    """kohya's and musubi-tuner's module key of a native module: ``double_blocks.0.img_attn.qkv`` is
    ``lora_unet_double_blocks_0_img_attn_qkv``."""
    return "lora_unet_" + native.replace(".", "_")


def _part_rows(module: Module, known: Mapping[int, int], hidden: int, mlp_ratio: float) -> list[int]:
    """Output rows of every part of a fused module, also of parts the LoRA did not target (``known``: the targeted
    parts' rows; ``hidden``: the module's input width)."""
    n = len(module.parts)
    if module.layout == QKV:
        rows = [next(iter(known.values()))] * n  # q, k and v are equal
    elif module.layout == QKV_MLP:
        # a single block's q, k, v are each as wide as its input; the MLP input is mlp_ratio x that (4 in FLUX.1,
        # Chroma and HunyuanVideo), used only when the MLP part has no LoRA
        rows = [hidden] * (n - 1) + [known.get(n - 1, int(mlp_ratio * hidden))]
    else:
        rows = [known[0]]
    for p, r in known.items():
        if r != rows[p]:
            raise LoraFileError(f"LoRA layer {module.parts[p]} has {r} output rows where its fused module "
                                f"{module.key} expects {rows[p]}; these factors do not belong to this model.")
    return rows


def stack(module: Module, parts: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
          mlp_ratio: float = 4.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, alpha multiplier) of a module from its targeted parts' (A, B), fp32: A's concatenated, B's
    block-diagonal in the parts' rows (zero rows for untargeted parts), SWAP's halves swapped. The module's scale
    is (alpha · multiplier) / its rank, which is each part's alpha / its own rank."""
    present = sorted(parts)
    ranks = [int(parts[p][0].shape[0]) for p in present]
    total, r0 = sum(ranks), ranks[0]
    rows = _part_rows(module, {p: int(b.shape[0]) for p, (_, b) in parts.items()},
                      int(parts[present[0]][0].shape[1]), mlp_ratio)
    down = torch.cat([parts[p][0].detach().float() for p in present], dim=0)
    ups, col = [], 0
    for p in range(len(module.parts)):
        up = torch.zeros(rows[p], total, dtype=torch.float32)
        if p in parts:
            b = parts[p][1].detach().float()
            r = b.shape[1]
            # one fused alpha serves every part: a part whose rank differs keeps its own scale through B
            up[:, col:col + r] = b if r == r0 else b * (r0 / r)
            col += r
        ups.append(up)
    up = torch.cat(ups, dim=0)
    if module.layout == SWAP:  # BFL's final adaLN holds (shift, scale) where diffusers has (scale, shift)
        scale, shift = up.chunk(2, dim=0)
        up = torch.cat([shift, scale], dim=0)
    # alpha_fused / (k·r) = alpha / r; an integer multiple keeps integral alphas exact
    return down.contiguous(), up.contiguous(), (total // r0 if total % r0 == 0 else total / r0)


def group_layers(layers: Mapping[str, Any], module_of: Callable[[str], Module]) -> dict[str, tuple[Module, dict]]:
    """{module key: (module, {part: layer's value})} of runtime layers."""
    out: dict[str, tuple[Module, dict]] = {}
    for layer, value in layers.items():
        module = module_of(layer)
        out.setdefault(module.key, (module, {}))[1][module.part] = value
    return out


@dataclass(frozen=True)
class Style:
    """A layout's factor suffixes, and whether alpha is baked into lora_up (no ``.alpha`` keys)."""

    down: str = ".lora_down.weight"
    up: str = ".lora_up.weight"
    bake: bool = False


KOHYA = Style()
PEFT_NAMES_BAKED = Style(".lora_A.weight", ".lora_B.weight", bake=True)
ALPHA = ".alpha"


def refuse_dora(lora: Mapping[str, torch.Tensor], layers) -> None:
    if dora_magnitudes(lora, layers, "the LoRA state dict"):
        raise LoraFileError("a DoRA LoRA has no kohya/ComfyUI layout that SquareQ can write exactly (kohya's LoRA "
                            "has no DoRA, and LyCORIS's dora_scale is measured differently); use the diffusers file "
                            "(--format diffusers, save_format = [\"diffusers\"]).")


def lora_tensors(lora: Mapping[str, torch.Tensor], alpha: float, module_of: Callable[[str], Module],
                 style: Style = KOHYA, mlp_ratio: float = 4.0) -> dict[str, torch.Tensor]:
    """A layout's tensors (fp32) of a runtime LoRA: each layer's scale alpha / its rank reproduced exactly, split
    layers stacked onto their fused module."""
    layers = factor_pairs(lora, "the LoRA state dict")
    refuse_dora(lora, layers)
    out = {}
    grouped = group_layers(layers, module_of)
    for key in sorted(grouped):
        module, parts = grouped[key]
        down, up, times = stack(module, parts, mlp_ratio)
        if style.bake:
            up = up * (alpha * times / down.shape[0])
        else:
            out[key + ALPHA] = torch.tensor(float(alpha * times), dtype=torch.float32)
        out[key + style.down], out[key + style.up] = down, up
    return out


def config_value(config: Mapping | None, *keys: str, default=None):
    """The first of ``keys`` a model config has, else ``default``."""
    for key in keys:
        if config and config.get(key) is not None:
            return config[key]
    return default


@dataclass(frozen=True)
class FamilyLayout:
    """One family's non-diffusers LoRA layout: who writes it and what reads it back, where each runtime layer goes
    (``module_of``, :class:`LoraFileError` in one sentence for a layer it has no place for), its suffixes and alpha
    rule, and ``finish``: what its reader needs beyond the LoRA's own modules (zero modules), given the model's
    config when known. ``lokr_key``: LyCORIS LoKr keys by diffusers layer name for a family whose native layers
    fuse (a Kronecker product does not stack), None to use ``module_of``'s keys."""

    family: str
    name: str
    network_module: str
    implementation: str
    pipeline: str
    converter: str
    module_of: Callable[[str], Module]
    style: Style = KOHYA
    finish: Callable[[dict, Mapping | None], None] | None = field(default=None, compare=False)
    lokr_key: Callable[[str], str] | None = field(default=None, compare=False)

    def write(self, lora: Mapping[str, torch.Tensor], alpha: float, config: Mapping | None = None,
              ) -> dict[str, torch.Tensor]:
        tensors = lora_tensors(lora, alpha, self.module_of, self.style,
                               float(config_value(config, "mlp_ratio", default=4.0)))
        if self.finish is not None:
            self.finish(tensors, config)
        return tensors


def table_module_of(table: Table | OneToOne, what: str) -> Callable[[str], Module]:
    """``module_of`` of a :class:`Table` layout (``what`` names it in refusals)."""

    def module_of(layer: str) -> Module:
        module = table.module(layer)
        if module is None:
            why = table.reason(layer)
            raise LoraFileError(f"LoRA layer {layer} cannot be written in {what}" + (f": it is {why}" if why else "")
                                + "; drop it from targets, or keep to the diffusers file, which holds every layer.")
        return module

    return module_of
