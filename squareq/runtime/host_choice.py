"""``host="auto"``: keep the blobs in page-locked RAM when they fit, else read them from the slab file.

Pinned memory is the fast way (a 12B FLUX step at 512² ran 3.85× slower from disk, docs/benchmarks.md), but
page-locking more than the host can spare pushes everything else into swap or gets the process killed. So ``auto``
pins when the streamed blobs fit in the memory the kernel reports available (``MemAvailable``, which counts page
cache it can drop) with :data:`RESERVE_FRACTION` of the host's RAM, at least :data:`RESERVE_MIN_BYTES`, left for
the rest of the job (the data loader, the optimizer's host state, Python), and reads from disk otherwise.
"""
from __future__ import annotations

from ..devices import host_memory

RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = 4 << 30


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
