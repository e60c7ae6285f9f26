"""What the tiny training runs share: a built-in tiny model compiled plainly to W8, the slab they train on."""
from pathlib import Path

from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.models import load_builtin
from squareq.quant import QuantSpec


def w8_tiny_slab(path: Path, name: str = "tiny-flux") -> Path:
    """The built-in ``name`` (tiny-flux, tiny-wan, ...) with every layer RTN W8 at ``path``."""
    model, adapter = load_builtin(name)
    write_rtn_slab(model, adapter.blocks(model), {}, path,
                   PlainOptions(default_spec=QuantSpec(bits=8), family=adapter.family, source=name))
    return path
