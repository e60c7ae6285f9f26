"""One module per weight format, each registering a :class:`squareq.quant.registry.Format`.

Every module of this folder is imported here, so a new format is one new file (its kernel, if it has one, is one
file in ``squareq/kernels/formats/``).
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
