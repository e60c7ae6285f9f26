"""Choose every layer's rung by measured effect on the model's output: one currency for the ladder and the budget.

Each layer has, per rung (a format at one width: ``W4``, ``NF4``, ``bf16``, ...), its bytes in the slab and its
measured effect on the model's output (compiler/effect.py). "Up" means more bytes (or as many, for less effect),
"down" fewer. The plan's predicted output error is the sum of its layers' effects. Starting from each layer's start
rung (its cheapest measured rung, or its rung in the previous slab for ``--from``):

1. **Block cap** (``--max-block-bytes``): while a block is over it, the layer of that block whose move down costs
   the least effect per byte saved moves down.
2. **Up**: while the plan's error exceeds τ_OUT, the move that lowers it most per byte moves up (a layer may skip a
   rung).
3. **Down**: while a move down keeps the plan's error at most ``HYSTERESIS × τ_OUT`` (the floor), the one that costs
   least effect per byte saved moves down. The gap between the floor and τ_OUT is the hysteresis: a plan whose error
   lies between them stays as it is, so repeated builds converge and small changes in the measurements between
   builds do not make layers oscillate.
4. **Budget**: ``--objective size`` stops here (the smallest plan the greedy finds within τ_OUT) and a plan over
   ``--budget`` is refused with the size it needs; ``--objective quality`` then spends the rest of the budget on the
   moves up with the largest effect reduction per byte.

Every move is recorded per layer with the numbers that made it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..slab.summary import human_bytes
from .budget import BudgetError

HYSTERESIS = 0.8  # a layer moves down only while the plan's error stays at most 0.8 × τ_OUT


class PlanError(BudgetError):
    """No plan meets τ_OUT within the budget or the block cap."""


@dataclass(frozen=True)
class CapFlag:
    """The flag a block cap came from, for the sentence that refuses it: ``--max-block-bytes`` (the cap itself), or
    ``--vram-cap`` of ``given`` bytes, whose room beside the resident tensors is shared by ``slots`` ring slots."""

    flag: str = "--max-block-bytes"
    given: int | None = None
    slots: int = 1

    def value_for(self, cap: int, block: int) -> int:
        """A value of the flag that caps blocks at ``block`` bytes, where the one given capped them at ``cap``."""
        return block if self.given is None else self.given + self.slots * (block - cap)

    def says(self, cap: int) -> str:
        """The block cap of ``cap`` bytes, as the flag gave it."""
        if self.given is None:
            return f"the block cap of {cap:,}"
        return f"the {cap:,} bytes {self.flag} {self.given:,} leaves each of its {self.slots} ring slots"


@dataclass
class LayerOptions:
    """One layer as the planner sees it: bytes and measured effect per rung, and where it starts."""

    name: str
    block: int
    bytes: dict[str, int]
    effect: dict[str, float]
    start: str

    @property
    def rungs(self) -> list[str]:
        """The measured rungs, from the fewest bytes to the most."""
        return sorted(self.bytes, key=lambda r: (self.bytes[r], r))


@dataclass
class Plan:
    """The rung of every layer, each layer's moves with their reasons, and the plan's totals."""

    rungs: dict[str, str]
    moves: dict[str, list[str]] = field(default_factory=dict)
    error: float = 0.0  # predicted: the sum of the layers' effects
    layer_bytes: int = 0


class _State:
    def __init__(self, layers: list[LayerOptions], fixed: dict[int, int]) -> None:  # fixed: by block index
        self.layers = {layer.name: layer for layer in layers}
        self.fixed = fixed
        self.rung = {layer.name: layer.start for layer in layers}
        self.moves: dict[str, list[str]] = {layer.name: [] for layer in layers}

    def error(self) -> float:
        return sum(self.layers[n].effect[b] for n, b in self.rung.items())

    def layer_bytes(self) -> int:
        return sum(self.layers[n].bytes[b] for n, b in self.rung.items())

    def block_bytes(self) -> dict[int, int]:
        out = dict(self.fixed)
        for n, b in self.rung.items():
            layer = self.layers[n]
            out[layer.block] = out.get(layer.block, 0) + layer.bytes[b]
        return out

    def moves_of(self, name: str, up: bool):
        """(rung, Δeffect, Δbytes) of each move up (as many bytes or more) or down (fewer) from the layer's rung."""
        layer, cur = self.layers[name], self.rung[name]
        for r in layer.rungs:
            d_bytes = layer.bytes[r] - layer.bytes[cur]
            if r != cur and (d_bytes >= 0) == up:
                yield r, layer.effect[r] - layer.effect[cur], d_bytes

    def apply(self, name: str, rung: str, why: str) -> None:
        layer, cur = self.layers[name], self.rung[name]
        direction = "up" if layer.bytes[rung] >= layer.bytes[cur] else "down"
        self.moves[name].append(f"{direction} {cur}→{rung}: {why} (effect {layer.effect[cur]:.3g} → "
                                f"{layer.effect[rung]:.3g}, {layer.bytes[rung] - layer.bytes[cur]:+,} bytes)")
        self.rung[name] = rung


