"""The fused FLUX attention processor (runtime/flux_attention.py) gives the stock processor's output, and steps
aside wherever it could not."""
import pytest
import torch

from squareq.models.tiny import build_tiny_flux, tiny_flux_inputs
from squareq.runtime import flux_attention
from squareq.runtime.flux_attention import FusedFluxAttnProcessor, install_fused_attention


def _bf16_model():
    return build_tiny_flux(seed=3, dtype=torch.bfloat16)


def _inputs():
    return tiny_flux_inputs(side=4, text_tokens=8, seed=4, dtype=torch.bfloat16)


def test_install_takes_every_stock_flux_attention_once():
    model = _bf16_model()
    assert install_fused_attention(model) == 4  # 2 double-stream + 2 single-stream blocks
    assert all(isinstance(b.attn.processor, FusedFluxAttnProcessor)
               for b in [*model.transformer_blocks, *model.single_transformer_blocks])
    assert install_fused_attention(model) == 0  # no stock processor left
    assert install_fused_attention(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0


def test_fused_forward_equals_the_stock_forward():
    stock, fused = _bf16_model(), _bf16_model()
    install_fused_attention(fused)
    with torch.no_grad():
        want = stock(**_inputs(), return_dict=False)[0]
        got = fused(**_inputs(), return_dict=False)[0]
    assert torch.equal(got, want)


def test_the_fused_path_runs_only_without_autograd_in_eval_mode(monkeypatch):
    """Negative control: with the fused op broken, only the eval, no-grad, bf16 forward may notice."""
    def broken(*args, **kwargs):
        raise AssertionError("fused path taken")

    monkeypatch.setattr(flux_attention, "qk_norm_rope_into", broken)
    model = _bf16_model()
    install_fused_attention(model)
    model(**_inputs(), return_dict=False)  # autograd on: stock
    with torch.no_grad():
        model.train()
        model(**_inputs(), return_dict=False)  # training mode: stock
        model.eval()
        model.float()(**tiny_flux_inputs(side=4, text_tokens=8, seed=4), return_dict=False)  # float32: stock
        with pytest.raises(AssertionError, match="fused path taken"):
            model.bfloat16()(**_inputs(), return_dict=False)
