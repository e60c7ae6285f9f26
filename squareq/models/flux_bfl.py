"""Black Forest Labs' single-file FLUX.1 layout <-> diffusers ``FluxTransformer2DModel`` names.

BFL checkpoints (``flux1-dev.safetensors``) name tensors after the reference implementation
(``double_blocks.3.img_attn.qkv.weight``) and fuse some projections that diffusers keeps apart:

* a double block's ``img_attn.qkv`` / ``txt_attn.qkv`` hold q, k and v stacked along dim 0;
* a single block's ``linear1`` holds q, k, v and the MLP input projection stacked along dim 0;
* the final layer's adaLN modulation stores (shift, scale) where diffusers' ``AdaLayerNormContinuous``
  expects (scale, shift), so the two halves are swapped.

The mapping is one table of rules, each naming a BFL module, the diffusers module(s) it becomes and how
the tensor is split. Every rule works on single tensors, so any subset of a checkpoint converts on its
own: the streaming source maps one block at a time without reading the others. Sizes come from shapes
and the config, never from constants, so any FLUX.1-shaped model (12B or tiny) maps the same way.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import ModelError

# How a BFL tensor relates to its diffusers part(s).
PLAIN = "plain"  # renamed only
QKV = "qkv"  # [q; k; v], three equal parts along dim 0
QKV_MLP = "qkv_mlp"  # [q; k; v; mlp_in], three parts of the inner dim and the rest
SWAP = "swap"  # same name count, halves along dim 0 swapped

_LINEAR = (("weight", "weight"), ("bias", "bias"))
_NORM = (("scale", "weight"),)


@dataclass(frozen=True)
class _Rule:
    bfl: str  # BFL module path inside its group, e.g. "img_attn.qkv"
    diffusers: tuple[str, ...]  # diffusers module path(s) inside its group, one per part
    layout: str = PLAIN
    params: tuple[tuple[str, str], ...] = _LINEAR  # (BFL parameter, diffusers parameter)


def _r(bfl: str, *diffusers: str, layout: str = PLAIN, params=_LINEAR) -> _Rule:
    return _Rule(bfl, tuple(diffusers), layout, params)


_DOUBLE = (
    _r("img_mod.lin", "norm1.linear"),
    _r("txt_mod.lin", "norm1_context.linear"),
    _r("img_attn.qkv", "attn.to_q", "attn.to_k", "attn.to_v", layout=QKV),
    _r("txt_attn.qkv", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", layout=QKV),
    _r("img_attn.norm.query_norm", "attn.norm_q", params=_NORM),
    _r("img_attn.norm.key_norm", "attn.norm_k", params=_NORM),
    _r("txt_attn.norm.query_norm", "attn.norm_added_q", params=_NORM),
    _r("txt_attn.norm.key_norm", "attn.norm_added_k", params=_NORM),
    _r("img_attn.proj", "attn.to_out.0"),
    _r("txt_attn.proj", "attn.to_add_out"),
    _r("img_mlp.0", "ff.net.0.proj"),
    _r("img_mlp.2", "ff.net.2"),
    _r("txt_mlp.0", "ff_context.net.0.proj"),
    _r("txt_mlp.2", "ff_context.net.2"),
)

_SINGLE = (
    _r("linear1", "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", layout=QKV_MLP),
    _r("linear2", "proj_out"),
    _r("modulation.lin", "norm.linear"),
    _r("norm.query_norm", "attn.norm_q", params=_NORM),
    _r("norm.key_norm", "attn.norm_k", params=_NORM),
)

_EMBED = "time_text_embed."
_RESIDENT = (
    _r("img_in", "x_embedder"),
    _r("txt_in", "context_embedder"),
    _r("time_in.in_layer", _EMBED + "timestep_embedder.linear_1"),
    _r("time_in.out_layer", _EMBED + "timestep_embedder.linear_2"),
    _r("vector_in.in_layer", _EMBED + "text_embedder.linear_1"),
    _r("vector_in.out_layer", _EMBED + "text_embedder.linear_2"),
    _r("guidance_in.in_layer", _EMBED + "guidance_embedder.linear_1"),
    _r("guidance_in.out_layer", _EMBED + "guidance_embedder.linear_2"),
    _r("final_layer.linear", "proj_out"),
    _r("final_layer.adaLN_modulation.1", "norm_out.linear", layout=SWAP),
)


@dataclass(frozen=True)
class _Group:
    bfl: str  # prefix pattern; "{i}" is the block index
    diffusers: str
    rules: tuple[_Rule, ...]

    def _compile(self, pattern: str) -> re.Pattern:
        return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(\d+)") + r"(.+)$")


# Block groups come first: the resident group has an empty prefix and matches anything.
GROUPS = (
    _Group("double_blocks.{i}.", "transformer_blocks.{i}.", _DOUBLE),
    _Group("single_blocks.{i}.", "single_transformer_blocks.{i}.", _SINGLE),
    _Group("", "", _RESIDENT),
)

# Diffusers block list -> BFL block list (the streamed block lists of the FLUX adapter).
BLOCK_LISTS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks"}

# Where transformer weights may sit inside a single file (ComfyUI-style all-in-one files add a prefix).
KEY_PREFIXES = ("", "model.diffusion_model.")
_MARKER = "double_blocks.0.img_attn.qkv.weight"


def _split_name(name: str, pattern: re.Pattern) -> tuple[str, str, str] | None:
    """(block index or "", module path, parameter) of ``name`` under a group pattern, or None."""
    m = pattern.match(name)
    if not m:
        return None
    index, rest = (m.group(1), m.group(2)) if pattern.groups == 2 else ("", m.group(1))
    module, _, param = rest.rpartition(".")
    return (index, module, param) if module else None


class _Table:
    """Lookups in both directions, built once from GROUPS."""

    def __init__(self) -> None:
        self.bfl = []  # (pattern, group, {bfl module: rule})
        self.diffusers = []  # (pattern, group, {diffusers module: (rule, part)})
        for g in GROUPS:
            self.bfl.append((g._compile(g.bfl), g, {r.bfl: r for r in g.rules}))
            back = {d: (r, part) for r in g.rules for part, d in enumerate(r.diffusers)}
            self.diffusers.append((g._compile(g.diffusers), g, back))

    def from_bfl(self, name: str):
        """(group, index, rule, diffusers parameter) for a BFL tensor name, or None."""
        for pattern, group, rules in self.bfl:
            parts = _split_name(name, pattern)
            if parts is None:
                continue
            index, module, param = parts
            rule = rules.get(module)
            if rule is None:
                return None  # a block prefix matched, so no other group can
            names = dict(rule.params)
            return (group, index, rule, names[param]) if param in names else None
        return None

    def from_diffusers(self, name: str):
        """(group, index, rule, part, BFL parameter) for a diffusers tensor name, or None."""
        for pattern, group, rules in self.diffusers:
            parts = _split_name(name, pattern)
            if parts is None:
                continue
            index, module, param = parts
            found = rules.get(module)
            if found is None:
                if group.diffusers:  # a block prefix matched: no other group can
                    return None
                continue
            rule, part = found
            names = {d: b for b, d in rule.params}
            return (group, index, rule, part, names[param]) if param in names else None
        return None


_TABLE = _Table()


def _cfg(config: Any, key: str):
    if isinstance(config, Mapping):
        return config[key]
    return getattr(config, key)


def _inner_dim(config: Any) -> int:
    return int(_cfg(config, "num_attention_heads")) * int(_cfg(config, "attention_head_dim"))


def _few(names: Sequence[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _split(name: str, t: torch.Tensor, rule: _Rule, config: Any) -> list[torch.Tensor]:
    rows = t.shape[0] if t.dim() else 0
    if rule.layout == PLAIN:
        return [t]
    if rule.layout == SWAP:
        if rows % 2:
            raise ModelError(f"BFL tensor {name} has {rows} rows; expected an even number (shift and scale halves).")
        shift, scale = t.chunk(2, dim=0)
        return [torch.cat([scale, shift], dim=0)]
    if rule.layout == QKV:
        if rows % 3:
            raise ModelError(f"BFL tensor {name} has {rows} rows; expected q, k and v of equal size (a multiple of 3).")
        return list(t.chunk(3, dim=0))
    inner = _inner_dim(config)  # QKV_MLP
    if rows <= 3 * inner:
        raise ModelError(f"BFL tensor {name} has {rows} rows; expected 3 x {inner} (q, k, v) plus the MLP input rows.")
    return list(t.split([inner, inner, inner, rows - 3 * inner], dim=0))


def _join(name: str, parts: list[torch.Tensor], rule: _Rule) -> torch.Tensor:
    if rule.layout == PLAIN:
        return parts[0]
    if rule.layout == SWAP:
        scale, shift = parts[0].chunk(2, dim=0)
        return torch.cat([shift, scale], dim=0)
    return torch.cat(parts, dim=0)


def is_bfl_name(name: str) -> bool:
    """Whether ``name`` is a tensor name of the BFL FLUX.1 layout (without any file prefix)."""
    return _TABLE.from_bfl(name) is not None


def bfl_key_prefix(names) -> str | None:
    """The prefix ('' or 'model.diffusion_model.') under which ``names`` hold a BFL FLUX.1 transformer, or None."""
    names = set(names)
    for prefix in KEY_PREFIXES:
        if prefix + _MARKER in names:
            return prefix
    return None


def bfl_block_prefix(diffusers_block: str) -> str:
    """The BFL name prefix of a diffusers block path: ``transformer_blocks.3`` -> ``double_blocks.3.``."""
    head, _, index = diffusers_block.rpartition(".")
    if head not in BLOCK_LISTS or not index.isdigit():
        raise ModelError(f"{diffusers_block!r} is not a FLUX block path (transformer_blocks.N or "
                         "single_transformer_blocks.N).")
    return f"{BLOCK_LISTS[head]}.{index}."


def bfl_lookup(diffusers_name: str):
    """(group, block index, rule, part, parameter) placing a diffusers tensor in the BFL layout, or None."""
    return _TABLE.from_diffusers(diffusers_name)


def bfl_name(diffusers_name: str) -> str:
    """The BFL tensor holding the diffusers tensor ``diffusers_name`` (fused tensors hold several)."""
    found = _TABLE.from_diffusers(diffusers_name)
    if found is None:
        raise ModelError(f"{diffusers_name} is not a FluxTransformer2DModel tensor with a BFL FLUX.1 counterpart.")
    group, index, rule, _, param = found
    return group.bfl.replace("{i}", index) + rule.bfl + "." + param


def bfl_to_diffusers(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """BFL FLUX.1 tensors -> diffusers ``FluxTransformer2DModel`` names, fused projections split.

    ``state`` may be any subset of a checkpoint (one block, say); each tensor converts on its own. Split
    parts are views of the fused tensor. ``config`` is the diffusers config (a mapping or an object with
    ``num_attention_heads`` and ``attention_head_dim``), needed to split a single block's ``linear1``.
    Raises ModelError for names that are not BFL FLUX.1 tensors.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in state.items():
        found = _TABLE.from_bfl(name)
        if found is None:
            unknown.append(name)
            continue
        group, index, rule, param = found
        prefix = group.diffusers.replace("{i}", index)
        for module, part in zip(rule.diffusers, _split(name, t, rule, config)):
            out[f"{prefix}{module}.{param}"] = part
    if unknown:
        raise ModelError(f"{len(unknown)} tensors are not BFL FLUX.1 names: {_few(unknown)}.")
    return out


