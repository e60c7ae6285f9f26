"""Training checkpoints: atomic, resumable, and free of pickle.

A checkpoint is a directory ``OUT/checkpoints/step-00001234/`` holding

``lora.safetensors``
    the LoRA tensors, under the caller's names.
``optimizer.safetensors``
    every tensor of ``optimizer.state_dict()``: per-parameter state as ``state.<param name>.<key>``
    (AdamW's ``exp_avg``, ``exp_avg_sq`` and its ``step`` tensor), and tensor-valued
    hyperparameters, if any, as ``param_groups.<i>.<key>``.
``state.safetensors``
    the remaining tensors: the torch CPU RNG state (``rng.torch``), one CUDA RNG state per
    device (``rng.cuda.<i>``), and tensors found in the scheduler state or in ``extra``.
``checksums.json``
    the sha256 of each of the four files above, written last; :func:`load_checkpoint` checks every file
    against it before reading any, so a flipped bit is refused instead of trained on.
``state.json``
    format name and version, step, the optimizer's non-tensor state and per-group hyperparameters
    (parameters named, not numbered), the scheduler's JSON-able state, Python ``random`` and numpy
    global RNG states, ``data_state``, ``config`` and ``extra``.

How the optimizer, scheduler and RNG states become those tensors and that JSON, and back, is
train/checkpoint_state.py. Nothing is pickled and nothing is unpickled: safetensors and JSON are data only, so
loading a checkpoint from a stranger cannot run code.

A checkpoint is built in a temporary hidden sibling folder, every file fsynced, then renamed into
place (``squareq.slab.atomic.atomic_directory``), so a crash leaves either the complete checkpoint
or nothing under the ``step-*`` name. This module also finds the newest checkpoint and the one ``resume`` names,
prunes old ones and removes what a killed write left behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..slab.atomic import atomic_directory, remove_debris
from ..slab.digest import file_sha256
from ..slab.errors import brief
from ..slab.safetensors_file import safetensors_bytes
from .checkpoint_state import (
    CheckpointError,
    DamagedState,
    NotEncodable,
    capture_rng,
    check_param_names,
    decode_value,
    encode_optimizer,
    encode_plain,
    encode_scheduler,
    encode_value,
    optimizer_params,
    restore_optimizer,
    restore_rng,
    restore_scheduler,
)

if TYPE_CHECKING:
    from .config import TrainConfig

FORMAT = "squareq-train-checkpoint"
FORMAT_VERSION = 2  # 2: checksums.json

CHECKPOINTS_DIR = "checkpoints"
LORA_FILE = "lora.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
CHECKSUMS_FILE = "checksums.json"
HASHED_FILES = (LORA_FILE, OPTIMIZER_FILE, TENSORS_FILE, STATE_FILE)
REQUIRED_FILES = (*HASHED_FILES, CHECKSUMS_FILE)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` gives back; optimizer, scheduler and RNG states are already restored."""

    step: int
    lora: dict[str, torch.Tensor]
    data_state: dict
    config: dict
    extra: dict = field(default_factory=dict)
    path: Path | None = None


