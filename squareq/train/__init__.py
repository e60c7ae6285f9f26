"""Training: configuration, data, the cache, the flow-matching objective, checkpoints and LoRA file formats.

docs/train.md says what each module holds and the choices made where the issue was silent."""
from .buckets import BucketBatches, bucket_for, make_buckets
from .cache import CacheError, EmbeddingCache
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .checkpoint_state import CheckpointError
from .config import ConfigError, TrainConfig, load_config
from .data import DataError, Dataset, Item, Skipped, caption_for, load_image, scan_dataset
from .lora_files import save_diffusers_lora, save_kohya_lora
from .lora_reader import load_lora

__all__ = [
    "BucketBatches", "CacheError", "CheckpointError", "ConfigError", "DataError", "Dataset", "EmbeddingCache", "Item",
    "Skipped", "TrainConfig", "bucket_for", "caption_for", "latest_checkpoint", "load_checkpoint", "load_config",
    "load_image", "load_lora", "make_buckets", "save_checkpoint", "save_diffusers_lora", "save_kohya_lora",
    "scan_dataset",
]
