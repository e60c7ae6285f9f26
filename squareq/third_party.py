"""The libraries SquareQ drives (diffusers, transformers, the Hub, torchvision, peft): what they print is theirs
to say only under ``squareq -v``."""
from __future__ import annotations

import logging

# Libraries whose routine warnings (diffusers' "AutoencoderKL ... float32", "truncated to N tokens", torchvision's
# deprecations) would bury SquareQ's own lines in a 10-hour log; --verbose shows them.
THIRD_PARTIES = ("diffusers", "transformers", "huggingface_hub", "accelerate", "torchvision", "peft")


def quiet_third_parties(verbose: bool) -> None:
    """Without ``verbose``: only errors from the libraries SquareQ drives, through logging or ``warnings``; with it,
    their warnings too."""
    if verbose:
        for name in THIRD_PARTIES:
            logging.getLogger(name).setLevel(logging.WARNING)
        return
    import os
    import warnings

    # diffusers and transformers set their loggers' level when first imported, from these variables
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in THIRD_PARTIES:
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")
