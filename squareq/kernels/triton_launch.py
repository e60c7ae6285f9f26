"""Launching a Triton kernel past its dispatcher, for kernels that run thousands of times a step.

Triton's dispatcher binds the arguments, computes specialization keys and looks up its cache on every call: tens of
microseconds of host time, which a FLUX step's two thousand FP8 operand launches could not afford.
"""
from __future__ import annotations

import torch


def specialization(args: tuple) -> tuple:
    """What Triton specializes a kernel on, per argument: a tensor's dtype and 16-byte alignment, an integer's being
    1 or a multiple of 16. Two calls with equal keys (and equal constants) run the same compiled kernel."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a == 1, a % 16 == 0)
                 for a in args)


class DirectLaunch:
    """Launches ``kernel`` with the compiled kernel Triton's dispatcher chose for arguments of the same
    specialization, without the dispatcher: its per-call work (binding, specialization keys, cache lookup) cost more
    host time than FP8 saved on the GPU, and a FLUX step launches these kernels about two thousand times.

    The first direct launch of each specialization is checked against the dispatcher's (the arguments at
    ``outputs`` must come out equal); if it differs or fails, that specialization keeps the dispatcher. A call during
    a CUDA-graph capture goes through the dispatcher until a call outside one has made the check. CUDA only: the
    interpreter always goes through the dispatcher."""

    def __init__(self, kernel, constants: dict, outputs: tuple[int, ...]) -> None:
        self.kernel, self.constants, self.outputs = kernel, constants, outputs
        self.trailing = [constants[n] for n in kernel.arg_names if n in constants]
        self.state: dict[tuple, tuple | None] = {}  # key -> (checked, compiled); None: the dispatcher only

    def __call__(self, grid: tuple, args: tuple) -> None:
        key = specialization(args)
        state = self.state.get(key, ())
        if not state:
            compiled = self.kernel[grid](*args, **self.constants)
            if state == () and args[0].is_cuda and hasattr(compiled, "__getitem__"):
                self.state[key] = (False, compiled)
            return
        checked, compiled = state
        runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
        if checked:
            runner(*args, *self.trailing)
            return
        if torch.cuda.is_current_stream_capturing():  # the check reads results on the host: not inside a capture
            self.kernel[grid](*args, **self.constants)
            return
        try:
            runner(*args, *self.trailing)
            direct = [args[i].clone() for i in self.outputs]
        except Exception:  # a Triton whose compiled kernels launch otherwise: keep the dispatcher
            direct = None
        self.kernel[grid](*args, **self.constants)
        same = direct is not None and all(torch.equal(d, args[i]) for d, i in zip(direct, self.outputs, strict=True))
        self.state[key] = (True, compiled) if same else None
