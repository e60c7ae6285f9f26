"""LoRA files: the diffusers/PEFT layout SquareQ writes by default, and the kohya (sd-scripts, ComfyUI) FLUX layout.

**diffusers layout** (``save_diffusers_lora``): ``<dir>/pytorch_lora_weights.safetensors`` with keys
``transformer.<layer>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank], bf16 by default. The
safetensors header carries the adapter metadata exactly as diffusers 0.42 writes it
(``LoraBaseMixin.write_lora_layers``, diffusers/loaders/lora_base.py): ``"format": "pt"`` and
``"lora_adapter_metadata"``, a JSON object of ``LoraConfig`` arguments whose keys carry the component
prefix (``"transformer.r"``, ``"transformer.lora_alpha"``, ...). ``load_lora_adapter(prefix="transformer")``
and ``FluxPipeline.load_lora_weights`` strip that prefix and build ``LoraConfig(**metadata)`` from it, so the
scale alpha/rank is applied on load; without the metadata diffusers would assume alpha = rank (scale 1).
SquareQ's own provenance sits beside it in the header under ``squareq.*`` keys (diffusers reads only its key).

**kohya layout** (``to_kohya``, ``save_kohya_lora``): ``lora_unet_<BFL module, dots as underscores>`` with
``.lora_down.weight`` [rank, in], ``.lora_up.weight`` [out, rank] and a scalar ``.alpha``; the module names are
Black Forest Labs' (``double_blocks_0_img_attn_qkv``), where q, k, v (and a single block's MLP input) are one
fused linear. A LoRA on the split diffusers layers is the same delta on the fused layer when stacked: lora_down
is the parts' A matrices concatenated along the rank, lora_up is block-diagonal (each part's B in its own rows
and rank columns), and alpha is multiplied by the number of parts so that alpha_fused / (k·r) = alpha / r. A part
that was not targeted gets zero rows in lora_up and no rank. ``from_kohya`` inverts this; a kohya LoRA trained
on the fused layer (lora_up not block-diagonal) becomes, for each part, (the fused lora_down, that part's rows of
lora_up) at rank k·r, which reproduces the same delta.

The diffusers <-> BFL names come from ``squareq.models.flux_bfl``; no table is repeated here.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .. import __version__
from ..models import flux_bfl
from ..models.base import ModelError
from ..runtime.peft_lora import LoraVariant
from ..slab.atomic import atomic_write_bytes
from ..slab.safetensors_file import safetensors_bytes

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
KOHYA_PREFIX = "lora_unet_"  # sd-scripts' networks/lora_flux.py prefix for the transformer
KOHYA_NETWORK_MODULE = "networks.lora_flux"

_A, _B = ".lora_A.weight", ".lora_B.weight"
_MAGNITUDE = ".lora_magnitude_vector"  # DoRA's per-output-row magnitude [out], the name PEFT saves it under
_DOWN, _UP, _ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"
_SAVE_DTYPES = (torch.bfloat16, torch.float32)


class LoraFileError(ValueError):
    """A LoRA file or state dict that cannot be read or written; the message names it and says what to do."""


# ----------------------------------------------------------------------------------------------- helpers


def _few(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _layers(lora: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (A, B)} from PEFT-named factors (``<layer>.lora_A.weight``), shapes checked."""
    pairs: dict[str, list] = {}
    for key, t in lora.items():
        if key.endswith(_MAGNITUDE):
            continue  # read by _magnitudes
        if key.endswith(_A):
            pairs.setdefault(key[: -len(_A)], [None, None])[0] = t
        elif key.endswith(_B):
            pairs.setdefault(key[: -len(_B)], [None, None])[1] = t
        else:
            raise LoraFileError(f"{where}: {key} is not a LoRA factor (<layer>.lora_A.weight or "
                                "<layer>.lora_B.weight); "
                                "pass the names runtime.lora_state_dict returns.")
    if not pairs:
        raise LoraFileError(f"{where} holds no LoRA factors; attach LoRA with runtime.add_lora before saving.")
    out = {}
    for layer, (a, b) in pairs.items():
        if a is None or b is None:
            have, lack = ("lora_A", "lora_B") if b is None else ("lora_B", "lora_A")
            raise LoraFileError(f"{where}: layer {layer} has {have}.weight but no {lack}.weight; every LoRA layer "
                                "needs both factors.")
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or not a.is_floating_point():
            raise LoraFileError(f"{where}: layer {layer} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                                "expected floating-point [rank, in] and [out, rank] with the same rank.")
        out[layer] = (a, b)
    return out


def _magnitudes(lora: Mapping[str, torch.Tensor], layers: Mapping[str, tuple], where: str) -> dict[str, torch.Tensor]:
    """DoRA's magnitude vector of every layer ({} for a plain LoRA), shapes checked against the factors."""
    found = {k[: -len(_MAGNITUDE)]: t for k, t in lora.items() if k.endswith(_MAGNITUDE)}
    if found and set(found) != set(layers):
        missing = set(layers) ^ set(found)
        raise LoraFileError(f"{where}: DoRA magnitudes ({_MAGNITUDE[1:]}) and LoRA factors name different layers "
                            f"({_few(missing)}); every layer of a DoRA LoRA needs both.")
    for layer, m in found.items():
        if tuple(m.shape) != (layers[layer][1].shape[0],) or not m.is_floating_point():
            raise LoraFileError(f"{where}: layer {layer}'s DoRA magnitude is {list(m.shape)}, not one value per output "
                                f"row ({layers[layer][1].shape[0]}); re-save the LoRA.")
    return found


def plain_number(x: float) -> int | float:
    """An int when integral, so headers read ``16`` rather than ``16.0``."""
    x = float(x)
    return int(x) if x.is_integer() else x


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


def _read_provenance(header: Mapping[str, str], where: str) -> dict[str, Any]:
    out = {}
    for key, value in header.items():
        if key.startswith("squareq."):
            try:
                out[key[len("squareq."):]] = json.loads(value)
            except (ValueError, RecursionError):
                out[key[len("squareq."):]] = value  # a plain string (e.g. a signature)
    targets = out.get("targets")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise LoraFileError(f"{where}: the header's squareq.targets is not a list of layer names; re-save the LoRA.")
    return out


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _SAVE_DTYPES:
        raise LoraFileError(f"dtype={dtype} cannot be saved; choose torch.bfloat16 (the default) or torch.float32.")


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    # temporary name in the same folder, fsync, rename: a crash never leaves a half-written LoRA under the real name
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, safetensors_bytes(tensors, metadata))
    return path