def diffusers_to_bfl(state: Mapping[str, torch.Tensor], config: Any = None) -> dict[str, torch.Tensor]:
    """Diffusers ``FluxTransformer2DModel`` tensors -> BFL FLUX.1 names, split projections fused again.

    Every part of a fused BFL tensor must be in ``state`` (q, k and v together). Raises ModelError for
    names without a BFL counterpart or incomplete fused groups. ``config`` is accepted for symmetry.
    """
    buckets: dict[str, tuple[_Rule, dict[int, torch.Tensor]]] = {}
    unknown = []
    for name, t in state.items():
        found = _TABLE.from_diffusers(name)
        if found is None:
            unknown.append(name)
            continue
        group, index, rule, part, param = found
        key = group.bfl.replace("{i}", index) + rule.bfl + "." + param
        buckets.setdefault(key, (rule, {}))[1][part] = t
    if unknown:
        raise ModelError(f"{len(unknown)} tensors have no BFL FLUX.1 counterpart: {_few(unknown)}.")
    out = {}
    for key, (rule, parts) in buckets.items():
        if len(parts) != len(rule.diffusers):
            missing = [d for i, d in enumerate(rule.diffusers) if i not in parts]
            raise ModelError(f"cannot build BFL tensor {key}: its parts {', '.join(missing)} are missing.")
        out[key] = _join(key, [parts[i] for i in range(len(rule.diffusers))], rule)
    return out


