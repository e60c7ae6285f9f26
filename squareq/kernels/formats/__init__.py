"""Triton dequantization kernels of the weight formats other than ``int`` (whose kernel is
:mod:`squareq.kernels.triton_dequant`), one module each, registered by what they serve.

A kernel module calls :func:`register` with a predicate on the format and a ``prepare(out, qw)`` that returns a
zero-argument launcher, as :func:`squareq.kernels.triton_dequant.prepare_triton_dequantize` does. Modules are
imported only when a Triton backend is asked for one (:func:`kernel_for`), since importing them imports triton.
A format without a kernel dequantizes through its torch reference.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

_KERNELS: list[tuple[Callable, Callable]] = []  # (serves(format) -> bool, prepare(out, qw) -> launcher)
_loaded = False


def register(serves: Callable, prepare: Callable) -> None:
    """Offer ``prepare`` for every format ``serves(format)`` accepts (the first registered match wins)."""
    _KERNELS.append((serves, prepare))


def kernel_for(fmt) -> Callable | None:
    """The ``prepare`` of the kernel serving ``fmt`` (a :class:`squareq.quant.Format`), or None."""
    global _loaded
    if not _loaded:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")  # a kernel module that fails to import says so
        _loaded = True
    return next((prepare for serves, prepare in _KERNELS if serves(fmt)), None)
