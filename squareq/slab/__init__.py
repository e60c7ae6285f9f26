"""The slab format: manifest dataclasses, an atomic block-by-block writer and a safe, memory-mapped reader."""
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
from .writer import BlockContent, SlabBuilder, WriteOptions

__all__ = [
    "ALIGNMENT",
    "DATA_FILE",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "BlockContent",
    "BlockRecord",
    "LayerRecord",
    "Manifest",
    "ModelRecord",
    "ResidentRecord",
    "Slab",
    "SlabBuilder",
    "SlabError",
    "TensorRecord",
    "WriteOptions",
    "model_signature",
    "open_slab",
]
