"""Host memory: where a slab's blobs wait on the host (``staging``: one pinned arena, or disk reads through a pinned
staging ring), page-locked and shared memory (``pinned``), and how much the machine can spare with the choices made
from it (``budget``: available and resident memory, default host budgets, ``host="auto"``)."""
