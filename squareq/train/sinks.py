"""Where a run's figures go: ``metrics.jsonl`` (one line per step), TensorBoard or Weights & Biases when asked, the
progress bar on a terminal (or about ten progress lines without one, each with an ETA: squareq/progress.py,
train/run_summary.py), and ``loss.png`` drawn from the JSONL file. :class:`RunLogs` holds the open sinks of one run; a
resumed run first drops the lines of the steps it redoes."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
from pathlib import Path

from ..extras import require
from ..plot import plot_curves, smooth
from ..progress import Progress, wanted
from ..slab.atomic import atomic_write_bytes
from .config import TrainConfig
from .errors import TrainError
from .run_summary import StepClock
from .validation import validation_history

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID = "wandb-run-id"  # in the output folder: a resumed run logs on to the same W&B run


class RunLogs:
    """The open sinks of one run: metrics.jsonl (rank 0's; the other ranks write to nothing), TensorBoard or W&B when
    ``cfg.log`` asks, and a progress bar on a terminal (or when ``progress``). ``echo`` prints above the bar;
    ``losses`` is every recorded step's loss."""

    def __init__(self, cfg: TrainConfig, out: Path, main: bool, total: int, step: int, progress: bool | None,
                 echo) -> None:
        self.total, self.losses = total, []
        self.board = None
        self.metrics = open(out / METRICS_FILE, "a") if main else open(os.devnull, "w")
        board = {"tensorboard": _tensorboard, "wandb": _wandb}.get(cfg.log)
        try:
            self.board = board(cfg, out) if board is not None and main else None
        except BaseException:
            self.metrics.close()
            raise
        self.every = max(1, min(10, total // 10))  # progress lines: about ten per run, at least every ten steps
        self.bar = Progress(total, "train", "step", shown=main and wanted(progress), echo=echo, every=self.every,
                            initial=step)
        self.echo = self.bar.above(echo)
        self.clock = StepClock(total, step)

    def write(self, record: dict) -> None:
        """A finished step's ``record`` (its figures: train/step.py) in metrics.jsonl and on the board, and the
        progress bar or line."""
        step, loss, norm = record["step"], record["loss"], record["grad_norm"]
        self.losses.append(loss)
        self.metrics.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, list):  # one figure per rank
                    for rank, v in enumerate(value):
                        self.board.add_scalar(f"train/{key}/rank{rank}", v, step)
                elif key != "step":
                    self.board.add_scalar(f"train/{key}", value, step)
        self.metrics.flush()
        recent = self.losses[-self.every:]
        vram = f", {record['peak_reserved_GB']:.2f} GB reserved" if "peak_reserved_GB" in record else ""
        status = (f"loss {loss:.4f} (avg {sum(recent) / len(recent):.4f}), lr {record['lr']:.2e}, "
                  f"grad norm {norm:.3f}{vram}")
        self.clock.add(step, record["seconds"])
        self.bar.advance(status=status, line=f"step {step}/{self.total}: {status}, {1 / record['seconds']:.2f} it/s, "
                                             f"ETA {self.clock.eta()}")
        said = self.clock.run_line()
        if said is not None:
            self.echo(said)

    def close(self, failed: bool) -> None:
        """Close the bar, metrics.jsonl and the board (a W&B run that ``failed`` shows as failed). A metrics.jsonl
        that no step wrote to is removed: a run that stopped before its first step leaves no empty file behind."""
        self.bar.close()
        self.metrics.close()
        path = Path(self.metrics.name)
        if path.name == METRICS_FILE and path.is_file() and path.stat().st_size == 0:
            path.unlink()
        if self.board is not None:
            self.board.close(failed=failed)


def plot_losses(out: Path) -> Path | None:
    """``out/loss.png``: every step's loss in ``out/metrics.jsonl`` (resumed runs included) and its trailing mean
    over a tenth of the steps; None before the first step."""
    metrics = out / METRICS_FILE
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    losses = [float(r["loss"]) for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]
    if not losses:
        return None
    window = max(1, len(losses) // 10)
    curves = {"loss": (losses, (170, 170, 170), 1), f"mean of {window}": (smooth(losses, window), (30, 90, 200), 2)}
    held = validation_history(out)
    if held:  # drawn at its steps (step 0's at step 1), joined by straight lines
        points = [math.nan] * len(losses)
        for row in held:
            if row["step"] <= len(losses):
                points[max(row["step"], 1) - 1] = row["val_loss"]
        curves["validation"] = (points, (210, 80, 30), 2)
    return plot_curves(out / "loss.png", f"training loss by step ({out.name})", curves)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the metrics of steps after the checkpoint a run resumes from (they are about to be redone)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


def _tensorboard(cfg: TrainConfig, out: Path):
    """A TensorBoard writer for ``out/tensorboard`` (``--log tensorboard``); the JSONL file is written as well."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrainError("--log tensorboard needs the tensorboard package: pip install tensorboard, or use --log "
                         "jsonl.") from None
    writer = SummaryWriter(str(out / "tensorboard"))
    return _Closing(writer)


class _Closing:
    """A TensorBoard writer whose ``close`` takes (and ignores) whether the run failed, as a W&B run's does."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.add_scalar = writer.add_scalar

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _WandbBoard:
    """A Weights & Biases run behind the TensorBoard writer's two calls (``--log wandb``)."""

    def __init__(self, run) -> None:
        self.run = run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed in W&B


def _wandb(cfg: TrainConfig, out: Path) -> _WandbBoard:
    """A W&B run in ``cfg.wandb_project``, named like the LoRA, its files under ``out/wandb``; its id is kept in
    ``out/wandb-run-id``, so a resumed run (``--resume``) continues it (W&B drops steps at or below the last it
    logged, which a resume from an earlier checkpoint repeats)."""
    wandb = require("wandb", "--log wandb")
    id_file = out / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
    atomic_write_bytes(id_file, run_id.encode())
    config = {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)
              for k, v in dataclasses.asdict(cfg).items()}
    try:
        run = wandb.init(project=cfg.wandb_project, name=cfg.title or Path(cfg.output).name, dir=str(out), id=run_id,
                         resume="allow", config=config)
    except Exception as exc:  # noqa: BLE001 - no login, no network, a W&B server error: one sentence, then stop
        raise TrainError(f"--log wandb: Weights & Biases could not start a run ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}); log in with `wandb login`, set WANDB_MODE=offline to "
                         "log without an account, or use --log jsonl. The cache is kept; rerun the same command.") \
            from None
    return _WandbBoard(run)

