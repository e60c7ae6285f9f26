"""``squareq accept``: the gates a slab must pass before anyone trains on it, re-measured independently.

1. layer MSE on fresh inputs (``layer_mse.py``), 2. block drift: the model's output with one block quantized
(``block_drift.py``), 3. image drift: images from the slab against the bf16 source's (``image_drift.py``),
4. gradient agreement of the LoRA (``gradients.py``), 5. convergence of a LoRA against the bf16 source, decided
with paired tests (``convergence.py``), 6. peak VRAM and size (``resources.py``). ``runner.accept`` runs them;
``report.py`` renders the table, JSON and JUnit XML from one result. docs/accept.md explains the gates.
"""
from .convergence import ConvergenceSettings
from .gates import FAIL, INCONCLUSIVE, PASS, SKIP, GateResult
from .report import AcceptReport
from .runner import AcceptError, AcceptOptions, accept

__all__ = ["FAIL", "INCONCLUSIVE", "PASS", "SKIP", "AcceptError", "AcceptOptions", "AcceptReport",
           "ConvergenceSettings", "GateResult", "accept"]
