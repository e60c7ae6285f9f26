"""Qwen2.5-VL's processor for an edit pipeline's folder (Qwen-Image-Edit) where transformers cannot build its own.

transformers 5's ``Qwen2VLProcessor`` refuses to be built without a video processor, and its video processors need
torchvision, which SquareQ does not require. The edit pipelines hand it images only, so without torchvision the
folder's ``processor/`` is read as its tokenizer and image processor (the PIL backend transformers itself falls back
to) behind the same class and calls; with torchvision the pipeline loads its own.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path

from .boundary import reading
from .encoder_source import EncoderError

PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")  # what the Qwen-Image-Edit folders' model_index names
# Qwen2.5-VL's vision tokens by the config field that holds each one's id
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                 "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"}


def processor_stand_in(folder: Path, index: Mapping) -> dict:
    """``{"processor": ...}`` for ``from_pretrained`` where ``folder``'s pipeline (``index``: its model_index.json)
    has a Qwen2.5-VL processor and torchvision is missing; ``{}`` where the pipeline can load its own."""
    entry = index.get("processor")
    if not (isinstance(entry, list) and entry[-1:] and entry[-1] in PROCESSORS) \
            or importlib.util.find_spec("torchvision") is not None:
        return {}
    from transformers import AutoImageProcessor, AutoTokenizer

    where = Path(folder) / "processor"
    with reading(f"the processor of {folder} ({where})", "pass a complete Qwen-Image-Edit pipeline folder with --model",
                 EncoderError):
        tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        images = AutoImageProcessor.from_pretrained(str(where), local_files_only=True)
        return {"processor": image_only_processor(images, tokenizer)}


def image_only_processor(image_processor, tokenizer):
    """A ``Qwen2VLProcessor`` of ``image_processor`` and ``tokenizer`` alone (no video processor)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor's image and text path; its parts are those of this ``__init__`` (transformers reads them
        from its signature)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # the ids Qwen2VLProcessor.__init__ sets, then the mixin's checks of the two parts given
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = getattr(tokenizer, "image_token_id", None) or \
                tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = getattr(tokenizer, "video_token_id", None) or \
                tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer)


def save_in_hub_layout(folder: Path, image_processor, tokenizer) -> None:
    """A saved edit pipeline ``folder`` whose processor was :func:`image_only_processor`'s, as Qwen/Qwen-Image-Edit's
    folder holds it: ``processor/`` with the tokenizer's files and ``preprocessor_config.json``, named in
    model_index.json as transformers' ``Qwen2VLProcessor`` (the tests' and benchmarks' toy folders)."""
    import json

    for name in (Path(folder) / "processor").iterdir():
        name.unlink()
    tokenizer.save_pretrained(Path(folder) / "processor")
    image_processor.save_pretrained(Path(folder) / "processor")
    index = json.loads((Path(folder) / "model_index.json").read_text())
    (Path(folder) / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", PROCESSORS[0]]}))


def add_vision_tokens(tokenizer) -> dict[str, int]:
    """``tokenizer`` (a toy one, for the tests' and benchmarks' folders) given Qwen2.5-VL's vision tokens; their ids
    by the ``Qwen2_5_VLConfig`` field that takes each."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    return {field: tokenizer.convert_tokens_to_ids(token) for field, token in VISION_TOKENS.items()}
