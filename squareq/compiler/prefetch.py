"""Reading what waits one item ahead: the next item's read runs in a worker thread while the caller works on the
current one, so reading spilled tensors back from disk (compiler/spill.py) overlaps the GPU's work."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor


@contextlib.contextmanager
def read_ahead(read: Callable, items: Sequence, ahead: bool = True) -> Iterator[Iterator[tuple]]:
    """Inside: an iterator of ``(item, read(item))`` for each of ``items`` in order. With ``ahead``, the first read
    starts on entry and each next one in a worker thread while the caller works on the current one: reading back
    spilled rows is file reads and checksums, which release the GIL, so the disk overlaps the GPU's work. Host memory
    then holds the current item's rows and the next one's; the exit waits for a read still in flight. Without
    ``ahead``, each read happens when its item is reached."""
    items = list(items)
    if not ahead or not items:
        yield ((item, read(item)) for item in items)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="squareq-spill-read") as pool:
        pending = pool.submit(read, items[0])

        def in_order():
            nonlocal pending
            for i, item in enumerate(items):
                got = pending.result()  # a read's error is raised here, for the item it was reading
                pending = pool.submit(read, items[i + 1]) if i + 1 < len(items) else None
                yield item, got

        yield in_order()
