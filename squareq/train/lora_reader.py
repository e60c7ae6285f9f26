"""Reading a LoRA file back into runtime naming (``load_lora``): a diffusers/PEFT file (alphas, rsLoRA and DoRA from
its adapter metadata) or a kohya one (train/layouts/: FLUX.1's by key names, another family's by the family its
header records), refusing pickles, damaged headers and NaN factors in a sentence each; and a PEFT adapter folder's
factors and config (``read_peft_adapter``)."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..sources.file_kind import pickle_kind
from .layouts import LAYOUTS
from .layouts.flux import KOHYA_PREFIX, kohya_layers
from .layouts.lycoris import adapter_kind
from .layouts.read import family_layers
from .lora_factors import (
    LORA_A,
    MAGNITUDE,
    LoraFileError,
    dora_magnitudes,
    factor_pairs,
    few_names,
    positive_number,
    with_one_alpha,
)
from .lora_files import ADAPTER_METADATA_KEY, PEFT_CONFIG, PEFT_WEIGHTS, PREFIX, PREFIXES, WEIGHT_NAME, is_peft_adapter
from .lora_metadata import family_of


def _read_provenance(header: Mapping[str, str], where: str) -> dict[str, Any]:
    """SquareQ's ``squareq.*`` header keys, JSON-decoded where they are JSON."""
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
    layers = factor_pairs(tensors, where)
    magnitudes = {k: v.float() for k, v in dora_magnitudes(tensors, layers, where).items()}

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
    if alpha is not None and not positive_number(alpha):
        raise LoraFileError(f"{where}: the header's lora_alpha is {str(alpha)[:40]!r}, not a positive number; "
                            "re-save the LoRA with its alpha.")
    if not isinstance(pattern, dict) or not all(positive_number(v) for v in pattern.values()):
        raise LoraFileError(f"{where}: the header's alpha_pattern is not a map of layer patterns to positive numbers; "
                            "re-save the LoRA.")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraFileError(f"{where}: the header's use_rslora is {str(rslora)[:40]!r}, not true or false; re-save the "
                            "LoRA.")
    return alpha, pattern, rslora


def read_peft_adapter(folder) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """A PEFT adapter folder's factors in runtime naming (``<layer>.lokr_w1``, ...), its ``adapter_config.json`` and
    its weights' header. :class:`LoraFileError` for a folder SquareQ cannot read."""
    folder = Path(folder)
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise LoraFileError(f"{folder / PEFT_CONFIG} is not a PEFT adapter config SquareQ can read ({exc!r}); use "
                            "the folder squareq train wrote, or train again.") from None
    tensors, header = read_safetensors(folder / PEFT_WEIGHTS)
    prefix = "base_model.model."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}, config, header


