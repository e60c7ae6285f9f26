"""Choose each layer's final rung under a size budget.

``size`` objective: every layer at the lowest rung that meets the thresholds (the ladder's choice).
``quality`` objective: then spend what is left of the budget on the upgrades with the largest
output-error reduction per byte, never raising a layer's error. A plan that cannot meet the
thresholds within the budget is refused before anything is written, with the smallest size that
meets them and which relaxed threshold would fit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import sizes

from ..slab.manifest import align_up
from ..slab.summary import human_bytes
from .ladder import LayerDecision, trips
from .thresholds import Thresholds

OBJECTIVES = ("size", "quality")


class BudgetError(ValueError):
    """The thresholds cannot be met within the budget (or the budget cannot be parsed)."""


def parse_size(text: str) -> int:
    """'12GB', '11.5GiB', '800MB', '123456' -> bytes; :class:`BudgetError` when unreadable."""
    try:
        return sizes.parse_size(text)
    except sizes.SizeError as exc:
        raise BudgetError(str(exc)) from None


def candidate_bytes(c) -> int:
    """Bytes a candidate adds to its block blob (every stored tensor starts 256-aligned)."""
    return sum(align_up(t.numel() * t.element_size()) for t in c.qweight.tensors.values())


@dataclass
class BlockLayers:
    """The decisions of one block plus its fixed bytes (norms, biases: everything not quantized)."""

    name: str
    decisions: list[LayerDecision]
    fixed_bytes: int


def _first_passing(d: LayerDecision, t: Thresholds) -> int | None:
    """Index in ``d.tried`` of the first rung that passes ``t`` (None if none measured passes)."""
    return next((i for i, c in enumerate(d.tried) if not trips(c, t)), None)


def _block_bytes(block: BlockLayers, choice: dict[str, int]) -> int:
    return block.fixed_bytes + sum(candidate_bytes(d.tried[choice[d.name]]) for d in block.decisions)


def plan_bytes(blocks: list[BlockLayers], choice: dict[str, int], overhead: int) -> int:
    return overhead + sum(_block_bytes(b, choice) for b in blocks)


def _window_ok(blocks: list[BlockLayers], choice: dict[str, int], window: tuple[int, int] | None) -> bool:
    if window is None:
        return True
    k, cap = window
    sizes = [_block_bytes(b, choice) for b in blocks]
    return all(sum(sizes[i : i + k]) <= cap for i in range(max(1, len(sizes) - k + 1)))


def _relaxations(blocks, thresholds: Thresholds, budget: int, overhead: int) -> list[str]:
    hints = []
    for key in ("mse", "act", "scale"):
        for factor in (1.5, 2, 4, 8, 16):
            relaxed = replace(thresholds, **{key: getattr(thresholds, key) * factor})
            choice = {}
            for d in (d for b in blocks for d in b.decisions):
                i = _first_passing(d, relaxed)
                choice[d.name] = i if i is not None else len(d.tried) - 1
            size = plan_bytes(blocks, choice, overhead)
            if size <= budget:
                hints.append(f"τ_{key.upper()}={getattr(relaxed, key):g} would fit ({size:,} bytes)")
                break
    return hints


def solve(blocks: list[BlockLayers], thresholds: Thresholds, budget: int, objective: str = "size",
          overhead: int = 0, window: tuple[int, int] | None = None) -> dict[str, int]:
    """Return layer name -> index into its ``tried`` candidates."""
    if objective not in OBJECTIVES:
        raise BudgetError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}.")
    choice = {d.name: d.tried.index(d.chosen) for b in blocks for d in b.decisions}
    size = plan_bytes(blocks, choice, overhead)
    if size > budget:
        hints = _relaxations(blocks, thresholds, budget, overhead)
        raise BudgetError(
            f"the thresholds need a slab of at least {size:,} bytes ({human_bytes(size)}) but --budget is "
            f"{budget:,} bytes; raise --budget to at least that"
            + (", or relax a threshold: " + "; ".join(hints) if hints else "") + "."
        )
    if not _window_ok(blocks, choice, window):
        raise BudgetError(f"at the thresholds' minimum, some {window[0]} consecutive blocks exceed "
                          f"--max-window-bytes {window[1]:,}; raise it or lower --stream-window.")
    if objective == "quality":
        choice = _spend(blocks, choice, budget, overhead, window)
    return choice


def _spend(blocks, choice, budget, overhead, window):
    """Greedy: best error reduction per extra byte first; never an upgrade that raises a layer's error."""
    decisions = {d.name: d for b in blocks for d in b.decisions}
    size = plan_bytes(blocks, choice, overhead)
    while True:
        best = None
        for name, d in decisions.items():
            cur = d.tried[choice[name]]
            for j in range(choice[name] + 1, len(d.tried)):
                up = d.tried[j]
                gain = cur.metrics["output_rel_mse"] - up.metrics["output_rel_mse"]
                extra = candidate_bytes(up) - candidate_bytes(cur)
                if gain <= 0 or size + extra > budget:
                    continue
                score = gain / max(extra, 1)
                if best is None or score > best[0]:
                    best = (score, name, j, extra)
        if best is None:
            return choice
        _, name, j, extra = best
        trial = {**choice, name: j}
        if _window_ok(blocks, trial, window):
            choice, size = trial, size + extra
        else:  # this upgrade would overflow a stream window: drop everything above the current rung
            decisions[name] = replace(decisions[name], tried=decisions[name].tried[: choice[name] + 1])
