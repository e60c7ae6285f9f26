"""The libraries SquareQ drives (diffusers, transformers, the Hub, torchvision, peft): what they print, their warnings
and their progress bars, is theirs to say only under ``squareq -v``.

Their bars are unlabelled or say nothing a user needs ("Loading pipeline components...", a denoising loop's
``8/8 [00:00, 155it/s]``); SquareQ draws its own, labelled, for each phase (squareq/progress.py). The one exception is
a download's bars (:func:`download_bars`): a first compile of FLUX.1-dev downloads about 34 GB, for many minutes, and
the Hub labels those bars with the files they fetch. Nothing here imports
those libraries (``squareq --help`` stays fast): each is told when it is imported (:class:`_OnImport`; an
environment variable such as the Hub's would outrank a later ``-v`` in the same process), and each pipeline SquareQ
runs through :func:`pipeline_bars`.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
import warnings

# Libraries whose routine warnings (diffusers' "AutoencoderKL ... float32", "truncated to N tokens", torchvision's
# deprecations) would bury SquareQ's own lines in a 10-hour log; --verbose shows them.
THIRD_PARTIES = ("diffusers", "transformers", "huggingface_hub", "accelerate", "torchvision", "peft")
# where each library keeps the switch of its bars: module, the function that turns them on, the one that turns them
# off (the Hub's: its downloads; transformers': "Loading weights"; diffusers': "Loading pipeline components...")
BAR_SWITCHES = (("huggingface_hub.utils.tqdm", "enable_progress_bars", "disable_progress_bars"),
                ("transformers.utils.logging", "enable_progress_bar", "disable_progress_bar"),
                ("diffusers.utils.logging", "enable_progress_bar", "disable_progress_bar"))
HUB_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"  # the user's own choice for the Hub's bars, which it lets nothing change
_state = {"quiet": False}


def quiet_third_parties(verbose: bool) -> None:
    """Without ``verbose``: only errors from the libraries SquareQ drives, through logging or ``warnings``, and none
    of their progress bars but a download's; with it, their warnings and bars too (also after a quiet call in the
    same process)."""
    _state["quiet"] = not verbose
    _library_bars(verbose)
    if verbose:
        for name in THIRD_PARTIES:
            logging.getLogger(name).setLevel(logging.WARNING)
        return
    # diffusers and transformers set their loggers' level when first imported, from these variables
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in THIRD_PARTIES:
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")


def pipeline_bars(pipe):
    """``pipe`` (a diffusers pipeline SquareQ runs) with its denoising bar off unless ``-v``; returns ``pipe``."""
    if _state["quiet"] and hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe


@contextlib.contextmanager
def download_bars():
    """The Hub's bars on while a download runs (unless the user's HF_HUB_DISABLE_PROGRESS_BARS says otherwise), as
    they were after: minutes of a silent download would look like a hang."""
    import huggingface_hub.utils as hub_bars

    was_off = hub_bars.are_progress_bars_disabled()
    if was_off and not os.environ.get(HUB_BARS):
        hub_bars.enable_progress_bars()
    try:
        yield
    finally:
        if was_off and not os.environ.get(HUB_BARS):
            hub_bars.disable_progress_bars()


def _switch(module, shown: bool) -> None:
    """One library's bars on or off, as ``squareq`` was asked (the Hub's not against the user's variable)."""
    name = module.__name__
    if name.startswith("huggingface_hub") and os.environ.get(HUB_BARS):
        return
    on, off = next((on, off) for m, on, off in BAR_SWITCHES if m == name)
    getattr(module, on if shown else off)()


def _library_bars(shown: bool) -> None:
    """The bars of the libraries imported already on or off; of the others, when each is imported."""
    for name, _, _ in BAR_SWITCHES:
        if name in sys.modules:
            _switch(sys.modules[name], shown)
        elif not shown and not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _OnImport(name, _imported))


def _imported(module) -> None:
    if _state["quiet"]:  # a -v since the hook was placed leaves the bars on
        _switch(module, False)


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once ``name`` is imported (diffusers has no variable for its bars, and importing it here
    would cost ``squareq --help`` seconds); finds nothing itself, so the import goes on as it would."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if finder is not self and hasattr(
                finder, "find_spec") else None
            if spec is None:
                continue
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None  # the import goes on without the hook
            run = spec.loader.exec_module

            def exec_module(module, run=run) -> None:
                run(module)
                # a loader may serve other modules too (a zipimporter): only this one is told
                if module.__name__ == self.name:
                    if self in sys.meta_path:  # once: the module is imported now
                        sys.meta_path.remove(self)
                    self.then(module)

            spec.loader.exec_module = exec_module  # this spec's own loader object
            return spec
        return None
