"""``runtime.plan``: the device memory a streamed LoRA training step will need, before any of it is allocated.

The peak is the sum of what stays for the whole run and what one step adds on top:

* resident tensors (embedders, final norm and projection), the K ring slots (each as large as the largest
  block blob) and the dequant scratch (the largest layer in bf16, and under FP8 compute in E4M3 too);
* LoRA factors with their gradients and AdamW's two moments (16 bytes per fp32 parameter);
* the checkpointed block inputs, one hidden-state tensor per block (batch x tokens x hidden, bf16), or with them
  offloaded to host memory (runtime/activation_offload.py) two: one copied out, one brought back;
* the recompute of the one block whose backward is running: ``RECOMPUTE_WIDTHS`` hidden-state tensors
  (attention inputs and outputs, MLP activations, LoRA intermediates, gradients in flight);
* a fixed allowance for the matmul library's workspaces.

``RECOMPUTE_WIDTHS`` and ``RESERVE_OVERHEAD`` come from peaks measured on an H200 with
``benchmarks/train_step.py`` on FLUX.1-dev shapes (planned allocated within +4% of measured at 512² and
1024², K=2 and 3; reserved/allocated measured 1.10-1.13, so the plan's reserved figure is an upper bound);
docs/benchmarks.md gives the measured and planned figures side by side.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from ..models import ADAPTERS
from ..sizes import format_size_up
from ..slab import Slab, open_slab
from ..slab.manifest import itemsize
from .lora import DEFAULT_TARGETS, matches

RECOMPUTE_WIDTHS = 28  # hidden-state-sized bf16 tensors alive at the peak of one block's recompute + backward
WORKSPACE_BYTES = 96 << 20  # cuBLAS/cuDNN workspaces and small allocations
RESERVE_OVERHEAD = 1.14  # the caching allocator's reserved / allocated at the peak (measured 1.10-1.13)
GB = 1e9


class PlanError(ValueError):
    """A plan exceeds the memory the user allowed."""


@dataclass
class MemoryPlan:
    """Expected device memory of a streamed training step, by part, in bytes."""

    resident: int
    ring: int
    scratch: int
    lora: int
    checkpoints: int
    recompute: int
    workspace: int
    peak_allocated: int
    peak_reserved: int
    tokens: int
    hidden: int
    batch: int
    prefetch: int
    offloaded: int = 0  # bytes of checkpointed inputs that wait in host memory (offload on)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        rows = [("resident modules", self.resident), (f"block ring ({self.prefetch} slots)", self.ring),
                ("dequant scratch", self.scratch), ("LoRA + grads + AdamW", self.lora),
                (f"checkpointed block inputs ({self.batch} x {self.tokens} tokens)"
                 + (f", {self.offloaded / GB:.2f} GB in host memory" if self.offloaded else ""), self.checkpoints),
                ("one block's recompute + backward", self.recompute), ("library workspaces", self.workspace)]
        width = max(len(r[0]) for r in rows)
        lines = [f"  {name:<{width}}  {n / GB:7.2f} GB" for name, n in rows]
        lines.append(f"  {'expected peak allocated':<{width}}  {self.peak_allocated / GB:7.2f} GB")
        lines.append(f"  {'expected peak reserved':<{width}}  {self.peak_reserved / GB:7.2f} GB")
        return "\n".join(lines)

    def check(self, budget_bytes: int, flag: str = "--vram-budget") -> None:
        """Raise :class:`PlanError` when the expected peak reserved memory exceeds ``budget_bytes``."""
        if self.peak_reserved > budget_bytes:
            raise PlanError(
                f"this run needs about {self.peak_reserved / GB:.2f} GB of GPU memory at its peak, over the "
                f"{budget_bytes / GB:.2f} GB of {flag}; lower the resolution or batch size, use fewer prefetch slots, "
                f"or give {flag} at least {format_size_up(self.peak_reserved)} (the smallest card it fits).")


def _sequence_shape(slab: Slab, resolution: int, text_tokens: int, frames: int | None = None) -> tuple[int, int]:
    model = slab.manifest.model
    adapter = ADAPTERS.get(model.family)
    if adapter is not None and adapter.sequence_shape is not None:
        if frames is not None and adapter.recipe is not None and adapter.recipe.frames:  # a video family's clips
            return adapter.sequence_shape(model.config, resolution, text_tokens, frames=frames)
        return adapter.sequence_shape(model.config, resolution, text_tokens)
    cfg = model.config
    hidden = cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("inner_dim")
    if not hidden:
        raise ValueError(f"{slab.path}: SquareQ does not know the hidden width of {model.class_name}, so it cannot "
                         "plan its memory; it plans FLUX.1 and models whose config has hidden_size or d_model.")
    return text_tokens, int(hidden)


def plan(slab: str | os.PathLike | Slab, resolution: int = 1024, batch: int = 1, text_tokens: int = 512,
         prefetch: int = 2, lora_rank: int = 16, lora_targets=DEFAULT_TARGETS, compute: str = "bf16",
         dtype: str = "bf16", frames: int | None = None, offload: bool = False,
         control_tokens: int = 0) -> MemoryPlan:
    """Expected peak device memory of a streamed LoRA training step on ``slab`` (gradient checkpointing on).

    ``resolution`` is the image side in pixels (FLUX: (resolution/16)² image tokens); for a generic-mode
    model only ``text_tokens`` counts. ``compute`` is the settled mode ("bf16" or "fp8", not "auto"); ``dtype`` the
    settled activation type ("bf16" or "fp16": one more buffer, of the largest layer's weight). ``frames``: a video
    family's longest window in pixel frames (default: the family's own, e.g. Wan's 81). ``offload``: the checkpointed
    inputs wait in host memory (two in flight on the device). ``control_tokens``: an edit pair's control tokens
    beside each target (FLUX.1 Kontext appends them to the sequence).
    ``print(plan(...))`` shows the parts.
    """
    s = slab if isinstance(slab, Slab) else open_slab(slab, verify="off")
    m = s.manifest
    tokens, hidden = _sequence_shape(s, resolution, text_tokens, frames)
    tokens += control_tokens
    resident = sum(itemsize(r.dtype) * math.prod(r.shape) for r in m.resident)
    ring = prefetch * max(b.nbytes for b in m.blocks)
    scratch = 2 * max((l.shape[0] * l.shape[1] for l in m.layers if not l.spec.is_passthrough), default=0)
    if compute == "fp8":  # one byte per weight of the largest layer and its row scales, and every layer's row maxima
        scratch += max((l.shape[0] * (l.shape[1] + 4) for l in m.layers), default=0)
        scratch += 4 * sum(l.shape[0] for l in m.layers)
    if dtype == "fp16":  # the weights converted for the matmul (runtime/qlinear.py DequantScratch)
        scratch += 2 * max((l.shape[0] * l.shape[1] for l in m.layers), default=0)
    targets = (lora_targets,) if isinstance(lora_targets, str) else tuple(lora_targets)
    lora_params = sum(lora_rank * (l.shape[0] + l.shape[1]) for l in m.layers if matches(l.name, targets))
    lora = 16 * lora_params
    hidden_state = 2 * batch * tokens * hidden
    checkpoints = (2 if offload else len(m.blocks)) * hidden_state
    recompute = RECOMPUTE_WIDTHS * hidden_state
    allocated = resident + ring + scratch + lora + checkpoints + recompute + WORKSPACE_BYTES
    return MemoryPlan(resident, ring, scratch, lora, checkpoints, recompute, WORKSPACE_BYTES, allocated,
                      int(allocated * RESERVE_OVERHEAD), tokens, hidden, batch, prefetch,
                      len(m.blocks) * hidden_state if offload else 0)

