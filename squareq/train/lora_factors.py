"""LoRA factors in runtime naming, the form every LoRA file layout is read into and written from: the key suffixes
(``<layer>.lora_A.weight`` [rank, in], ``<layer>.lora_B.weight`` [out, rank], DoRA's
``<layer>.lora_magnitude_vector`` [out]), the checks every layout shares, folding per-layer alphas into one, and
:class:`LoraFileError`, which every LoRA file module raises."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
MAGNITUDE = ".lora_magnitude_vector"  # DoRA's per-output-row magnitude [out], the name PEFT saves it under


class LoraFileError(ValueError):
    """A LoRA file or state dict that cannot be read or written; the message names it and says what to do."""


def few_names(names: Iterable[str], n: int = 3) -> str:
    """The first ``n`` names in order and how many more, for a sentence that names what is wrong."""
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def factor_pairs(lora: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (A, B)} from PEFT-named factors (``<layer>.lora_A.weight``), shapes checked."""
    pairs: dict[str, list] = {}
    for key, t in lora.items():
        if key.endswith(MAGNITUDE):
            continue  # read by dora_magnitudes
        if key.endswith(LORA_A):
            pairs.setdefault(key[: -len(LORA_A)], [None, None])[0] = t
        elif key.endswith(LORA_B):
            pairs.setdefault(key[: -len(LORA_B)], [None, None])[1] = t
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


def dora_magnitudes(lora: Mapping[str, torch.Tensor], layers: Mapping[str, tuple],
                    where: str) -> dict[str, torch.Tensor]:
    """DoRA's magnitude vector of every layer ({} for a plain LoRA), shapes checked against the factors."""
    found = {k[: -len(MAGNITUDE)]: t for k, t in lora.items() if k.endswith(MAGNITUDE)}
    if found and set(found) != set(layers):
        missing = set(layers) ^ set(found)
        raise LoraFileError(f"{where}: DoRA magnitudes ({MAGNITUDE[1:]}) and LoRA factors name different layers "
                            f"({few_names(missing)}); every layer of a DoRA LoRA needs both.")
    for layer, m in found.items():
        if tuple(m.shape) != (layers[layer][1].shape[0],) or not m.is_floating_point():
            raise LoraFileError(f"{where}: layer {layer}'s DoRA magnitude is {list(m.shape)}, not one value per output "
                                f"row ({layers[layer][1].shape[0]}); re-save the LoRA.")
    return found


def with_one_alpha(layers: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
                   ) -> tuple[dict[str, torch.Tensor], int, float]:
    """Factors in runtime naming with one alpha: each layer's scale becomes alpha / its own rank, as in
    runtime.add_lora. The most common alpha is kept; a layer whose own alpha differs has the ratio folded into
    its lora_B (exact for the delta up to one rounding), since the runtime has no per-layer alpha."""
    alpha = Counter(a for _, _, a in layers.values()).most_common(1)[0][0]
    rank = Counter(int(a.shape[0]) for a, _, _ in layers.values()).most_common(1)[0][0]
    out = {}
    for layer in sorted(layers):
        a, b, own = layers[layer]
        out[layer + LORA_A] = a
        out[layer + LORA_B] = b if own == alpha else b * (own / alpha)
    return out, rank, float(alpha)


def plain_number(x: float) -> int | float:
    """An int when integral, so headers read ``16`` rather than ``16.0``."""
    x = float(x)
    return int(x) if x.is_integer() else x


def positive_number(value: Any) -> bool:
    """A real number above zero (not a bool, NaN or infinity): what an alpha read from a file must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
