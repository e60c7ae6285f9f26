"""What a run says before its first step, so that a person knows what will happen before it happens: the device and
the arithmetic (on a CPU, plainly, in the first lines), the dataset (images, repeats, buckets, and how many images
are enlarged to reach the training resolution, which ``no_upscale`` avoids), the steps, and, once the first steps
after the warm-up one are measured, the time the whole run will take (:class:`StepClock`, which also gives the plain
progress lines their ETA)."""
from __future__ import annotations

from collections import Counter

import torch

from .buckets import bucket_for, make_buckets

MEASURED = 2  # steps after the warm-up one that the run's ETA line waits for


def device_line(device: torch.device, dtype: str, compute: str, world: int = 1) -> str:
    """Where the steps run and in what arithmetic; on a CPU, that it is one and what that costs."""
    ranks = f" on each of {world} processes" if world > 1 else ""
    if device.type == "cpu":
        return (f"device: the CPU{ranks}: no CUDA GPU was found, so a step is far slower than on a GPU; {dtype} "
                f"weights, {compute} matmuls")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"device: {device} ({name}){ranks}; {dtype} weights, {compute} matmuls"


def upscaled_images(items, bucket_sets, no_upscale: bool) -> int:
    """How many of ``items`` are smaller than their bucket in some resolution (``bucket_sets``: one bucket list per
    resolution), so that train/data.py's cover crop enlarges them."""
    def enlarged(item, buckets) -> bool:
        w, h = bucket_for(item.width, item.height, buckets, no_upscale)
        return item.width < w or item.height < h

    return sum(any(enlarged(item, buckets) for buckets in bucket_sets) for item in items)


def data_lines(dataset, bucket_sets, resolutions: list[int], no_upscale: bool, more=None) -> list[str]:
    """The dataset as the run will see it: images and repeats, each bucket with its entries an epoch, and the images
    enlarged to their bucket; with several datasets (``dataset.groups``), these lines for each, numbered. ``more``:
    a line of the run's own on the dataset (``more(dataset, bucket_sets, no_upscale)``, None for none: the edit
    pairs' controls, train/controls.py)."""
    if len(dataset.groups) > 1:
        lines = []
        for g, group in enumerate(dataset.groups):
            part = type(dataset)(group.root, [it for it in dataset.items if it.group == g])
            lines += [f"dataset {g + 1} (batch size {group.batch_size}): {line}" for line in
                      data_lines(part, [make_buckets(r) for r in group.resolution], list(group.resolution),
                                 no_upscale, more)]
        return lines
    images = [item for item in dataset.items if not item.reg]
    entries = [item for item in dataset.training_items if not item.reg]
    repeats = Counter(item.repeats for item in images)
    unit = ("image", "images") if all(item.frames is None for item in images) else ("entry", "entries")
    said = ", ".join(f"{n} {unit[n != 1]} {'once' if r == 1 else f'{r} times'}"
                     for r, n in sorted(repeats.items()))
    res = ", ".join(f"{r} px" for r in resolutions)
    windows = [item for item in images if item.frames is not None]  # a clip's entries (train/clip_items.py)
    what = f"{len(images)} images" if not windows else \
        f"{len(images) - len(windows)} images and {len(windows)} windows of {len({w.path for w in windows})} clips"
    lines = [f"data: {what} from {dataset.root} (repeats: {said}), {len(entries) * len(resolutions)} entries an epoch "
             f"at {res}"]
    counts = Counter((*bucket_for(item.width, item.height, buckets, no_upscale), len(item.frames or (0,)))
                     for buckets in bucket_sets for item in entries)

    def bucket(w: int, h: int, frames: int) -> str:
        return f"{w}x{h}" + (f" x {frames} frames" if frames > 1 else "")

    lines.append("buckets: " + ", ".join(f"{bucket(*key)}: {n} entr{'ies' if n != 1 else 'y'}"
                                        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))))
    up = upscaled_images(images, bucket_sets, no_upscale)
    if up and no_upscale:  # a wide image over its bucket's area keeps the bucket, and its short side is enlarged
        lines.append(f"upscaled: {up} of {len(images)} images are enlarged despite no_upscale: one side is shorter "
                     "than their bucket's")
    elif up:
        lines.append(f"upscaled: {up} of {len(images)} images are smaller than their bucket and are enlarged to it; "
                     "no_upscale = true (--no-upscale) trains each at its own size instead")
    else:
        lines.append(f"upscaled: none of the {len(images)} images" + (" (no_upscale)" if no_upscale else ""))
    extra = more(dataset, bucket_sets, no_upscale) if more is not None else None
    return lines + ([extra] if extra else [])


def steps_line(total: int, step: int, batch: int | list[int], grad_accum: int, world: int, epoch_batches: int) -> str:
    """The optimizer steps to come, and what each takes (``batch``: a list, each dataset's batch size)."""
    sizes = "/".join(map(str, dict.fromkeys(batch))) if isinstance(batch, list) else str(batch)
    plural = "s" * (sizes != "1")
    per = f"{sizes} image{plural} a batch" + (" by dataset" if "/" in sizes else "") \
        + (f" on each of {world} processes" if world > 1 else "") \
        + (f", {grad_accum} batches a step" if grad_accum > 1 else "")
    epochs = total * grad_accum / max(1, epoch_batches)
    start = f", from step {step}" if step else ""
    return f"steps: {total} ({per}; about {epochs:.3g} epochs){start}"


def duration(seconds: float) -> str:
    """``seconds`` as a person says it: 42 s, 3 min 5 s, 2 h 3 min."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class StepClock:
    """The seconds of this process's steps, for the ETA: the first step (a warm-up: compilation, allocator, caches)
    is not counted."""

    def __init__(self, total: int, step: int) -> None:
        self.total, self.step, self.said = total, step, False
        self.steps, self.measured, self.seconds = 0, 0, 0.0  # steps seen; those after the warm-up, their seconds

    def add(self, step: int, seconds: float) -> None:
        self.step, self.steps = step, self.steps + 1
        if self.steps > 1:  # a running sum: this is called every step of a run that may take 100,000
            self.measured, self.seconds = self.measured + 1, self.seconds + seconds

    def per_step(self) -> float | None:
        """The mean seconds a step after the warm-up one (None before one is measured)."""
        return self.seconds / self.measured if self.measured else None

    def eta(self) -> str:
        """The time left, for a progress line (``?`` before a measured step)."""
        per = self.per_step()
        return "?" if per is None else duration(per * (self.total - self.step))

    def run_line(self) -> str | None:
        """Once, after :data:`MEASURED` measured steps: how long the steps left will take."""
        per = self.per_step()
        if self.said or self.measured < MEASURED or self.step >= self.total:
            return None
        self.said = True
        left = self.total - self.step
        return (f"eta: about {duration(per * left)} for the {left} steps left ({duration(per * self.total)} for all "
                f"{self.total}; {per:.2f} s a step, measured on {self.measured} steps after the first)")
