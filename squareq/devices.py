"""Which device a command runs on when the user names none: the GPU when there is one, else the CPU."""
from __future__ import annotations

import torch


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``requested`` as a device, or CUDA when it is available and the CPU otherwise."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
