"""The compiler: reads a source model block by block, calibrates, chooses a format per layer and writes a slab."""
from .budget import BudgetError, parse_size
from .compile_setup import check_budget
from .driver import compile_slab
from .options import CompileOptions
from .thresholds import Thresholds, ThresholdsError

__all__ = ["BudgetError", "CompileOptions", "Thresholds", "ThresholdsError", "check_budget", "compile_slab",
           "parse_size"]