def checkpoint_dir(out_dir: str | os.PathLike, step: int) -> Path:
    """The folder a checkpoint of ``step`` lives in: ``out_dir/checkpoints/step-{step:08d}``."""
    return Path(out_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


# --------------------------------------------------------------------------- writers (patchable in tests)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    with open(path, "wb") as fh:
        fh.write(safetensors_bytes(tensors, {**(metadata or {}), "format": FORMAT}))
        fh.flush()
        os.fsync(fh.fileno())


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the renames durable; not every platform can open a directory, and that is not fatal.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- save / load


def save_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    lora: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    data_state: dict,
    config: dict,
    extra: dict | None = None,
    lora_metadata: dict[str, str] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and return its folder.

    ``lora_metadata`` goes into ``lora.safetensors``' header (the adapter config that keeps the LoRA's alpha:
    train/lora_files.py ``adapter_metadata``).

    ``param_names`` names the optimizer's parameters in ``param_groups`` order. ``data_state``,
    ``config`` and ``extra`` must be JSON-able; ``extra`` may also hold tensors (e.g. a dedicated
    ``torch.Generator``'s ``get_state()``), which come back as tensors. An existing checkpoint of the
    same step (a run resumed from an older one) is replaced.
    """
    check_param_names(optimizer, param_names)
    final = checkpoint_dir(out_dir, step)

    # Encode everything before touching the disk, so a value that cannot be saved fails cleanly.
    lora_tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in lora.items()}
    opt_tensors: dict[str, torch.Tensor] = {}
    other_tensors: dict[str, torch.Tensor] = {}
    try:
        state = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "optimizer": encode_optimizer(optimizer, param_names, opt_tensors),
            "scheduler": encode_scheduler(scheduler, other_tensors),
            "rng": capture_rng(other_tensors),
            "data_state": encode_plain(data_state, "data_state"),
            "config": encode_plain(config, "config"),
            "extra": encode_value(extra or {}, "extra", other_tensors),
        }
    except NotEncodable as exc:
        raise ValueError(
            f"cannot save checkpoint {final}: {exc}; keep data_state, config and extra JSON-able."
        ) from exc

    with atomic_directory(final, overwrite=True) as tmp:
        _write_tensors(tmp / LORA_FILE, lora_tensors, lora_metadata)
        _write_tensors(tmp / OPTIMIZER_FILE, opt_tensors)
        _write_tensors(tmp / TENSORS_FILE, other_tensors)
        _write_json(tmp / STATE_FILE, state)
        _write_json(tmp / CHECKSUMS_FILE, {"format": FORMAT, "sha256": {f: file_sha256(tmp / f) for f in HASHED_FILES}})
        _fsync_dir(tmp)
    _fsync_dir(final.parent)
    return final


def _resume_hint(path: Path) -> str:
    """What to do instead of resuming from ``path``: the newest complete checkpoint before it, if any."""
    match = _STEP_DIR.match(path.name)
    older = [folder for step, folder in _step_dirs(path.parent.parent)
             if match and step < int(match.group(1))] if path.parent.name == CHECKPOINTS_DIR else []
    if older:
        return f"resume from the previous checkpoint with --resume {older[-1]}"
    return "no earlier checkpoint exists, so start again without --resume in a new -o folder"


def _verify_checksums(path: Path, hint: str) -> None:
    """Every file of the checkpoint against checksums.json, before any of them is parsed."""
    try:
        recorded = json.loads((path / CHECKSUMS_FILE).read_text(encoding="utf-8"))["sha256"]
        wanted = {name: str(recorded[name]) for name in HASHED_FILES}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {CHECKSUMS_FILE} is unreadable or damaged ({brief(exc)}); "
                              f"{hint}.") from None
    for name, digest in wanted.items():
        try:
            actual = file_sha256(path / name)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({exc.strerror}); {hint}.") from None
        if actual != digest:
            raise CheckpointError(f"checkpoint {path}: {path / name} fails its sha256 check, so the checkpoint is "
                                  f"corrupted; {hint}.")


def _read_tensors(path: Path, where: Path, hint: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"checkpoint {where}: {path.name} is not a valid safetensors file (SquareQ never loads pickles) "
            f"({brief(exc)}); {hint}."
        ) from exc


def _check_lora(lora: dict[str, torch.Tensor], optimizer, param_names: list[str], path: Path, hint: str) -> None:
    """The checkpoint's LoRA has exactly the trained parameters, with their shapes, and only finite values."""
    for name, p in zip(param_names, optimizer_params(optimizer)):
        t = lora.get(name)
        if t is None:
            raise CheckpointError(f"checkpoint {path}: {LORA_FILE} has no tensor {name}, so it was made for a "
                                  f"different LoRA (rank/targets) or is damaged; {hint}.")
        if list(t.shape) != list(p.shape):
            raise CheckpointError(f"checkpoint {path}: {LORA_FILE} holds {name} with shape {list(t.shape)} where this "
                                  f"run's LoRA has {list(p.shape)}, so it was made for a different LoRA (rank/targets) "
                                  f"or is damaged; {hint}.")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"checkpoint {path}: {LORA_FILE} holds NaN or Inf in {name}; {hint}.")
    extra = sorted(set(lora) - set(param_names))
    if extra:
        raise CheckpointError(f"checkpoint {path}: {LORA_FILE} holds {len(extra)} tensor(s) this run does not train, "
                              f"e.g. {extra[0]}, so it was made for a different LoRA (rank/targets); {hint}.")


def check_resume_folder(path: str | os.PathLike) -> None:
    """Refuse a ``--resume`` that names no checkpoint folder, in a sentence saying what it names and what resuming
    takes; a folder is left to :func:`load_checkpoint`, which checks its files."""
    path = Path(path)
    takes = (f"--resume takes latest or a checkpoint folder, {CHECKPOINTS_DIR}/step-NNNNNNNN in a run's -o folder, "
             f"holding {', '.join(REQUIRED_FILES)}")
    run = path.parent if path.name == CHECKPOINTS_DIR else path  # a run's -o folder, or its checkpoints folder
    if (run / CHECKPOINTS_DIR).is_dir():
        found = latest_checkpoint(run)
        raise CheckpointError(f"--resume {path} holds a run's checkpoints but is not one; "
                              + (f"pass --resume {found} (the newest), or -o {run} --resume latest" if found
                                 else "none of them is complete yet, so start again without --resume") + ".")
    if path.is_dir():
        return
    if path.exists():
        inside = f"; pass the folder holding it, --resume {path.parent}" if path.name in REQUIRED_FILES else ""
        raise CheckpointError(f"--resume {path} is a file, not a folder; {takes}{inside}.")
    raise CheckpointError(f"--resume {path} does not exist; {takes}.")