def _normalize(layers: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
               ) -> tuple[dict[str, torch.Tensor], int, float]:
    """Factors in runtime naming with one alpha: each layer's scale becomes alpha / its own rank, as in
    runtime.add_lora. The most common alpha is kept; a layer whose own alpha differs has the ratio folded into
    its lora_B (exact for the delta up to one rounding), since the runtime has no per-layer alpha."""
    alpha = Counter(a for _, _, a in layers.values()).most_common(1)[0][0]
    rank = Counter(int(a.shape[0]) for a, _, _ in layers.values()).most_common(1)[0][0]
    out = {}
    for layer in sorted(layers):
        a, b, own = layers[layer]
        out[layer + _A] = a
        out[layer + _B] = b if own == alpha else b * (own / alpha)
    return out, rank, float(alpha)


# ------------------------------------------------------------------------------------------ diffusers


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
    return {ADAPTER_METADATA_KEY: _adapter_json(_layers(lora, "the LoRA state dict"), rank, alpha, None, variant)}


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
    layers = _layers(lora, "the LoRA state dict")
    magnitudes = _magnitudes(lora, layers, "the LoRA state dict")
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
        tensors[f"{prefix}.{layer}{_A}"] = a.detach().to("cpu", dtype).contiguous()
        tensors[f"{prefix}.{layer}{_B}"] = b.detach().to("cpu", dtype).contiguous()
        if layer in magnitudes:
            # fp32 whatever ``dtype``: a magnitude is a whole row's norm, so its rounding would scale the row's output
            tensors[f"{prefix}.{layer}{_MAGNITUDE}"] = magnitudes[layer].detach().to("cpu", torch.float32).contiguous()
    return _write(Path(out_dir) / WEIGHT_NAME, tensors, metadata)


