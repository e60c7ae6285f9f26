"""Aspect-ratio buckets and the batches drawn from them: kohya's and SimpleTuner's buckets of one pixel area, each
entry's bucket (an image at each training side; with several datasets, each at its own), and :class:`BucketBatches`,
the seeded order of batches of one bucket each that a resumed run continues exactly."""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .data import Dataset, Item


def make_buckets(resolution: int, step: int = 64, max_ratio: float = 2.0,
                 min_side: int | None = None) -> list[tuple[int, int]]:
    """Sorted (width, height) buckets: multiples of ``step``, area <= resolution², aspect ratio <= ``max_ratio``.

    For each width the height is the largest multiple of ``step`` within the area, so every bucket
    spends about the same pixel budget; each shape comes with its mirror (portrait and landscape).
    The square bucket is always present. ``step`` 64 is the usual trainer choice; FLUX itself only
    needs 16 (VAE factor 8 x patch 2). ``min_side`` (default ``step``) is capped at the square side so
    tiny resolutions still get their square bucket.
    """
    if step <= 0 or resolution < step:
        raise ValueError(f"resolution {resolution} is smaller than the bucket step {step}: raise it or lower the step.")
    side = resolution // step * step
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be at least 1, got {max_ratio}.")
    lo = min(-(-(min_side or step) // step) * step, side)  # rounded up to a multiple of step
    area = resolution * resolution
    buckets = {(side, side)}
    for w in range(lo, area // lo + 1, step):
        h = area // w // step * step
        if h >= lo and max(w, h) / min(w, h) <= max_ratio:
            buckets.update([(w, h), (h, w)])  # mirrored, so portrait and landscape get the same shapes
    return sorted(buckets)


def entries(dataset: Dataset, bucket_sets) -> list[tuple[Item, list[tuple[int, int]]]]:
    """Every training entry, with the buckets of its resolution: each of ``dataset.training_items`` once per
    resolution (``bucket_sets``: one :func:`make_buckets` list per resolution), resolution by resolution, so entry
    ``i`` is ``training_items[i % len(training_items)]``. With several datasets (``dataset.groups``), group by group,
    each at its own resolutions."""
    if len(dataset.groups) < 2:
        return [(it, buckets) for buckets in bucket_sets for it in dataset.training_items]
    out = []
    for g, group in enumerate(dataset.groups):
        items = [it for it in dataset.training_items if it.group == g]
        out += [(it, buckets) for buckets in map(make_buckets, group.resolution) for it in items]
    return out


def entry_buckets(dataset: Dataset, bucket_sets, no_upscale: bool = False) -> list[tuple[int, int]]:
    """The bucket of every training entry (:func:`entries`)."""
    return [bucket_for(it.width, it.height, buckets, no_upscale) for it, buckets in entries(dataset, bucket_sets)]


CONTROL_STEP = 16  # a control kept at its own size is cropped to this: FLUX's 8x VAE and 2x2 packing


def control_bucket(control, target: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) a control image (data.py :class:`Control`) trains at beside a target of bucket ``target``,
    as musubi-tuner sizes it: the target's bucket; with ``control_resolution`` (its ``area``), the bucket of that area
    closest to its own aspect; with ``no_resize_control``, its own size cropped to a multiple of 16, scaled down first
    where ``control_resolution`` is given and it is larger."""
    w, h = control.width, control.height
    if control.resize:
        if control.area is None:
            return target
        return bucket_for(w, h, make_buckets(max(64, round(math.sqrt(control.area)))))
    if control.area is not None and w * h > control.area:
        scale = math.sqrt(control.area / (w * h))
        w, h = w * scale, h * scale
    return max(CONTROL_STEP, int(w) // CONTROL_STEP * CONTROL_STEP), \
        max(CONTROL_STEP, int(h) // CONTROL_STEP * CONTROL_STEP)


def control_buckets(item, target: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The training sizes of ``item``'s control images beside its bucket ``target`` (() for a plain image)."""
    return tuple(control_bucket(c, target) for c in item.controls)


def bucket_for(width: int, height: int, buckets, no_upscale: bool = False, step: int = 64) -> tuple[int, int]:
    """The bucket closest in aspect ratio to width/height (log-ratio distance; ties: larger area, smaller width).

    ``no_upscale`` (kohya's ``--bucket_no_upscale``): an image with fewer pixels than that bucket gets its own size
    in multiples of ``step`` instead (cropped by less than ``step`` pixels, never enlarged); a larger one keeps the
    bucket, so no entry exceeds the resolution's area."""
    r = math.log(width / height)
    bucket = min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - r), -b[0] * b[1], b))
    if no_upscale and width * height < bucket[0] * bucket[1]:
        return max(step, width // step * step), max(step, height // step * step)
    return bucket


# ---------------------------------------------------------------------------------------------- batches

class BucketBatches:
    """Epochs of batches (lists of item indices), each batch from one bucket, in an order fixed by (seed, epoch).

    Iterating yields the rest of the current epoch and moves to the next one. ``state_dict()`` after
    any batch, loaded into a new instance built with the same arguments, continues with the same next
    batch. Use one iterator at a time: iteration advances this object's state.
    """

    def __init__(self, dataset: Dataset, buckets, batch_size: int | list[int], seed: int, drop_last: bool = False,
                 no_upscale: bool = False):
        # a list: one per dataset.groups; a number: the same for each
        sizes = batch_size if isinstance(batch_size, list) else [batch_size] * max(1, len(dataset.groups))
        if min(sizes) < 1 or seed < 0:
            raise ValueError(f"batch_size must be at least 1 and seed at least 0, got {batch_size} and {seed}.")
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        # ``buckets``: one resolution's list, or one list per resolution (every image trained at each). Indices
        # are the entries of :func:`entries`: a repeated image is several entries, as in a kohya epoch.
        bucket_sets = buckets if buckets and isinstance(buckets[0], list) else [buckets]
        listed = entries(dataset, bucket_sets)
        self.item_buckets = [bucket_for(it.width, it.height, b, no_upscale) for it, b in listed]
        # a clip's window is a bucket over time too: one batch holds one (width, height) and one frame count; with
        # several datasets, one dataset too, each in batches of its own size
        frames = [1 if it.frames is None else len(it.frames) for it, _ in listed]
        keys = list(zip(self.item_buckets, frames, strict=True)) if max(frames, default=1) > 1 else self.item_buckets
        # an edit pair's controls too: one batch holds one size of each control (a plain dataset's keys stay as they
        # were, so its saved batch order still resumes)
        controls = [control_buckets(it, b) for (it, _), b in zip(listed, self.item_buckets, strict=True)]
        if any(controls):
            keys = [(key, c) for key, c in zip(keys, controls, strict=True)]
        if len(dataset.groups) > 1:
            keys = [(it.group, *key) for (it, _), key in zip(listed, keys, strict=True)]
        groups: dict[tuple, list[int]] = {}
        for i, b in enumerate(keys):
            groups.setdefault(b, []).append(i)
        self._groups = [groups[b] for b in sorted(groups)]
        self._sizes = [sizes[b[0]] if len(dataset.groups) > 1 else sizes[0] for b in sorted(groups)]
        self.epoch, self.position = 0, 0
        self._last_epoch: tuple[int, list[list[int]]] | None = None
        # Resuming with other data, buckets or settings would silently train on a different order.
        key = repr((seed, batch_size, drop_last, keys)).encode()
        self._fingerprint = hashlib.sha256(key).hexdigest()[:16]
        if len(self) == 0:
            raise ValueError(f"No bucket holds batch_size={batch_size} images, so drop_last leaves no batch: "
                             f"lower the batch size or set drop_last=False.")

    def __len__(self) -> int:
        """Batches per epoch."""
        pairs = list(zip(self._groups, self._sizes, strict=True))
        whole = sum(len(g) // size for g, size in pairs)
        return whole + (0 if self.drop_last else sum(len(g) % size > 0 for g, size in pairs))

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` in order (a pure function of seed, epoch and the bucket groups)."""
        if self._last_epoch is not None and self._last_epoch[0] == epoch:
            return self._last_epoch[1]
        rng = np.random.default_rng([self.seed, epoch])  # SeedSequence mixes both; needs seed >= 0
        batches = []
        for group, size in zip(self._groups, self._sizes, strict=True):
            order = [group[i] for i in rng.permutation(len(group))]
            for start in range(0, len(order), size):
                batch = order[start:start + size]
                if len(batch) == size or not self.drop_last:
                    batches.append(batch)
        self._last_epoch = (epoch, [batches[i] for i in rng.permutation(len(batches))])
        return self._last_epoch[1]

    def peek(self) -> list[int]:
        """The batch iteration gives next, without advancing (what a prefetch reads ahead)."""
        return self.epoch_batches(self.epoch)[self.position]

    def __iter__(self):
        batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            last = self.position == len(batches)
            if last:  # roll over before yielding, so a state saved after the last batch starts the next epoch
                self.epoch, self.position = self.epoch + 1, 0
            yield batch
            if last:
                return

    def state_dict(self) -> dict:
        """Where the iteration stands: epoch, batches already given in it, and a fingerprint of the settings."""
        return {"epoch": self.epoch, "position": self.position, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`; refuses one saved with other data, buckets or settings."""
        if state.get("fingerprint") != self._fingerprint:
            raise ValueError("The saved batch order belongs to other data, buckets, batch size or seed: "
                             "resume with the same settings or start a fresh run.")
        if not 0 <= state["position"] < len(self):
            raise ValueError(f"Saved batch position {state['position']} is outside an epoch of {len(self)} batches.")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
