"""Which device a command runs on: the one named with ``--device``, else the GPU when there is one, else the CPU."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_chosen: list[torch.device] = []  # the devices of the enclosing run_on blocks, innermost last


class DeviceError(ValueError):
    """A named device cannot be used; the message names the flag's value and what to do."""


def parse_device(requested: str | torch.device | None) -> torch.device | None:
    """``requested`` as a device (None or ``auto``: None), or one sentence when it cannot run here."""
    if requested is None or str(requested) == "auto":
        return None
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {requested}: not a device; give auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: PyTorch sees no CUDA GPU here (torch {torch.__version__}); "
                              "install a CUDA build of torch, or leave --device at auto.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                              "numbered from 0.")
    return device


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``requested`` as a device, else the one an enclosing :func:`run_on` chose, else CUDA when it is available and
    the CPU otherwise."""
    if requested is not None:
        return torch.device(requested)
    if _chosen:
        return _chosen[-1]
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe(device: str | torch.device) -> str:
    """A device as a log line names it: ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``the CPU``."""
    device = torch.device(device)
    if device.type != "cuda":
        return "the CPU" if device.type == "cpu" else str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


@contextlib.contextmanager
def run_on(requested: str | torch.device | None) -> Iterator[torch.device]:
    """Inside, :func:`default_device` answers ``requested`` (``auto`` or None: its usual choice), so a whole command
    (``squareq accept``'s training runs, ``squareq cache``'s encoders) follows one ``--device``."""
    device = parse_device(requested) or default_device()
    _chosen.append(device)
    try:
        yield device
    finally:
        _chosen.pop()


def allocator_cap(index: int, total: int) -> int | None:
    """The bytes this process's CUDA allocator may reserve on GPU ``index`` (of ``total`` bytes) when a cap is set
    (``torch.cuda.set_per_process_memory_fraction``: the compile's ``--vram-budget``, a benchmark's card), else None.
    The device's free memory does not show the cap, so whatever sizes itself by free memory bounds it by this too."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is None:
        return None
    share = fraction(index)
    return int(share * total) if share < 1.0 else None