def _peft_pattern(patterns: Mapping[str, Any], layer: str, where: str = "the LoRA"):
    """PEFT's rank/alpha_pattern lookup (peft.utils.other.get_pattern_key): a key matches a dotted suffix."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", layer):
                return value
        except re.error:
            raise LoraFileError(f"{where}: the header's pattern {key[:40]!r} is not a valid layer pattern; re-save the "
                                "LoRA.") from None
    return None


def _from_diffusers(tensors: Mapping[str, torch.Tensor], header: Mapping[str, str], where: str):
    """{layer: (A, B, alpha)} of a diffusers/PEFT LoRA, alphas from the adapter metadata in its header."""
    heads = {k.split(".", 1)[0] for k in tensors}
    prefix = next((p for p in PREFIXES if p in heads), PREFIX) + "."
    prefixed = any(k.startswith(prefix) for k in tensors)
    other = [k for k in tensors if k.split(".", 1)[0] in ("text_encoder", "text_encoder_2", "text_encoder_3")
             or (k.split(".", 1)[0] in PREFIXES and not k.startswith(prefix))]
    if other:
        raise LoraFileError(f"{where} holds LoRA for another component ({other[0]}); SquareQ loads the denoiser's "
                            "LoRA only (transformer or unet), so save the file without those tensors.")
    if prefixed:
        stray = [k for k in tensors if not k.startswith(prefix)]
        if stray:
            raise LoraFileError(f"{where} mixes '{prefix}' keys with {stray[0]}; save the LoRA with one naming.")
        tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    layers = _layers(tensors, where)
    magnitudes = {k: v.float() for k, v in _magnitudes(tensors, layers, where).items()}

    alpha, alpha_pattern, rslora = _adapter_alphas(header, prefix if prefixed else None, where)
    per_layer = {}
    for layer, (a, b) in layers.items():
        own = _peft_pattern(alpha_pattern, layer, where)
        if own is None:
            # no metadata: diffusers' convention is alpha = rank (scale 1), and it is what diffusers would load
            own = alpha if alpha is not None else a.shape[0]
        # rsLoRA's scale alpha/sqrt(r) is the plain scale of alpha·sqrt(r): read as that, it needs nothing special
        per_layer[layer] = (a.float(), b.float(), float(own) * (math.sqrt(a.shape[0]) if rslora else 1.0))
    return per_layer, magnitudes


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _adapter_alphas(header: Mapping[str, str], prefix: str | None, where: str) -> tuple[float | None, dict, bool]:
    """``lora_alpha``, ``alpha_pattern`` and ``use_rslora`` from a diffusers/PEFT header's adapter config, each
    checked: a hostile or damaged header is refused in a sentence rather than scaling the LoRA by whatever it holds."""
    raw = header.get(ADAPTER_METADATA_KEY)
    if not raw:
        return None, {}, False
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        raise LoraFileError(f"{where}: the header's {ADAPTER_METADATA_KEY} is not a JSON object; re-save the LoRA.")
    # the pipeline writes prefixed keys ("transformer.r"), a model's save_lora_adapter unprefixed ones
    config = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)} if prefix else meta
    alpha, pattern = config.get("lora_alpha"), config.get("alpha_pattern") or {}
    if alpha is not None and not _positive(alpha):
        raise LoraFileError(f"{where}: the header's lora_alpha is {str(alpha)[:40]!r}, not a positive number; "
                            "re-save the LoRA with its alpha.")
    if not isinstance(pattern, dict) or not all(_positive(v) for v in pattern.values()):
        raise LoraFileError(f"{where}: the header's alpha_pattern is not a map of layer patterns to positive numbers; "
                            "re-save the LoRA.")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraFileError(f"{where}: the header's use_rslora is {str(rslora)[:40]!r}, not true or false; re-save the "
                            "LoRA.")
    return alpha, pattern, rslora


# ---------------------------------------------------------------------------------------------- kohya


def _fused_module(layer: str):
    """(BFL module, its rule, this layer's part, diffusers prefix of the group) for a diffusers layer name."""
    # flux_bfl's lookup table works on tensor names; a LoRA targets a linear, whose tensor is "<layer>.weight"
    found = flux_bfl.bfl_lookup(layer + ".weight")
    if found is None or found[4] != "weight":
        raise LoraFileError(f"LoRA layer {layer} has no linear counterpart in the kohya/BFL FLUX layout; export this "
                            "LoRA in the diffusers layout (save_diffusers_lora) instead.")
    group, index, rule, part, _ = found
    return group.bfl.replace("{i}", index) + rule.bfl, rule, part, group.diffusers.replace("{i}", index)


def _part_rows(rule, parts: Mapping[int, tuple[torch.Tensor, torch.Tensor]], module: str) -> list[int]:
    """Output rows of every part of a fused module, also of parts the LoRA did not target."""
    a0 = next(iter(parts.values()))[0]
    hidden = int(a0.shape[1])
    known = {p: int(b.shape[0]) for p, (_, b) in parts.items()}
    n = len(rule.diffusers)
    if rule.layout == flux_bfl.QKV:
        rows = [next(iter(known.values()))] * n  # q, k and v are equal
    elif rule.layout == flux_bfl.QKV_MLP:
        # linear1's q, k, v are each as wide as its input (FLUX's hidden size); the MLP part is 4x hidden, as
        # diffusers' FluxSingleTransformerBlock fixes mlp_ratio=4.0 (used only when proj_mlp has no LoRA)
        rows = [hidden] * (n - 1) + [known.get(n - 1, 4 * hidden)]
    else:
        rows = [known[0]]
    for p, r in known.items():
        if r != rows[p]:
            raise LoraFileError(f"LoRA layer {rule.diffusers[p]} of {module} has {r} output rows where the fused "
                                f"FLUX layout expects {rows[p]}; these factors do not belong to a FLUX.1 transformer.")
    return rows


def to_kohya(lora: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The kohya sd-scripts / ComfyUI FLUX LoRA (``lora_unet_*.lora_down/.lora_up/.alpha``) of a runtime LoRA.

    Each layer's scale is alpha / its rank. Split diffusers layers are stacked onto their fused BFL layer (see
    the module docstring), so every layer's delta scale·B·A is reproduced exactly; tensors stay in fp32.
    """
    layers = _layers(lora, "the LoRA state dict")
    if _magnitudes(lora, layers, "the LoRA state dict"):
        raise LoraFileError("a DoRA LoRA has no kohya/ComfyUI layout that SquareQ can write exactly (kohya's FLUX LoRA "
                            "has no DoRA, and LyCORIS's dora_scale is measured differently); use the diffusers file "
                            "(--format diffusers, save_format = [\"diffusers\"]).")
    fused: dict[str, tuple[Any, str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for layer, ab in layers.items():
        module, rule, part, prefix = _fused_module(layer)
        fused.setdefault(module, (rule, prefix, {}))[2][part] = ab
    out = {}
    for module in sorted(fused):
        rule, prefix, parts = fused[module]
        present = sorted(parts)
        ranks = [int(parts[p][0].shape[0]) for p in present]
        total, r0 = sum(ranks), ranks[0]
        rows = _part_rows(rule, parts, module)
        down = torch.cat([parts[p][0].detach().float() for p in present], dim=0)
        # lora_up of each part: its B in its own rank columns, zero elsewhere; untargeted parts are all zero
        ups, col = {}, 0
        for p, d in enumerate(rule.diffusers):
            up = torch.zeros(rows[p], total, dtype=torch.float32)
            if p in parts:
                b = parts[p][1].detach().float()
                r = b.shape[1]
                # one fused alpha serves every part: a part whose rank differs keeps its own scale through B
                up[:, col:col + r] = b if r == r0 else b * (r0 / r)
                col += r
            ups[f"{prefix}{d}.weight"] = up
        try:
            (up,) = flux_bfl.diffusers_to_bfl(ups).values()  # stacks parts, or swaps halves for adaLN
        except ModelError as e:
            raise LoraFileError(f"cannot build the kohya module of {module}: {e}") from None
        # alpha_fused / (k·r) = alpha / r; an integer multiple keeps integral alphas exact
        alpha_fused = alpha * (total // r0) if total % r0 == 0 else alpha * total / r0
        key = KOHYA_PREFIX + module.replace(".", "_")
        out[key + _DOWN] = down.contiguous()
        out[key + _UP] = up.contiguous()
        out[key + _ALPHA] = torch.tensor(float(alpha_fused), dtype=torch.float32)
    return out


def save_kohya_lora(lora: Mapping[str, torch.Tensor], path, rank: int, alpha: float, targets=(),
                    extra_metadata: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                    header: Mapping[str, str] | None = None) -> Path:
    """Write the kohya/ComfyUI layout of ``lora`` to the file ``path`` (``.safetensors``); returns it.

    Factors are stored in ``dtype`` (bf16 by default), ``.alpha`` in fp32. The header carries ``header`` (the
    ``modelspec.*`` and ``ss_*`` keys of a training run), sd-scripts' ``ss_network_*`` keys (``ss_network_dim`` is
    the training rank, before fusion) and SquareQ's provenance.
    """
    _check_dtype(dtype)
    path = Path(path)
    family = (extra_metadata or {}).get("family", "flux")
    if family != "flux":
        raise LoraFileError(f"{path}: the kohya/ComfyUI layout SquareQ writes is FLUX.1's (BFL block names); this LoRA "
                            f"is for a {family} model, so export it with --format diffusers.")
    if path.suffix != ".safetensors":
        raise LoraFileError(f"{path}: a kohya LoRA is written as a .safetensors file; give a path ending in "
                            ".safetensors.")
    tensors = to_kohya(lora, alpha)
    tensors = {k: (v if k.endswith(_ALPHA) else v.to(dtype)).contiguous() for k, v in tensors.items()}
    metadata = dict(header or {})
    metadata.update({
        "format": "pt",
        "ss_network_module": KOHYA_NETWORK_MODULE,
        "ss_network_dim": str(int(rank)),
        "ss_network_alpha": str(plain_number(alpha)),
    })
    metadata.update(_provenance("kohya", rank, alpha, targets, extra_metadata))
    return _write(path, tensors, metadata)


class _KohyaNames:
    """kohya module stem (``lora_unet_double_blocks_0_img_attn_qkv``) -> BFL module, from flux_bfl.GROUPS.

    Underscores are ambiguous (``img_attn`` vs ``img.attn``), so each group's prefix and each rule's module are
    rewritten the kohya way and matched whole."""

    def __init__(self) -> None:
        self.groups = []
        for g in flux_bfl.GROUPS:
            head = re.escape(KOHYA_PREFIX + g.bfl.replace(".", "_")).replace(r"\{i\}", r"(\d+)")
            rules = {r.bfl.replace(".", "_"): r for r in g.rules if ("weight", "weight") in r.params}
            self.groups.append((re.compile("^" + head + "(.+)$"), g, rules))

    def lookup(self, stem: str) -> str | None:
        """The dotted BFL module (``double_blocks.0.img_attn.qkv``), or None."""
        for pattern, group, rules in self.groups:
            m = pattern.match(stem)
            if not m:
                continue
            index, rest = (m.group(1), m.group(2)) if pattern.groups == 2 else ("", m.group(1))
            rule = rules.get(rest)
            if rule is None:
                if group.bfl:  # a block prefix matched, so no other group can
                    return None
                continue
            return group.bfl.replace("{i}", index) + rule.bfl
        return None


_KOHYA_NAMES = _KohyaNames()


def _off_block(up: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The columns of ``up`` outside [start, stop): zero when the part owns only its own rank block."""
    return torch.cat([up[:, :start], up[:, stop:]], dim=1)