def load_checkpoint(
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> Checkpoint:
    """Read the checkpoint folder ``path``; restore optimizer, scheduler and all RNG states in place.

    Every file is checked against ``checksums.json`` first. The caller copies ``Checkpoint.lora`` into
    its LoRA parameters (names and shapes are checked against ``param_names``). Raises :class:`CheckpointError`
    for an incomplete, corrupted or foreign checkpoint, or one made for a different LoRA; the sentence
    names the previous checkpoint to resume from instead.
    """
    path = Path(path)
    check_param_names(optimizer, param_names)
    check_resume_folder(path)
    hint = _resume_hint(path)
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        state = exc
    version = state.get("format_version") if isinstance(state, dict) else None
    if isinstance(state, dict) and state.get("format") == FORMAT and version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, which this SquareQ "
            f"(version {FORMAT_VERSION}) cannot read; use the SquareQ that wrote it or {hint}."
        )
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}); {hint}.")
    _verify_checksums(path, hint)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is unreadable ({brief(state)}); {hint}.")
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a SquareQ training checkpoint; {hint}.")

    lora = _read_tensors(path / LORA_FILE, path, hint)
    opt_tensors = _read_tensors(path / OPTIMIZER_FILE, path, hint)
    other_tensors = _read_tensors(path / TENSORS_FILE, path, hint)
    try:
        restore_optimizer(optimizer, param_names, state["optimizer"], opt_tensors, str(path))
        _check_lora(lora, optimizer, param_names, path, hint)
        restore_scheduler(scheduler, state["scheduler"], other_tensors, str(path))
        extra = decode_value(state["extra"], other_tensors, str(path))
        result = Checkpoint(step=int(state["step"]), lora=lora,
                            data_state=decode_value(state["data_state"], {}, str(path)),
                            config=decode_value(state["config"], {}, str(path)), extra=extra, path=path)
        if not isinstance(result.data_state, dict) or not isinstance(result.config, dict) or result.step < 0:
            raise DamagedState("its step, data state or config has the wrong type")
        # Last, so nothing above consumes random numbers after the restore.
        restore_rng(state["rng"], other_tensors, str(path))
    except KeyError as exc:
        raise CheckpointError(f"checkpoint {path} is corrupted ({exc} is missing from it); {hint}.") from exc
    except (DamagedState, TypeError, ValueError, AttributeError, IndexError, RuntimeError, OverflowError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path} is corrupted ({brief(exc)}); {hint}.") from exc
    return result


# --------------------------------------------------------------------------- listing and pruning


def _step_dirs(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Checkpoint folders, oldest first; temporary (hidden) and incomplete folders are skipped."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        # a checkpoint of an older format (no checksums) is listed, so that resuming it is refused with a reason
        if match and entry.is_dir() and all((entry / f).is_file() for f in HASHED_FILES):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def checkpoint_config(path: str | os.PathLike) -> dict:
    """The training configuration a checkpoint recorded ({} when it cannot be read: loading it says why)."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
        config = decode_value(state["config"], {}, str(path))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError, DamagedState):
        return {}
    return config if isinstance(config, dict) else {}


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``out_dir``, or None."""
    found = _step_dirs(out_dir)
    return found[-1][1] if found else None


def resume_path(cfg: TrainConfig, out: Path) -> Path | None:
    """The checkpoint ``resume`` names (``latest``: the newest in ``out``, None before the first), or None."""
    if not cfg.resume:
        return None
    return latest_checkpoint(out) if cfg.resume == "latest" else Path(cfg.resume)


def prune_checkpoints(out_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints; return the folders removed.

    Each folder is first renamed to a hidden temporary name (one atomic step, after which
    ``latest_checkpoint`` no longer sees it), then removed. The newest is never deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the newest checkpoint is always kept), got {keep_last}.")
    removed = []
    for _, folder in _step_dirs(out_dir)[:-keep_last]:
        doomed = folder.with_name(f".{folder.name}.del-{uuid.uuid4().hex[:8]}")
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(folder)
    return removed


def remove_checkpoint_debris(out_dir: str | os.PathLike) -> list[Path]:
    """Remove the hidden folders a killed checkpoint write or prune left in ``out_dir/checkpoints``
    (``.step-<N>.tmp-*``, ``.old-*``, ``.del-*``; a kill skips their cleanup and no later save has the same step);
    nothing else there is touched. Returns what was removed."""
    return remove_debris(Path(out_dir) / CHECKPOINTS_DIR / "step-[0-9]*", pattern=True)
