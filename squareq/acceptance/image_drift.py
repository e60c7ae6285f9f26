"""Gate: images drawn from the slab look like the images drawn from the bf16 source.

The same prompts and seeds go through the family's pipeline twice, through ``squareq sample``'s code: once with
the bf16 reference slab as the transformer (the source streamed block by block, so it runs where the source does
not fit), once with the slab. Per image pair, torchmetrics measures PSNR and SSIM (pixels in [0, 1]); with
``--clip-model DIR`` (a local CLIP folder: nothing is downloaded) also each image's CLIP score against its
prompt. A grid PNG shows bf16, slab and their difference side by side, one row per prompt.

PASS when the mean PSNR is at least τ_PSNR dB and the mean SSIM at least τ_SSIM. The CLIP scores are reported,
not gated. Identical images have no finite PSNR; they are recorded as :data:`IDENTICAL_PSNR_DB`.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..extras import require
from ..models import ADAPTERS, ModelError
from ..models.prompts import CALIBRATION_PROMPTS
from ..plot import write_png
from ..slab import Slab
from ..sources import Source
from ..sources.encoder_source import EncoderSource
from ..sources.local_files import refuse_pickled
from .convergence import reference_slab
from .gates import FAIL, PASS, GateResult, skipped

NAME = "image drift"
IDENTICAL_PSNR_DB = 100.0  # what identical images record (their PSNR is infinite)
# each entry: the file a CLIP folder needs, or its alternatives (transformers 5 writes processor_config.json)
CLIP_FILES = (("config.json",), ("preprocessor_config.json", "processor_config.json"), ("tokenizer_config.json",))


class DriftError(ValueError):
    """The drift gate was pointed at a feature network it cannot use; the message names the file to give."""


def check_clip_folder(folder: str | Path) -> Path:
    """``folder`` as a local CLIP model (config, weights, tokenizer, image processor), or one sentence saying which
    file is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DriftError(f"--clip-model {folder} is not a folder; give a local CLIP model folder (what "
                         "CLIPModel.save_pretrained and CLIPProcessor.save_pretrained write).")
    for names in CLIP_FILES:
        if not any((folder / name).is_file() for name in names):
            named = names[0] + "".join(f" (or {n})" for n in names[1:])
            raise DriftError(f"--clip-model {folder} has no {named}; give the folder that holds the CLIP model's "
                             f"{names[0]} next to its weights (CLIPProcessor.save_pretrained writes it).")
    try:
        refuse_pickled(folder)
    except ModelError as exc:
        raise DriftError(f"--clip-model {exc}") from None
    if not any(folder.glob("*.safetensors")):
        raise DriftError(f"--clip-model {folder} has no model.safetensors; give the folder that holds the CLIP "
                         "model's weights (CLIPModel.save_pretrained writes them).")
    return folder


def to_tensor(images) -> torch.Tensor:
    """PIL images as one float tensor [N, 3, H, W] in [0, 1]."""
    import numpy as np

    return torch.stack([torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
                        for im in images])


def image_metrics(reference: torch.Tensor, images: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per image pair: PSNR in dB (identical pairs: :data:`IDENTICAL_PSNR_DB`) and SSIM, both by torchmetrics."""
    metrics = require("torchmetrics.functional.image", "squareq accept's image-drift gate")
    psnr = metrics.peak_signal_noise_ratio(images, reference, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = metrics.structural_similarity_index_measure(images, reference, data_range=1.0, reduction="none")
    return ([min(float(p), IDENTICAL_PSNR_DB) for p in psnr.reshape(-1)],
            [float(s) for s in ssim.reshape(-1)])


def clip_scores(folder: Path, images: torch.Tensor, prompts: list[str]) -> list[float]:
    """Each image's CLIP score against its prompt, from the CLIP model in ``folder`` (torchmetrics' CLIPScore)."""
    CLIPScore = require("torchmetrics.multimodal.clip_score", "squareq accept's CLIP score").CLIPScore  # noqa: N806
    from transformers import CLIPModel, CLIPProcessor

    def load():
        model = CLIPModel.from_pretrained(folder, use_safetensors=True)  # never a pickle
        return _TensorFeatures(model), CLIPProcessor.from_pretrained(folder)

    metric = CLIPScore(model_name_or_path=load)
    scores = []
    for image, prompt in zip(images, prompts, strict=True):
        metric.reset()
        scores.append(float(metric((image * 255).round().to(torch.uint8).unsqueeze(0), [prompt])))
    return scores


class _TensorFeatures(torch.nn.Module):
    """A CLIPModel whose ``get_*_features`` return the projected embeddings as tensors: transformers 5 returns a
    ``ModelOutput`` there (its ``pooler_output``), which torchmetrics' CLIPScore (1.9) does not expect."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(out) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_text_features(*args, **kwargs))


