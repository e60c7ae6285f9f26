"""``squareq accept``: three gates a slab must pass before anyone trains on it, re-measured independently.

1. layer MSE on fresh inputs (``layer_mse.py``), 2. convergence of a LoRA against the bf16 source
(``convergence.py``), 3. peak VRAM and size (``resources.py``). ``runner.accept`` runs them;
``report.py`` renders the table, JSON and JUnit XML from one result. docs/accept.md explains the gates.
"""
from .convergence import ConvergenceSettings
from .gates import FAIL, PASS, SKIP, GateResult
from .report import AcceptReport
from .runner import AcceptError, AcceptOptions, accept

__all__ = ["FAIL", "PASS", "SKIP", "AcceptError", "AcceptOptions", "AcceptReport", "ConvergenceSettings", "GateResult",
           "accept"]
