"""The compile's disk: what its state folder, spill files and slab take, checked before calibration starts.

A compile writes three things beside its output, and holds them at once near its end:

* the state folder (compiler/state.py): every layer's candidate at every ``--formats`` rung, kept so a killed
  compile resumes. With the default W4, W6, W8 and bf16 rungs that is about 4.3 bytes per weight: 48 GB for a 12B
  transformer, twice its bf16 checkpoint;
* the spill file of what the host plan sends to disk (compiler/spill.py): the effect inputs, or the largest block's
  recorded inputs (34.5 GB for the 12B FLUX.1-dev-shaped compile at ``--host-budget 32GB``);
* the slab, at most ``--budget`` (or the largest slab the model can have, when that is smaller), written while the
  state folder still exists.

The peak is the whole state plus the larger of the spill and the slab (the spill file is deleted when its pass ends,
before the slab is written). A disk without that much free is refused with one sentence before calibration,
instead of failing mid-run when the disk fills. What a resumed compile's state folder already holds is counted as
written. A rebuild (``--from``) measures only the layers that move, so its state is not counted.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..sizes import format_size, format_size_up
from .budget import BudgetError, block_candidate_bytes, most_slab_bytes

# what the filesystem keeps for itself and the estimate's rounding: 2% of the need, at least this
MARGIN_LEAST = 256 << 20


@dataclass(frozen=True)
class DiskNeeds:
    """Bytes the compile writes to the disk of its state folder (and of its output, when that is the same disk)."""

    state: int  # every block's candidates at every rung
    spill: int  # the largest spill file the host plan writes (0: nothing spilled)
    slab: int  # the slab, at most --budget
    written: int = 0  # what the state folder already holds (a resumed compile)

    @property
    def peak(self) -> int:
        """The most the compile adds to the disk at once, its margin included."""
        need = self.state + max(self.spill, self.slab) - self.written
        return max(0, need) + max(MARGIN_LEAST, need // 50)


def estimate_disk(skeleton: nn.Module, block_paths, specs, spill: int, budget: int, state: Path | None,
                  rebuild: bool = False) -> DiskNeeds:
    """The compile's disk needs (module docstring): ``specs`` are the rungs each layer is measured at, ``spill`` the
    bytes the host plan spills, ``state`` the state folder (what a resumed compile's folder holds is counted)."""
    candidates = 0 if rebuild else sum(block_candidate_bytes(skeleton.get_submodule(p), specs) for p in block_paths)
    written = sum(p.stat().st_size for p in state.glob("block.*.safetensors")) if state and state.is_dir() else 0
    # a budget larger than any slab of the model is never spent: the slab is counted at the most it can be
    slab = min(budget, most_slab_bytes(skeleton, block_paths, specs))
    return DiskNeeds(candidates, spill, slab, 0 if rebuild else written)


def check_disk(needs: DiskNeeds, state: Path, out: Path) -> str:
    """The disk plan as a log line; :class:`BudgetError` when the disk of ``state`` cannot take ``needs.peak`` more
    bytes (where the output is on another disk, each disk is checked for its own part)."""
    state_disk, out_disk = _existing(state), _existing(out.parent)
    if os.stat(state_disk).st_dev == os.stat(out_disk).st_dev:
        free = _refuse_if_short(state_disk, needs, "")
    else:
        free = _refuse_if_short(state_disk, DiskNeeds(needs.state, needs.spill, 0, needs.written),
                                " (its state folder's disk)")
        _refuse_if_short(out_disk, DiskNeeds(0, 0, needs.slab), " (the output's disk)")
    return (f"Disk plan: about {format_size_up(needs.peak)} at most beside the output (state "
            f"{format_size(needs.state)}, spilled inputs {format_size(needs.spill)}, slab up to "
            f"{format_size(needs.slab)}); {format_size(free)} free at {state_disk}.")


def _refuse_if_short(folder: Path, part: DiskNeeds, which: str) -> int:
    free = shutil.disk_usage(folder).free
    if free >= part.peak:
        return free
    parts = []
    if part.state:
        held = f", {format_size(part.written)} of it already written" if part.written else ""
        parts.append(f"its state folder {format_size(part.state)} (every layer at each --formats rung, so a killed "
                     f"compile can resume{held})")
    if part.spill:
        parts.append(f"the spilled inputs {format_size(part.spill)} (--host-budget sent them to disk)")
    if part.slab:
        parts.append(f"the slab up to {format_size(part.slab)} (--budget)")
    raise BudgetError(f"{folder}{which} has {format_size(free)} free, but the compile needs about "
                      f"{format_size_up(part.peak)} there at once ({'; '.join(parts)}); free space there, write the "
                      "output (-o) to a disk with more room, or give fewer --formats rungs for a smaller state.")


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (where a folder about to be made will live)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
