"""The cached tensors of a training step, read from the cache one step ahead on a background thread.

Reading a step's entries (a T5 embedding of 512 tokens is 8 MB) while the previous step computes keeps
file reads and host-to-device copies off the critical path; on a GPU the entries are read into
page-locked memory, so their copies are asynchronous. Prefetching only reads: which entries a step uses,
its noise and timesteps are decided in the loop as before, so a run's numbers do not depend on it.
"""
from __future__ import annotations

import random
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..models.recipe import TOKEN_FIELDS, stack_captions
from .cache import CacheError, EmbeddingCache
from .masks import LOSS_MASK, full_mask


def text_key(text_keys: dict, index: int, caption: str) -> str:
    """The cache key of entry ``index``'s ``caption``: its own, ``(index, caption)``, where its text entry was read
    with its control images (Qwen-Image-Edit: train/prepare.py), else the caption's, shared by every entry."""
    own = text_keys.get((index, caption))
    return own if own is not None else text_keys[caption]


class CacheFeed:
    """Latents and text embeddings of the dataset's items on ``device``, by item index."""

    def __init__(self, cache: EmbeddingCache, image_keys: list[str], text_keys: dict[str, str],
                 captions: list[list[str]], dropped: str, device: torch.device,
                 flipped_keys: list[str] | None = None, seed: int = 0) -> None:
        self.cache = cache
        self.image_keys, self.text_keys = image_keys, text_keys
        self.flipped_keys, self.seed = flipped_keys or [], seed
        self.captions, self.dropped = captions, dropped
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="squareq-cache-reader")
        self._pending: dict[tuple[str, str], Future] = {}

    def caption(self, index: int, epoch: int) -> str:
        """Entry ``index``'s caption in ``epoch``: with shuffled orders, the next one each epoch (entries start at
        different orders, so one batch mixes them)."""
        orders = self.captions[index]
        return orders[(epoch + index) % len(orders)]

    def flipped(self, index: int, epoch: int) -> bool:
        """Whether item ``index`` trains on its flipped latents in ``epoch`` (``flip_aug``): half of the time, drawn
        from the seed, the epoch and the item, so prefetching, every rank and a resumed run see the same choice."""
        if index >= len(self.flipped_keys):  # no flip_aug, or a validation entry
            return False
        return random.Random(f"{self.seed}:{epoch}:{index}").random() < 0.5

    def image_key(self, index: int, epoch: int = 0) -> str:
        """The cache key of the latents item ``index`` trains on in ``epoch``."""
        return self.flipped_keys[index] if self.flipped(index, epoch) else self.image_keys[index]

    def _entries(self, indices: list[int], drops: list[bool] | None = None, epoch: int = 0) -> list[tuple[str, str]]:
        drops = drops or [False] * len(indices)
        return ([("latents", self.image_key(i, epoch)) for i in indices]
                + [("text", text_key(self.text_keys, i, self.dropped if d else self.caption(i, epoch)))
                   for i, d in zip(indices, drops)])

    def _read(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        tensors = self.cache.load(kind, key)
        if self.device.type == "cuda":
            tensors = {k: v.pin_memory() for k, v in tensors.items()}
        return tensors

    def prefetch(self, indices: list[int], epoch: int = 0) -> None:
        """Start reading the entries of the batch ``indices`` of ``epoch`` (a dropped caption is read when asked
        for). Reads started earlier and not used are forgotten."""
        wanted = self._entries(indices, epoch=epoch)
        self._pending = {e: self._pending.get(e) or self._pool.submit(self._read, *e) for e in wanted}

    def _get(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        future = self._pending.pop((kind, key), None)
        return future.result() if future is not None else self._read(kind, key)

    def _stack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([t.to(self.device, non_blocking=True) for t in tensors])

    def latent_shape(self, index: int, epoch: int = 0) -> torch.Size:
        """The shape of item ``index``'s latent in ``epoch`` (its bucket's), read through the prefetch."""
        key = self.image_key(index, epoch)
        entry = self._get("latents", key)
        self._pending[("latents", key)] = _done(entry)
        return entry["latents"].shape

    def batch(self, indices: list[int], drops: list[bool],
              epoch: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(latents [B, C, h, w] or [B, C, 1, h, w], the captions' tensors batched: ``prompt_embeds`` [B, L, D],
        ``pooled_prompt_embeds`` [B, P], ``prompt_mask`` [B, L] where cached, and ``loss_mask`` [B, 1, h, w] where
        masks are cached (train/masks.py)) on the device, fp32. Captions of different lengths are zero-padded to the
        longest (their masks mark the padding)."""
        images = [self._get("latents", self.image_key(i, epoch)) for i in indices]
        texts = [self._get("text", key) for kind, key in self._entries(indices, drops, epoch) if kind == "text"]
        for kind, entries in (("latents", images), ("text", texts)):
            why = _mismatch(entries, skip=(LOSS_MASK,))
            if why is not None:
                raise CacheError(f"the {kind} entries of one batch in {self.cache.root} do not fit together ({why}), "
                                 "so the cache holds entries of another run or edited ones; delete its "
                                 f"{kind}/ folder and fill it again.")
        latents = self._stack([e["latents"] for e in images])
        # an image embedding cached with the latent (Würstchen's decoder) conditions the denoiser like the text
        extra = {name: self._stack([e[name] for e in images]) for name in images[0]
                 if name not in ("latents", LOSS_MASK)}
        if any(LOSS_MASK in e for e in images):  # masked_loss; an entry without a mask counts everywhere
            extra[LOSS_MASK] = self._stack([e[LOSS_MASK] if LOSS_MASK in e else full_mask(e["latents"])
                                            for e in images])
        try:
            captions = stack_captions(texts, place=lambda t: t.to(self.device, non_blocking=True))
        except ValueError:
            raise CacheError(f"captions cached in {self.cache.root} have different lengths and no mask; delete the "
                             "text entries and fill the cache again with one max_sequence_length.") from None
        return latents, {**extra, **captions}

    def close(self) -> None:
        self._pending = {}
        self._pool.shutdown(wait=True, cancel_futures=True)


def _mismatch(entries: list[dict[str, torch.Tensor]], skip: tuple[str, ...] = ()) -> str | None:
    """Why ``entries`` cannot be batched (other fields, or other shapes where token fields may differ only in
    length), in a clause; None when they can. Fields in ``skip`` may be missing from some."""
    fields = set(entries[0]) - set(skip)
    for e in entries[1:]:
        if set(e) - set(skip) != fields:
            return f"one holds {', '.join(sorted(fields))} and another {', '.join(sorted(set(e) - set(skip)))}"
    for name in sorted(fields):
        shapes = {tuple(e[name].shape[1:] if name in TOKEN_FIELDS else e[name].shape) for e in entries}
        if len(shapes) > 1:
            return f"their {name} differ in shape: {' and '.join(map(str, sorted(shapes)))}"
    return None


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