def lycoris_settings(folder, config: Mapping[str, Any]) -> tuple[str, int, float, list[str]]:
    """(kind, rank, alpha, layers) of a PEFT LoKr or LoHa adapter config; a sentence naming ``folder`` otherwise."""
    try:
        kind = {"LOKR": "lokr", "LOHA": "loha"}.get(config.get("peft_type"))
        rank, alpha, layers = int(config["r"]), float(config["alpha"]), list(config["target_modules"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LoraFileError(f"{Path(folder) / PEFT_CONFIG} is not a PEFT adapter config SquareQ can read ({exc!r}); "
                            "use the folder squareq train wrote, or train again.") from None
    if kind is None:
        raise LoraFileError(f"{folder}: its peft_type is {config.get('peft_type')!r}; SquareQ attaches PEFT LoKr and "
                            "LoHa folders, and LoRAs as .safetensors files.")
    return kind, rank, alpha, layers


def _kohya_family(header: Mapping[str, str]) -> str | None:
    """The family of a kohya file SquareQ wrote for a family other than FLUX.1 and Chroma (whose files the FLUX.1
    kohya reader reads), from its header; None for any other file."""
    family = header.get("squareq.family")
    if header.get("squareq.layout") == "kohya" and family in LAYOUTS and family not in ("flux", "chroma"):
        return family
    return None


def read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and header; a pickle or an unreadable file is a :class:`LoraFileError`."""
    kind = pickle_kind(file)
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
    """Read a LoRA file (diffusers/PEFT or kohya layout, told apart by key names and the header) into runtime
    naming.

    ``path`` is the file or the folder holding ``pytorch_lora_weights.safetensors``. Returns the factors
    (``<layer>.lora_A.weight`` / ``.lora_B.weight``, no ``transformer.`` prefix, fp32 like the runtime's master
    weights; bf16 widens to fp32 exactly) and ``info`` with ``layout`` ("diffusers" or "kohya"; ``family``: the
    family whose kohya layout it is), ``rank`` (the most common), ``alpha`` (each layer's scale is alpha / its
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
    tensors, header = read_safetensors(file)
    if not tensors:
        raise LoraFileError(f"{file} holds no tensors; it is not a LoRA file.")
    broken = sorted(k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if broken:
        # a NaN factor turns every image drawn with it black, and every step trained from it NaN
        raise LoraFileError(f"{file} holds NaN or Inf values in {few_names(broken)}; the LoRA is damaged, use an "
                            "earlier checkpoint's LoRA or train it again.")
    kind = adapter_kind(tensors)
    if kind is not None:
        raise LoraFileError(f"{file} is a LyCORIS {kind} file; SquareQ samples and exports a {kind} from the PEFT "
                            "folder its run wrote beside it (<title>_peft), so pass that folder.")
    family = _kohya_family(header)
    if family is not None:
        layout, per_layer, magnitudes = "kohya", family_layers(tensors, header, family, str(file)), {}
    elif any(k.startswith((KOHYA_PREFIX, "lora_te")) for k in tensors):
        layout, per_layer, magnitudes, family = "kohya", kohya_layers(tensors, str(file)), {}, "flux"
    elif any(".lora_A." in k or ".lora_B." in k for k in tensors):
        layout, (per_layer, magnitudes) = "diffusers", _from_diffusers(tensors, header, str(file))
    else:
        raise LoraFileError(f"{file} is neither a diffusers/PEFT LoRA (<layer>.lora_A.weight) nor a kohya LoRA "
                            f"(lora_unet_*.lora_down.weight); its keys start with {few_names(tensors)}.")
    lora, rank, alpha = with_one_alpha(per_layer)
    lora.update({layer + MAGNITUDE: m for layer, m in magnitudes.items()})
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
        # a kohya file's family, whose layout named its keys
        "family": family,
        "header": _run_header(header),
    }
    return lora, info


def _run_header(header: Mapping[str, str]) -> dict[str, str]:
    """The training run's own header keys (modelspec.*, ss_*), for a re-export to carry; SquareQ's and the layout's
    own keys are written anew."""
    own = ("format", ADAPTER_METADATA_KEY)
    return {k: v for k, v in header.items() if not k.startswith("squareq.") and k not in own}


def load_exported(path, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What `export-lora` rewrites in the layout ``fmt``: a LoRA file as :func:`load_lora` reads it, or the PEFT folder
    of a LoKr or LoHa (for the kohya layout, LyCORIS's, only), its ``info["layout"]`` then ``lokr`` or ``loha``. The
    family is the one the header records, else the one its ``modelspec.architecture`` names."""
    path = Path(path)
    if not is_peft_adapter(path):
        lora, info = load_lora(path)
    elif fmt != "kohya":
        raise LoraFileError(f"{path} is the PEFT folder of a LoKr or LoHa, and the diffusers layout holds LoRA "
                            "factors only; export it with --format kohya, which writes LyCORIS's layout.")
    else:
        lora, config, header = read_peft_adapter(path)
        kind, rank, alpha, layers = lycoris_settings(path, config)
        provenance = _read_provenance(header, str(path))
        info = {"layout": kind, "component": PREFIX, "file": str(path / PEFT_WEIGHTS), "key_prefix": "", "rank": rank,
                "alpha": alpha, "targets": list(provenance.get("targets") or layers), "metadata": provenance,
                "use_dora": False, "family": None, "header": _run_header(header)}
    if "family" not in info["metadata"]:
        family = family_of(info["header"].get("modelspec.architecture"))
        if family is not None:
            info["metadata"]["family"] = family
    return lora, info


def lora_scale(info: Mapping[str, Any], lora: Mapping[str, torch.Tensor], layer: str) -> float:
    """The scale ``load_lora``'s result applies to ``layer``: alpha / the layer's rank."""
    return float(info["alpha"]) / lora[layer + LORA_A].shape[0]
