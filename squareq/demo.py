"""`squareq demo`: the whole product on the built-in tiny model in a few minutes, offline.

compile tiny-flux under a size budget (calibrated on the built-in photographs) → train a LoRA on the built-in tiny
dataset with the streamed slab → draw a sample image with it → run the acceptance gates. Everything lands in one
folder; every number printed is measured in this run. A GPU is used when there is one.
"""
from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .acceptance import AcceptOptions, AcceptReport, accept
from .acceptance.convergence import ConvergenceSettings
from .compiler import CompileOptions, compile_slab
from .compiler.calibration_images import calibration_images
from .devices import default_device
from .extras import ACCEPT_MODULES, check_installed
from .models import load_builtin
from .progress import Progress, wanted
from .slab import SlabError, open_slab
from .slab.summary import summarize
from .sources import open_source
from .train.config import load_config
from .train.loop import train
from .train.sample import sample_images
from .train.tiny_dataset import write_tiny_dataset

RESOLUTION, TOKENS = 64, 32  # the built-in images are 64 px; their captions are under 16 tokens
PROMPT = "a red circle on a blue background"
DEMO_RESOLUTION = 128  # calibration image side: tiny-flux's latents at 128 px are 16 x 16 (the CLI default is 512)
PARTS = ("tiny-flux.slab", "tiny-flux.slab.state", "data", "lora", "sample.png", "accept", "accept.json", "accept.xml")


@dataclass
class DemoResult:
    folder: Path
    slab: Path
    lora: Path
    sample: Path
    report: AcceptReport
    report_path: Path


def _prepare(folder: Path, overwrite: bool) -> None:
    taken = [folder / p for p in PARTS if (folder / p).exists()]
    if taken and not overwrite:
        raise SlabError(f"{folder} already holds a demo ({taken[0].name}); pass --force to replace it or choose "
                        "another -o folder.")
    for path in taken:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    folder.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def training_progress(steps: int, status: Callable[[str], None] | None,
                      shown: bool | None = None) -> Iterator[Callable[[int], None] | None]:
    """The demo's training on the shared bar (squareq/progress.py), drawn on a terminal or when ``shown``; else a
    line at each quarter of the steps with the time left (``"      training: step 50/200, ETA 00:12"``) handed to
    ``status``. Yields what the trainer calls after each step (None without ``status``: nothing is shown)."""
    if status is None:
        yield None
        return
    with Progress(steps, "train", "step", shown=shown, echo=status, every=max(1, steps // 4)) as bar:
        yield lambda step: bar.advance(line=lambda: f"      training: step {step}/{steps}, ETA {bar.eta()}")


def run_demo(folder: Path, budget: int, overwrite: bool = False, steps: int = 200,
             echo: Callable[[str], None] = print, status: Callable[[str], None] | None = None,
             progress: bool | None = None) -> DemoResult:
    """Run the demo into ``folder``; ``echo`` receives the progress and result lines. With ``status``, each phase
    (compile, training, sample, each gate) shows how far it is on its own labelled bar on a terminal (or with
    ``progress``); else the training alone, in lines for ``status`` (:func:`training_progress`)."""
    check_installed(("skimage", *ACCEPT_MODULES), "squareq demo")  # it calibrates on the photographs and accepts
    folder = Path(folder)
    _prepare(folder, overwrite)
    device = default_device().type
    model, adapter = load_builtin("tiny-flux")
    bf16 = sum(2 * p.numel() for p in model.parameters())
    echo(f"[1/5] tiny-flux: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
         f"{len(adapter.blocks(model))} blocks, on {device}")

    slab_path = folder / "tiny-flux.slab"
    start = time.perf_counter()
    source = open_source("tiny-flux")
    # the built-in photographs through tiny-flux's own toy VAE and text encoders, at the demo's small size
    images = calibration_images(source, resolution=DEMO_RESOLUTION, device=device)
    shown = status is not None and wanted(progress)  # the bars of each phase; a log gets the five lines alone
    manifest = compile_slab(source, slab_path, CompileOptions(budget=budget, device=device, calib_images=images),
                            bar=shown)
    rungs: dict[str, int] = {}
    for layer in manifest.layers:
        label = layer.spec.short_label
        rungs[label] = rungs.get(label, 0) + 1
    with open_slab(slab_path, verify="eager") as slab:
        totals = summarize(slab)["totals"]
    echo(f"[2/5] compiled in {time.perf_counter() - start:.1f} s under a {budget:,}-byte budget: "
         + ", ".join(f"{k} x{v}" for k, v in sorted(rungs.items()))
         + f"; {totals['bits_per_weight']:.3f} bits per layer weight, {totals['file_bytes']:,} bytes on disk "
         f"(bf16 parameters: {bf16:,} bytes)")

    data = write_tiny_dataset(folder / "data")
    lora_dir = folder / "lora"
    cfg = load_config(None, {"slab": str(slab_path), "data": str(data), "output": str(lora_dir), "steps": steps,
                             "resolution": RESOLUTION, "max_sequence_length": TOKENS, "lr": 5e-3, "rank": 8,
                             "save_every": steps // 2, "seed": 0})
    start = time.perf_counter()
    with training_progress(steps, status, progress) as after_step:
        result = train(cfg, echo=lambda line: None, progress=False, after_step=after_step)
    seconds = time.perf_counter() - start
    losses = result.losses
    k = max(1, len(losses) // 4)
    echo(f"[3/5] trained a rank-8 LoRA for {result.steps} steps on {len(list(data.glob('*.png')))} images in "
         f"{seconds:.1f} s (cache included): loss {statistics.mean(losses[:k]):.4f} over the first {k} steps, "
         f"{statistics.mean(losses[-k:]):.4f} over the last {k}")

    start = time.perf_counter()
    image = sample_images(slab_path, [PROMPT], lora=lora_dir, resolution=RESOLUTION, steps=8,
                          max_sequence_length=TOKENS, seed=0, progress=shown)[0]
    sample = folder / "sample.png"
    image.save(sample)
    echo(f"[4/5] sampled '{PROMPT}' with the LoRA in {time.perf_counter() - start:.1f} s "
         f"({image.width}x{image.height})")

    # the built-in dataset's gate settings (what `squareq accept` uses on it): 40 steps at lr 5e-3 learn enough
    # for the convergence gate to decide (docs/accept.md)
    training = ConvergenceSettings(steps=40, data=str(data), resolution=RESOLUTION, max_sequence_length=TOKENS, lr=5e-3)
    report = accept(AcceptOptions(slab=slab_path, model="tiny-flux", workdir=folder / "accept", training=training),
                    echo=lambda line: None, progress=shown)
    report_path = folder / "accept.json"
    report.write_json(report_path)
    report.write_junit(folder / "accept.xml")
    echo("[5/5] squareq accept:")
    for gate in report.gates:
        echo(f"      {gate.name}: {gate.status} ({gate.measured}; limit {gate.limit or 'none'})")
    return DemoResult(folder, slab_path, result.lora_file, sample, report, report_path)