def _best_up(s: _State, cap: int | None, room: int | None):
    """(name, rung) of the move up with the largest effect reduction per byte that fits the cap and ``room``."""
    blocks, best = s.block_bytes(), None
    for name, layer in s.layers.items():
        for rung, d_err, d_bytes in s.moves_of(name, up=True):
            if d_err >= 0 or (cap is not None and blocks[layer.block] + d_bytes > cap) \
                    or (room is not None and d_bytes > room):
                continue
            score = -d_err / max(d_bytes, 1)
            if best is None or score > best[0]:
                best = (score, name, rung)
    return best and best[1:]


def _best_down(s: _State, names, limit: float | None):
    """(name, rung) among ``names`` of the move down that costs the least effect per byte saved, keeping the plan's
    error at most ``limit`` (None: any)."""
    err, best = s.error(), None
    for name in names:
        for rung, d_err, d_bytes in s.moves_of(name, up=False):
            if d_bytes >= 0 or (limit is not None and err + d_err > limit):
                continue
            score = max(d_err, 0.0) / -d_bytes
            if best is None or score < best[0]:
                best = (score, name, rung)
    return best and best[1:]


def make_plan(layers: list[LayerOptions], fixed: dict[int, int], tau: float, budget: int | None = None,
              overhead: int = 0, objective: str = "size", block_cap: int | None = None,
              block_names: dict[int, str] | None = None, cap_flag: CapFlag = CapFlag()) -> Plan:
    """The plan for ``layers`` (module docstring). ``fixed``: bytes of each block's other tensors; ``overhead``:
    the slab's bytes besides the blocks; ``budget``: the most the slab may take; ``cap_flag``: the flag ``block_cap``
    came from, named when it is refused. Raises :class:`PlanError` when the cap or the budget cannot be met."""
    s = _State(layers, fixed)
    names = block_names or {}
    if block_cap is not None:
        while True:
            blocks = s.block_bytes()
            over = [b for b, n in blocks.items() if n > block_cap]
            if not over:
                break
            worst = max(over, key=blocks.get)
            move = _best_down(s, [n for n, layer in s.layers.items() if layer.block == worst], None)
            if move is None:
                raise PlanError(f"block {names.get(worst, worst)} takes {blocks[worst]:,} bytes with every layer at "
                                f"its lowest rung, more than {cap_flag.says(block_cap)}; raise {cap_flag.flag} to "
                                f"{cap_flag.value_for(block_cap, blocks[worst]):,} or offer a rung of fewer bytes in "
                                "--formats.")
            s.apply(*move, f"block {names.get(worst, worst)} {blocks[worst]:,} bytes > block cap {block_cap:,}; "
                           "this layer's move down cost the least effect per byte saved")
    while (err := s.error()) > tau:
        move = _best_up(s, block_cap, None)
        if move is None:
            raise PlanError(f"the model-output error {err:.3g} stays above τ_OUT {tau:g} with every layer as high as "
                            f"the block cap allows; raise {cap_flag.flag} or τ_OUT (out) in --thresholds.")
        s.apply(*move, f"the plan's model-output rel-MSE {err:.3g} > τ_OUT {tau:g}; this move lowered it most per byte")
    floor = HYSTERESIS * tau
    while (move := _best_down(s, list(s.layers), floor)) is not None:
        err = s.error()
        s.apply(*move, f"the plan's model-output rel-MSE stays ≤ the floor {HYSTERESIS:g}·τ_OUT = {floor:.3g} "
                       f"(now {err:.3g}); this move cost the least effect per byte saved")
    if budget is not None:
        total = overhead + sum(fixed.values()) + s.layer_bytes()
        if total > budget:
            raise PlanError(f"τ_OUT {tau:g} needs a slab of at least {total:,} bytes ({human_bytes(total)}) but "
                            f"--budget is {budget:,} bytes; raise --budget to at least that"
                            + _fits_hint(layers, fixed, budget, overhead, block_cap) + ".")
        if objective == "quality":
            _spend(s, block_cap, budget - total)
    return Plan(dict(s.rung), {n: m for n, m in s.moves.items() if m}, s.error(), s.layer_bytes())


def _spend(s: _State, block_cap: int | None, room: int) -> None:
    """Move up where the effect falls most per byte while the moves fit in ``room`` bytes (and the block cap)."""
    while (move := _best_up(s, block_cap, room)) is not None:
        name, rung = move
        room -= s.layers[name].bytes[rung] - s.layers[name].bytes[s.rung[name]]
        s.apply(name, rung, "--objective quality spent budget here, where the effect fell most per byte")


def _fits_hint(layers, fixed, budget, overhead, block_cap) -> str:
    """', or relax τ_OUT: τ_OUT=X would fit' with the error the same greedy reaches within ``budget``."""
    s = _State([LayerOptions(x.name, x.block, x.bytes, x.effect, x.rungs[0]) for x in layers], fixed)
    total = overhead + sum(fixed.values()) + s.layer_bytes()
    if total > budget:
        return ""
    _spend(s, block_cap, budget - total)
    return f", or relax the output error: τ_OUT (out) = {s.error():.3g} would fit"
