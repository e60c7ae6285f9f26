"""On the device image, torch's cuDNN attention backward returns NaN/Inf gradients for tiny-flux without raising
(measured: 318 skipped steps in a 30-step run). The trainer must notice, turn cuDNN attention off once and redo
the step, so a user's run with default settings loses no step."""
import logging

import pytest
import torch

from squareq.models import load_builtin
from squareq.quant import QuantSpec
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.train.config import load_config
from squareq.train.loop import train
from squareq.train.tiny_dataset import write_tiny_dataset

pytestmark = pytest.mark.gpu


def test_training_with_cudnn_attention_on_loses_no_step(tmp_path, caplog):
    model, adapter = load_builtin("tiny-flux")
    slab = tmp_path / "tiny.slab"
    write_rtn_slab(model, adapter.blocks(model), {}, slab,
               PlainOptions(default_spec=QuantSpec(bits=8), family="flux", source="tiny-flux"))
    cfg = load_config(None, {"slab": str(slab), "data": str(write_tiny_dataset(tmp_path / "data")),
                             "output": str(tmp_path / "run"), "steps": 12, "resolution": 64, "max_sequence_length": 32,
                             "lr": 5e-3, "rank": 8, "save_every": 0, "seed": 0, "nan_patience": 2})
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # the default a user has
    try:
        with caplog.at_level(logging.WARNING, logger="squareq.runtime"):
            result = train(cfg, echo=lambda s: None, progress=False)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert result.steps == 12 and result.skipped_steps == 0
    assert all(torch.isfinite(torch.tensor(result.losses)))
    fallbacks = [r for r in caplog.records if "cuDNN attention" in r.getMessage()]
    assert len(fallbacks) <= 1  # said once, if this GPU needed it at all