def write_grid(path: Path, reference, images, gain: float = 4.0) -> Path:
    """A PNG with one row per prompt: the bf16 image, the slab's, and |difference| × ``gain``."""
    from PIL import Image, ImageChops, ImageDraw

    w, h = reference[0].size
    label = 14
    grid = Image.new("RGB", (3 * w, label + h * len(images)), "white")
    draw = ImageDraw.Draw(grid)
    for i, text in enumerate(("bf16", "slab", f"|diff| x{gain:g}")):
        draw.text((i * w + 2, 1), text, fill=(0, 0, 0))
    for row, (ref, img) in enumerate(zip(reference, images, strict=True)):
        diff = ImageChops.difference(ref.convert("RGB"), img.convert("RGB")).point(lambda v: min(255, int(v * gain)))
        for col, im in enumerate((ref, img, diff)):
            grid.paste(im.convert("RGB"), (col * w, label + row * h))
    return write_png(grid, path)


def image_drift_gate(source: Source, slab: Slab, model: EncoderSource | str, workdir: Path, tau_psnr: float,
                     tau_ssim: float, prompts: int = 4, resolution: int = 512, steps: int = 20,
                     max_sequence_length: int = 512, seed: int = 0, clip_model: str | Path | None = None, echo=print,
                     compute: str = "auto", progress: bool | None = False) -> GateResult:
    """Draw ``prompts`` of the built-in prompts from the bf16 reference (in bf16 compute) and from the slab (in
    ``compute``); compare them. Each drawing is a bar titled ``image drift (bf16)`` or ``(slab)`` when ``progress``
    (None: on a terminal), else a line for ``echo`` per image."""
    from ..train.sample import sample_images

    started = time.perf_counter()
    family = slab.manifest.model.family
    adapter = ADAPTERS.get(family)
    if adapter is None or not adapter.samples:
        return skipped(NAME, f"squareq sample cannot draw images of the {family} family yet")
    clip = check_clip_folder(clip_model) if clip_model else None
    chosen = list(CALIBRATION_PROMPTS[:prompts])
    ref_path = reference_slab(source, workdir, echo, progress)
    drawn = {}
    for label, path, what in (("bf16", ref_path, "the bf16 reference"), ("slab", slab.path, "the slab")):
        echo(f"image drift: drawing {len(chosen)} image{'s' if len(chosen) != 1 else ''} from {what}")
        drawn[label] = sample_images(path, chosen, model=model, resolution=resolution, steps=steps,
                                     max_sequence_length=max_sequence_length, seed=seed,
                                     compute=compute if label == "slab" else "bf16", progress=progress, echo=echo,
                                     label=f"{NAME} ({label})")
    ref_t, got_t = to_tensor(drawn["bf16"]), to_tensor(drawn["slab"])
    psnr, ssim = image_metrics(ref_t, got_t)
    grid = write_grid(workdir / "image-drift.png", drawn["bf16"], drawn["slab"])
    mean_psnr, mean_ssim = sum(psnr) / len(psnr), sum(ssim) / len(ssim)
    details = {"psnr_db": psnr, "ssim": ssim, "mean_psnr_db": mean_psnr, "mean_ssim": mean_ssim,
               "tau_psnr_db": tau_psnr, "tau_ssim": tau_ssim, "prompts": chosen, "seed": seed,
               "resolution": resolution, "steps": steps, "grid": str(grid), "reference_slab": str(ref_path)}
    note = f"{len(chosen)} images at {resolution} px, {steps} steps; lowest PSNR {min(psnr):.1f} dB"
    if clip is not None:
        details["clip_score"] = {"bf16": clip_scores(clip, ref_t, chosen), "slab": clip_scores(clip, got_t, chosen),
                                 "model": str(clip)}
        mean = {k: sum(v) / len(v) for k, v in details["clip_score"].items() if k != "model"}
        note += f"; CLIP score {mean['slab']:.2f} (bf16 {mean['bf16']:.2f}, not gated)"
    status = PASS if mean_psnr >= tau_psnr and mean_ssim >= tau_ssim else FAIL
    return GateResult(NAME, status, f"PSNR {mean_psnr:.1f} dB, SSIM {mean_ssim:.3f}",
                      f"PSNR ≥ {tau_psnr:g} dB, SSIM ≥ {tau_ssim:g}", note, time.perf_counter() - started, details)
