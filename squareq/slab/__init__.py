"""The slab format: manifest dataclasses, an atomic writer and a safe, memory-mapped reader."""
from .errors import SlabError
from .manifest import (
    ALIGNMENT,
    DATA_FILE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    BlockRecord,
    LayerRecord,
    Manifest,
    ModelRecord,
    ResidentRecord,
    TensorRecord,
)
from .reader import Slab, open_slab
from .signature import model_signature
from .writer import WriteOptions, write_slab

__all__ = [
    "ALIGNMENT",
    "DATA_FILE",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "BlockRecord",
    "LayerRecord",
    "Manifest",
    "ModelRecord",
    "ResidentRecord",
    "Slab",
    "SlabError",
    "TensorRecord",
    "WriteOptions",
    "model_signature",
    "open_slab",
    "write_slab",
]