# Rotary split of the head dim over (text/index, height, width) axes. It is not stored in the weights.
FLUX1_HEAD_DIM = 128
FLUX1_AXES_DIMS_ROPE = (16, 56, 56)


def default_axes_dims_rope(head_dim: int) -> tuple[int, int, int]:
    """FLUX.1's (16, 56, 56) at head dim 128; otherwise about a quarter and two three-eighths, all even."""
    if head_dim == FLUX1_HEAD_DIM:
        return FLUX1_AXES_DIMS_ROPE
    side = 2 * ((3 * head_dim) // 16)
    first = head_dim - 2 * side
    if head_dim % 2 or side <= 0 or first <= 0:
        raise ModelError(f"cannot choose a rotary split for attention head dim {head_dim}; expected an even dim >= 8.")
    return (first, side, side)


def _indices(shapes: Mapping[str, Sequence[int]], block_list: str) -> list[int]:
    pattern = re.compile(rf"^{block_list}\.(\d+)\.")
    return sorted({int(m.group(1)) for name in shapes for m in [pattern.match(name)] if m})


def infer_bfl_config(shapes: Mapping[str, Sequence[int]], where: str = "the checkpoint") -> dict:
    """A diffusers ``FluxTransformer2DModel`` config inferred from BFL tensor shapes (names without prefix).

    Layer counts from the block indices, hidden size and input channels from ``img_in``, head dim from
    the qk-norm scale (128 when absent), text and pooled widths from ``txt_in`` and ``vector_in``, guidance
    from the presence of ``guidance_in``. ``axes_dims_rope`` is not in the weights: ``default_axes_dims_rope``
    gives FLUX.1's (16, 56, 56) at head dim 128 and (8, 12, 12), the built-in tiny model's, at 32.
    """
    def shape(name: str) -> list[int]:
        if name not in shapes:
            raise ModelError(f"{where} has no tensor {name}; it is not a complete BFL FLUX.1 checkpoint.")
        return [int(d) for d in shapes[name]]

    hidden, in_channels = shape("img_in.weight")
    double, single = _indices(shapes, "double_blocks"), _indices(shapes, "single_blocks")
    for block_list, found in (("double_blocks", double), ("single_blocks", single)):
        if found != list(range(len(found))):
            gaps = sorted(set(range(max(found, default=-1) + 1)) - set(found))
            raise ModelError(f"{where} has {block_list} numbered {found[0]}..{found[-1]} with {block_list}.{gaps[0]} "
                             "missing.")
    head_dim = FLUX1_HEAD_DIM
    for norm in ("double_blocks.0.img_attn.norm.query_norm.scale", "single_blocks.0.norm.query_norm.scale"):
        if norm in shapes:
            head_dim = shape(norm)[0]
            break
    if hidden % head_dim:
        raise ModelError(f"{where}: hidden size {hidden} (img_in.weight) is not a multiple of the head dim {head_dim}.")
    out_channels = shape("final_layer.linear.weight")[0]
    config = dict(
        patch_size=1,
        in_channels=in_channels,
        out_channels=None if out_channels == in_channels else out_channels,
        num_layers=len(double),
        num_single_layers=len(single),
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        joint_attention_dim=shape("txt_in.weight")[1],
        pooled_projection_dim=shape("vector_in.in_layer.weight")[1],
        guidance_embeds="guidance_in.in_layer.weight" in shapes,
    )
    config["axes_dims_rope"] = default_axes_dims_rope(head_dim)
    return config


__all__ = [
    "BLOCK_LISTS",
    "GROUPS",
    "KEY_PREFIXES",
    "bfl_block_prefix",
    "bfl_key_prefix",
    "bfl_name",
    "bfl_to_diffusers",
    "default_axes_dims_rope",
    "diffusers_to_bfl",
    "infer_bfl_config",
    "is_bfl_name",
]
