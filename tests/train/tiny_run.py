"""What the tiny training runs share: a built-in tiny model compiled plainly to W8, the slab they train on; a run
killed and resumed."""
from pathlib import Path

import pytest
import torch

from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.models import ADAPTERS, BUILTIN_MODELS, load_builtin
from squareq.quant import QuantSpec
from squareq.train.loop import train
from squareq.train.lora_reader import load_lora


def w8_tiny_slab(path: Path, name: str = "tiny-flux", model=None) -> Path:
    """The built-in ``name`` (tiny-flux, tiny-wan, ...), or ``model`` of its family (a toy pipeline's own denoiser),
    with every layer RTN W8 at ``path``."""
    adapter = ADAPTERS[BUILTIN_MODELS[name][0]]
    model = model if model is not None else load_builtin(name)[0]
    write_rtn_slab(model, adapter.blocks(model), {}, path,
                   PlainOptions(default_spec=QuantSpec(bits=8), family=adapter.family, source=name))
    return path


def resumes_bit_for_bit(config, straight_lora: Path, killed_at: int) -> None:
    """``config(**keys)`` (a run's TrainConfig) killed after step ``killed_at`` and resumed with ``resume = "latest"``
    writes the LoRA of the straight run's ``straight_lora``, bit for bit."""
    def kill(step):
        if step == killed_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(), echo=lambda s: None, after_step=kill)
    resumed = train(config(resume="latest"), echo=lambda s: None)
    a, _ = load_lora(straight_lora)
    b, _ = load_lora(resumed.lora_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