def _kohya_layers(sd: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{diffusers layer: (A, B, alpha)} of a kohya FLUX LoRA; each layer's scale is alpha / A's rows."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        for suffix, slot in ((_DOWN, "down"), (_UP, "up"), (_ALPHA, "alpha")):
            if key.endswith(suffix):
                modules.setdefault(key[: -len(suffix)], {})[slot] = t
                break
        else:
            raise LoraFileError(f"{where}: {key} is not a kohya LoRA tensor (<module>.lora_down.weight, "
                                ".lora_up.weight "
                                "or .alpha); SquareQ reads plain LoRA only (no LoHa, LoKr or DoRA).")
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for stem in sorted(modules):
        m = modules[stem]
        if stem.startswith("lora_te"):
            raise LoraFileError(f"{where} holds text-encoder LoRA ({stem}); SquareQ loads the FLUX transformer's LoRA "
                                "only, so save the file without the lora_te* tensors.")
        module = _KOHYA_NAMES.lookup(stem)
        if module is None:
            raise LoraFileError(f"{where}: {stem} is not a kohya FLUX.1 transformer module (expected names like "
                                "lora_unet_double_blocks_0_img_attn_qkv); this file is for another model or layout.")
        if "down" not in m or "up" not in m:
            lack = "lora_down" if "down" not in m else "lora_up"
            raise LoraFileError(f"{where}: {stem} has no {lack}.weight; every kohya LoRA module needs both factors.")
        down, up = m["down"].float(), m["up"].float()
        total = int(down.shape[0])
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != total:
            raise LoraFileError(f"{where}: {stem} has lora_down {list(down.shape)} and lora_up {list(up.shape)}; "
                                "expected [rank, in] and [out, rank] (a conv LoRA is not a FLUX LoRA).")
        # a missing .alpha means alpha = rank (scale 1), as kohya and diffusers read it
        alpha_fused = float(total)
        if "alpha" in m:
            if m["alpha"].numel() != 1 or not _positive(float(m["alpha"].float().reshape(-1)[0])):
                raise LoraFileError(f"{where}: {stem}.alpha is not one positive number; re-save the LoRA.")
            alpha_fused = float(m["alpha"].float().reshape(-1)[0])
        # split lora_up rows by the fused layout; linear1's q/k/v are each as wide as its input (the hidden size),
        # which is all flux_bfl needs from a config
        config = {"num_attention_heads": 1, "attention_head_dim": int(down.shape[1])}
        try:
            ups = flux_bfl.bfl_to_diffusers({module + ".weight": up}, config)
        except ModelError as e:
            raise LoraFileError(f"{where}: {stem}: {e}") from None
        names = list(ups)  # in part order
        # untargeted parts were written as zero rows; an all-zero LoRA (untrained) keeps every part
        live = [n for n in names if ups[n].count_nonzero()] or names
        k = len(live)
        r = total // k
        diagonal = total % k == 0 and all(not _off_block(ups[n], j * r, (j + 1) * r).count_nonzero()
                                          for j, n in enumerate(live))
        for j, n in enumerate(live):
            layer = n[: -len(".weight")]
            if diagonal:  # stacked split layers: each part's own A rows and B block, alpha per part
                out[layer] = (down[j * r:(j + 1) * r].contiguous(), ups[n][:, j * r:(j + 1) * r].contiguous(),
                              alpha_fused / k)
            else:  # trained fused: the whole lora_down with this part's rows of lora_up, at rank k·r
                out[layer] = (down.contiguous(), ups[n].contiguous(), alpha_fused)
    if not out:
        raise LoraFileError(f"{where} holds no kohya LoRA modules.")
    return out


def from_kohya(sd: Mapping[str, torch.Tensor], where: str = "the kohya LoRA") -> tuple[dict[str, torch.Tensor], float]:
    """A kohya FLUX LoRA in runtime naming (``<layer>.lora_A.weight``, fp32) and its alpha.

    Each layer's scale is alpha / its rank (lora_A rows), as runtime.add_lora applies it. Block-diagonal fused
    modules (what ``to_kohya`` and sd-scripts' split-qkv write) split back to each part's own factors; a LoRA
    trained on the fused layer gives each part the fused lora_down and its rows of lora_up (rank k·r). Where
    layers' alphas differ, the ratio to the most common one is folded into lora_B.
    """
    lora, _, alpha = _normalize(_kohya_layers(sd, where))
    return lora, alpha


# ----------------------------------------------------------------------------------------------- load


def _read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with open(file, "rb") as fh:
        head = fh.read(9)
    # a safetensors file opens with its header's length (8 bytes, little-endian) and the JSON header's "{";
    # torch.save writes a zip archive (PK..) or, in the legacy format, a raw pickle (protocol byte 0x80)
    kind = None
    if head[8:9] != b"{":
        kind = ("a zip archive (torch.save output)" if head.startswith(b"PK")
                else "a pickle" if head[:1] == b"\x80" else None)
    if kind:
        raise LoraFileError(f"{file} is {kind}, not a safetensors file; SquareQ reads LoRA only from safetensors "
                            "(loading a pickle can run code), so convert it with safetensors.torch.save_file.")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            header = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoraFileError(f"{file} is not a readable safetensors file ({e}); pass a LoRA saved as "
                            ".safetensors.") from None
    return tensors, header


def load_lora(path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a LoRA file (diffusers/PEFT or kohya layout, told apart by key names) into runtime naming.

    ``path`` is the file or the folder holding ``pytorch_lora_weights.safetensors``. Returns the factors
    (``<layer>.lora_A.weight`` / ``.lora_B.weight``, no ``transformer.`` prefix, fp32 like the runtime's master
    weights; bf16 widens to fp32 exactly) and ``info`` with
    ``layout`` ("diffusers" or "kohya"), ``rank`` (the most common), ``alpha`` (each layer's scale is alpha / its
    own rank), ``targets`` (as given to add_lora when SquareQ wrote the file, else the layer names),
    ``metadata`` (SquareQ's ``squareq.*`` header keys, decoded), ``use_dora`` (the factors come with
    ``<layer>.lora_magnitude_vector``), ``file`` (the file read) and ``key_prefix`` (``transformer.`` when its keys
    carry the component, else empty: a diffusers key is ``key_prefix`` + the runtime name). An rsLoRA file's scale
    alpha/sqrt(rank) is read as the alpha of the same plain scale, alpha·sqrt(rank), so it applies without PEFT.
    """
    path = Path(path)
    if is_peft_adapter(path):
        raise LoraFileError(f"{path} is a PEFT adapter folder (a LoKr or LoHa from lora_type lokr/loha), not a LoRA "
                            "file: squareq sample --lora takes it as it is (attach_peft_adapter), peft's "
                            "PeftModel.from_pretrained(denoiser, folder) loads it, and export-lora has no other layout "
                            "for it.")
    file = path / WEIGHT_NAME if path.is_dir() else path
    if not file.is_file():
        raise LoraFileError(f"{file} does not exist; pass a LoRA .safetensors file or the folder holding "
                            f"{WEIGHT_NAME}.")
    tensors, header = _read_safetensors(file)
    if not tensors:
        raise LoraFileError(f"{file} holds no tensors; it is not a LoRA file.")
    broken = sorted(k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if broken:
        # a NaN factor turns every image drawn with it black, and every step trained from it NaN
        raise LoraFileError(f"{file} holds NaN or Inf values in {_few(broken)}; the LoRA is damaged, use an earlier "
                            "checkpoint's LoRA or train it again.")
    if any(k.startswith((KOHYA_PREFIX, "lora_te")) for k in tensors):
        layout, per_layer, magnitudes = "kohya", _kohya_layers(tensors, str(file)), {}
    elif any(".lora_A." in k or ".lora_B." in k for k in tensors):
        layout, (per_layer, magnitudes) = "diffusers", _from_diffusers(tensors, header, str(file))
    else:
        raise LoraFileError(f"{file} is neither a diffusers/PEFT LoRA (<layer>.lora_A.weight) nor a kohya LoRA "
                            f"(lora_unet_*.lora_down.weight); its keys start with {_few(tensors)}.")
    lora, rank, alpha = _normalize(per_layer)
    lora.update({layer + _MAGNITUDE: m for layer, m in magnitudes.items()})
    provenance = _read_provenance(header, str(file))
    targets = provenance.get("targets")
    heads = {k.split(".", 1)[0] for k in tensors}
    component = next((p for p in PREFIXES if p in heads), PREFIX) if layout == "diffusers" else PREFIX
    info = {
        "layout": layout,
        # the denoiser the file names (diffusers layout), e.g. "unet" for SD 1.5 / SDXL
        "component": component,
        # where the factors came from, for refusals that name the file's own keys (attach_lora)
        "file": str(file),
        "key_prefix": f"{component}." if layout == "diffusers" and component in heads else "",
        "rank": rank,
        "alpha": alpha,
        "targets": list(targets) if targets is not None else sorted(per_layer),
        "metadata": provenance,
        "use_dora": bool(magnitudes),
        # the training run's own header keys (modelspec.*, ss_*), for a re-export to carry; SquareQ's and the
        # layout's own keys are written anew
        "header": {k: v for k, v in header.items() if not k.startswith("squareq.")
                   and k not in ("format", ADAPTER_METADATA_KEY)},
    }
    return lora, info


def lora_scale(info: Mapping[str, Any], lora: Mapping[str, torch.Tensor], layer: str) -> float:
    """The scale ``load_lora``'s result applies to ``layer``: alpha / the layer's rank."""
    return float(info["alpha"]) / lora[layer + _A].shape[0]


__all__ = [
    "ADAPTER_METADATA_KEY",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KOHYA_PREFIX",
    "PREFIX",
    "WEIGHT_NAME",
    "LoraFileError",
    "from_kohya",
    "load_lora",
    "lora_scale",
    "save_diffusers_lora",
    "save_kohya_lora",
    "to_kohya",
]


def attach_lora(model: torch.nn.Module, lora: Mapping[str, torch.Tensor],
                info: Mapping[str, Any]) -> list[torch.nn.Parameter]:
    """Give a runtime model (``squareq.runtime.load``) the factors ``load_lora`` read: each layer gets its own rank
    and the file's alpha, so its scale is alpha / rank as in the file. Returns the factor parameters."""
    from ..runtime import QuantLinear

    if info.get("use_dora"):
        return _attach_dora(model, lora, info)
    modules = {}
    for layer in sorted({k[: -len(_A)] for k in lora if k.endswith(_A)}):
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            module = None
        if not isinstance(module, QuantLinear):
            raise LoraFileError(f"the LoRA names layer {layer}, which is not a quantized layer of this "
                                f"{type(model).__name__}; it was trained for another model.")
        rank = lora[layer + _A].shape[0]
        _check_shape(info, layer + _A, lora[layer + _A], (rank, module.in_features))
        _check_shape(info, layer + _B, lora[layer + _B], (module.out_features, rank))
        modules[layer] = module
    params = []  # every layer checked first, so a refused LoRA leaves the model as it was
    for layer, module in modules.items():
        a, b = lora[layer + _A], lora[layer + _B]
        module.add_lora(a.shape[0], float(info["alpha"]), device=module.scratch.buffer.device)
        with torch.no_grad():
            module.lora_A.weight.copy_(a)
            module.lora_B.weight.copy_(b)
        params += [module.lora_A.weight, module.lora_B.weight]
    return params


def _attach_dora(model: torch.nn.Module, lora: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> list:
    """A DoRA LoRA goes on through PEFT's layers (runtime.add_lora with the DoRA variant), one rank for all."""
    from ..runtime import LoraVariant, add_lora, lora_parameters

    layers = sorted({k[: -len(_A)] for k in lora if k.endswith(_A)})
    ranks = {int(lora[layer + _A].shape[0]) for layer in layers}
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
        raise LoraFileError(f"the LoRA's layers ({_few(layers)}) are not all quantized layers of this "
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
    if info.get("layout") != "kohya" or suffix not in (_A, _B):
        return info.get("key_prefix", "") + name
    try:
        module = KOHYA_PREFIX + _fused_module(layer)[0].replace(".", "_")
    except LoraFileError:
        return name
    return f"{module}{_DOWN if suffix == _A else _UP} (its part for layer {layer})"


def _layer_of(name: str) -> tuple[str, str]:
    """(layer, suffix) of a runtime factor name: ``.lora_A.weight``, ``.lora_B.weight`` or the DoRA magnitude."""
    suffix = next((s for s in (_A, _B, _MAGNITUDE) if name.endswith(s)), "")
    return name[: len(name) - len(suffix)], suffix


# ------------------------------------------------------------------------------------------ PEFT (LoKr, LoHa)

PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def save_peft_adapter(lora: Mapping[str, torch.Tensor], folder, config: Mapping[str, Any],
                      header: Mapping[str, str] | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``folder/adapter_model.safetensors`` and ``adapter_config.json`` as PEFT's ``save_pretrained`` writes
    them, for ``PeftModel.from_pretrained(denoiser, folder)``: the LoKr or LoHa factors of ``lora``
    (``runtime.lora_state_dict``; ``<layer>.lokr_w1``, ...) under ``base_model.model.``, and ``config``
    (runtime/peft_lora.py ``lycoris_config``). Each file is written atomically, the weights first: the config, which
    :func:`is_peft_adapter` looks for, marks a whole folder. Returns the folder."""
    _check_dtype(dtype)
    folder = Path(folder)
    tensors = {f"base_model.model.{name}": t.detach().to("cpu", dtype).contiguous() for name, t in sorted(lora.items())}
    _write(folder / PEFT_WEIGHTS, tensors, {"format": "pt", **(header or {})})
    atomic_write_bytes(folder / PEFT_CONFIG, (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode())
    return folder


def is_peft_adapter(path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (:func:`save_peft_adapter`'s)."""
    return Path(path).is_dir() and (Path(path) / PEFT_CONFIG).is_file()


def attach_peft_adapter(model: torch.nn.Module, folder) -> list[torch.nn.Parameter]:
    """Put the LoKr or LoHa adapter of a PEFT folder on a runtime model (``squareq.runtime.load``), as
    ``lora_type`` trained it: its rank, alpha, factor and layers from ``adapter_config.json``, its factors from
    ``adapter_model.safetensors``. Returns the adapter's parameters. :class:`LoraFileError` for a folder that is not
    one (another PEFT type, factors that do not fit)."""
    from ..runtime import LoraVariant, add_lora, lora_parameters

    folder = Path(folder)
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text(encoding="utf-8"))
        kind = {"LOKR": "lokr", "LOHA": "loha"}.get(config.get("peft_type"))
        rank, alpha, layers = int(config["r"]), float(config["alpha"]), list(config["target_modules"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LoraFileError(f"{folder / PEFT_CONFIG} is not a PEFT adapter config SquareQ can read ({exc!r}); use "
                            "the folder squareq train wrote, or train again.") from None
    if kind is None:
        raise LoraFileError(f"{folder}: its peft_type is {config.get('peft_type')!r}; SquareQ attaches PEFT LoKr and "
                            "LoHa folders, and LoRAs as .safetensors files.")
    tensors, _ = _read_safetensors(folder / PEFT_WEIGHTS)
    prefix = "base_model.model."
    named = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}
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
