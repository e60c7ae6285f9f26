"""Ctrl-C during a run's optimizer steps (:class:`CtrlC`): the first SIGINT only asks the run to stop after the step
it is in, so that the loop can write a checkpoint and the LoRA so far and say how to resume; a second one stops at
once (KeyboardInterrupt), and the atomic writes leave what was last written intact. Before the steps (the plan, the
cache: itself resumable) and after them, Ctrl-C stops at once as it always did."""
from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

# written by the handler straight to the terminal: a signal handler must not take the locks print and tqdm hold
NOTICE = (b"\nCtrl-C: finishing this step, then saving a checkpoint and the LoRA so far; press Ctrl-C again to stop "
          b"at once\n")


class CtrlC:
    """SIGINT handled as above while the ``with`` block runs, in the main thread only (Python delivers signals
    there; elsewhere nothing is installed and Ctrl-C behaves as before); the previous handler is put back on leaving,
    also after an error."""

    def __init__(self) -> None:
        self.pressed = False
        self.previous = None
        self.installed = False

    def __enter__(self) -> CtrlC:
        # a run started with SIGINT ignored (a background job) keeps ignoring it
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            # None: the handler was not set from Python (an embedding); Python's own is the one to put back
            signal.signal(signal.SIGINT, signal.default_int_handler if self.previous is None else self.previous)
            self.installed = False

    def _handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        try:
            os.write(2, NOTICE)
        except OSError:  # no stderr: the flag is what matters
            pass

    def stop(self, world: int, device: torch.device) -> bool:
        """Whether the run stops after this step: Ctrl-C pressed here or, with several ranks, on any of them (one
        all-reduce of one number a step), so that every rank stops after the same step."""
        if world <= 1:
            return self.pressed
        flag = torch.tensor([float(self.pressed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
