"""What a model family adapter declares, and the block discovery every adapter shares."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class ModelError(ValueError):
    """A model does not have the structure its family adapter expects."""


@dataclass(frozen=True)
class FamilyAdapter:
    """A family's static facts: its diffusers class and the ``nn.ModuleList`` attributes holding its blocks."""

    family: str
    class_name: str
    block_lists: tuple[str, ...]

    def blocks(self, model: nn.Module) -> list[str]:
        """Module paths of the streamed blocks in definition order, e.g. ``transformer_blocks.0``."""
        found = []
        for attr in self.block_lists:
            try:
                container = model.get_submodule(attr)
            except AttributeError:
                raise ModelError(f"{type(model).__name__} has no block list {attr!r} (family {self.family}).") from None
            if not isinstance(container, nn.ModuleList):
                raise ModelError(f"{type(model).__name__}.{attr} is a {type(container).__name__}, not an nn.ModuleList.")
            found += [f"{attr}.{i}" for i in range(len(container))]
        if not found:
            raise ModelError(f"{type(model).__name__} has no blocks in {', '.join(self.block_lists)}.")
        return found

    def matches(self, model: nn.Module) -> bool:
        return type(model).__name__ == self.class_name
