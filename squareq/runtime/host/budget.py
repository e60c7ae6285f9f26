"""How much host memory there is to spend, and the choices made with it.

* what the machine can give (:func:`host_memory`, :func:`available_memory`) and what this process holds
  (:func:`resident_memory`); a command's default host budget (:func:`default_host_budget`, ``--host-budget``);
* what torch's pinned allocator takes for a request (:func:`pinned_bytes`) and handing its cache back
  (:func:`empty_host_cache`);
* ``host="auto"``: keep the blobs in page-locked RAM when they fit, else read them from the slab file
  (:func:`choose_host`).

Pinned memory is the fast way (a 12B FLUX step at 512² ran 3.85× slower from disk, docs/benchmarks.md), but
page-locking more than the host can spare pushes everything else into swap or gets the process killed. So ``auto``
pins when the streamed blobs fit in the memory the kernel reports available (``MemAvailable``, which counts page
cache it can drop) with :data:`RESERVE_FRACTION` of the host's RAM, at least :data:`RESERVE_MIN_BYTES`, left for
the rest of the job (the data loader, the optimizer's host state, Python), and reads from disk otherwise.
"""
from __future__ import annotations

import os

import torch

from ...sizes import format_size

# beside a process's own memory when a host plan is made, what a run grows (page-locked batches, Python's objects, the
# libraries' buffers): on a CPU 1 GB; with CUDA 3 GB, as FLUX.1-dev's 8 GB config measured on an H200 (its steps held
# 2.9 GB beside the slab over the process measured at its plan: the CUDA runtime's host side, the compiled blocks, the
# feed; docs/benchmarks/cards.md)
WORKING_ROOM = {"cpu": 1 << 30, "cuda": 3 << 30}


def working_room(device: torch.device) -> int:
    """:data:`WORKING_ROOM` for a run on ``device``."""
    return WORKING_ROOM["cuda" if torch.device(device).type == "cuda" else "cpu"]

RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = 4 << 30
# the default budget leaves this share of the available memory, or at least MARGIN_LEAST, to the rest of the machine
MARGIN_SHARE = 0.10
MARGIN_LEAST = 2 << 30


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host RAM, or None where the system does not say."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> int | None:
    """Bytes the machine can still give (:func:`host_memory`'s first figure), or None where the system does not say."""
    memory = host_memory()
    return memory[0] if memory is not None else None


def _own_status(*keys: str) -> dict[str, int]:
    """Bytes of the ``keys`` (``VmRSS``, ``RssAnon``, ...) of this process's ``/proc/self/status`` that it has (none
    where it cannot be read: not Linux)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def resident_memory() -> int:
    """This process's resident memory now (Linux), else its peak so far (0 where neither can be read)."""
    rss = _own_status("VmRSS")
    if rss:
        return rss["VmRSS"]
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
    except (ImportError, OSError):
        return 0


def anonymous_memory() -> int:
    """This process's own resident memory now: ``RssAnon`` + ``RssShmem`` (page-locked blobs are shared anonymous
    pages, which the kernel counts as shmem), not the pages of files it maps; else its resident memory
    (:func:`resident_memory`)."""
    found = _own_status("RssAnon", "RssShmem")
    return sum(found.values()) if "RssAnon" in found else resident_memory()


def encoder_room(budget: int | None, device: torch.device) -> int | None:
    """What encoders loaded now for a run on ``device`` may hold within a host ``budget`` (None: the machine's,
    :func:`default_host_budget`): the budget less this process's own memory and its :func:`working_room`. None where
    it is not known, or where the budget does not even hold the process: the caller's own plan refuses that budget
    with the whole picture."""
    budget = budget if budget is not None else default_host_budget()[0]
    room = None if budget is None else budget - anonymous_memory() - working_room(device)
    return room if room is not None and room > 0 else None


def default_host_budget() -> tuple[int | None, str]:
    """(the default ``--host-budget``, how it was found): what the machine has available plus what this process
    already holds, less 10% of the available memory or 2 GB, whichever is larger."""
    available = available_memory()
    if available is None:
        return None, "the machine's available memory could not be read"
    own = anonymous_memory()  # the files it maps are page cache, which MemAvailable counts already
    margin = max(int(MARGIN_SHARE * available), MARGIN_LEAST)
    return max(own + available - margin, 0), (f"{format_size(available)} available and {format_size(own)} held by "
                                              f"this process, less a {format_size(margin)} margin")


def empty_host_cache() -> None:
    """Give the pinned memory torch's caching host allocator keeps for reuse back to the system, so a pass's pinned
    copies do not stay beside the next pass's (it keeps every freed block for a later one of the same size)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def pinned_bytes(n: int) -> int:
    """What torch's caching pinned allocator takes for ``n`` bytes: the next power of two."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def choose_host(nbytes: int, memory: tuple[int, int] | None = None) -> tuple[str, str]:
    """("pinned" or "disk", one clause saying why) for ``nbytes`` of streamed blobs; ``memory``: (available, total)
    bytes, measured when not given."""
    memory = memory if memory is not None else host_memory()
    if memory is None:
        return "pinned", "the host does not report its free memory"
    available, total = memory
    reserve = max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total))
    gb = 1e9
    if nbytes + reserve <= available:
        return "pinned", (f"the {nbytes / gb:.1f} GB of blocks fit in the {available / gb:.1f} GB of host memory "
                          f"available, leaving {reserve / gb:.1f} GB")
    return "disk", (f"the {nbytes / gb:.1f} GB of blocks do not fit in the {available / gb:.1f} GB of host memory "
                    f"available with {reserve / gb:.1f} GB left for the rest; they are read from the slab file "
                    "(slower; free memory or pass --host pinned to pin them anyway)")
