"""SquareQ: compile a diffusion transformer into a W4/W6/W8 slab and train LoRAs on it by streaming blocks."""

__version__ = "0.1.0"
