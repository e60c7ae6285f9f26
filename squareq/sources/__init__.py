"""Where a model's parts come from: a built-in name, a folder, a single file or a Hugging Face Hub ID, opened as a
``Source`` that reads its transformer one block at a time."""
from .model import Source
from .open import open_source

__all__ = ["Source", "open_source"]
