"""The weight formats SquareQ can store, by name: one :class:`Format` object each, registered by its own module.

A format owns what makes it a format: which bit widths it takes, its packing id in the manifest, the dtype and
shape of every stored tensor, how a slice of rows is encoded and decoded, and its byte cost. Everything around
it (row chunking, smoothing, the bf16 rounding, slabs, kernels, the compiler) works from a spec's format name.
Each format lives in ``squareq/quant/formats/<name>.py`` and calls :func:`register`; ``squareq.quant`` imports
every module of that folder, so adding a format touches no other file. This module imports nothing of the
project, so the spec can check names against it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Format:
    """One storage format. Subclasses set the class attributes and implement ``encode`` and ``decode``; ``spec``
    arguments are :class:`squareq.quant.QuantSpec` (not imported here: the spec imports this module).

    ``name``: the spec's ``format`` value. ``bits``: the bit widths it takes (the first is its default).
    ``table``: for lookup formats, the value of each code (a tuple of floats indexed by the unsigned code), which
    lets one lookup kernel serve them all; None for formats computed otherwise.
    """

    name: str = ""
    bits: tuple[int, ...] = ()
    table: tuple[float, ...] | None = None
    zero_points: bool = True  # whether an asymmetric spec (symmetric=False) is meaningful
    gptq: bool = False  # whether GPTQ (squareq/quant/gptq.py) can round onto this format's grid
    rotate: bool = False  # whether a spec may rotate (QuantSpec.rotate): its kernels apply the Hadamard rotation

    def check(self, spec) -> str | None:
        """Why ``spec`` cannot be stored in this format (one sentence), or None."""
        if spec.bits not in self.bits:
            return f"format {self.name!r} stores {' or '.join(map(str, self.bits))}-bit codes, not bits={spec.bits}"
        if not self.zero_points and not spec.symmetric:
            return f"format {self.name!r} has no zero points: set symmetric=True"
        return None

    def packing(self, spec) -> str:
        """The packing id recorded in the manifest."""
        raise NotImplementedError

    def label(self, spec) -> str:
        """A short human label (``W4 g64 asym``, ``NF4 g64``)."""
        raise NotImplementedError

    def short_label(self, spec) -> str:
        """The format's name at ``spec``'s width, as the compiler's ladder and ``squareq inspect`` show it
        (``W4``, ``NF4``); unique among all formats and widths."""
        return self.name.upper()

    def layout(self, spec, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of every stored tensor of a weight of ``shape`` (smoothing's ``inv_smooth`` aside)."""
        raise NotImplementedError

    def encode(self, w: torch.Tensor, spec) -> dict[str, torch.Tensor]:
        """The stored tensors of float32 rows ``w [n, k]`` (already smoothed)."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], spec, k: int) -> torch.Tensor:
        """float32 ``[n, k]`` of stored rows, before smoothing is folded back and before the bf16 rounding."""
        raise NotImplementedError

    def scales(self, w: torch.Tensor, spec) -> torch.Tensor:
        """The stored scale of each group of float32 rows ``w [n, k]``, without the codes (a format may skip
        them)."""
        return self.encode(w, spec)["scales"]

    def fake(self, w: torch.Tensor, spec) -> torch.Tensor:
        """``decode(encode(w))``; a format may skip its packing here (searches try many specs)."""
        return self.decode(self.encode(w, spec), spec, w.shape[1])


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add ``fmt`` under its name (a module registers its format when imported)."""
    if not fmt.name or fmt.name in FORMATS and type(FORMATS[fmt.name]) is not type(fmt):
        raise ValueError(f"format name {fmt.name!r} is empty or already taken by {FORMATS.get(fmt.name)!r}.")
    FORMATS[fmt.name] = fmt
    return fmt
