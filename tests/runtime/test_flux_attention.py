"""The fused FLUX attention processor (runtime/flux_attention.py) gives the stock processor's output, and steps
aside wherever it could not."""
import os

import pytest
import torch

from squareq.models.tiny import build_tiny_flux, tiny_flux_inputs
from squareq.runtime import flux_attention
from squareq.runtime.flux_attention import FusedFluxAttnProcessor, install_fused_attention

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _bf16_model():
    return build_tiny_flux(seed=3, dtype=torch.bfloat16)


def _inputs(batch: int = 1):
    return tiny_flux_inputs(batch=batch, side=4, text_tokens=8, seed=4, dtype=torch.bfloat16)


def _broken(*args, **kwargs):
    raise AssertionError("fused path taken")


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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel in the Triton interpreter")
def test_the_kernel_through_the_processor_gives_the_stock_forward(monkeypatch):
    """The Triton kernel itself (interpreted; the CPU otherwise takes the definition) writing the text and image
    parts of two samples into the joint query and key."""
    from squareq.kernels import qk_rope

    monkeypatch.setattr(qk_rope, "backend_for", lambda device: "triton")
    fits, original = [], qk_rope.kernel_fits

    def recording(*args):
        fits.append(original(*args))
        return fits[-1]

    monkeypatch.setattr(qk_rope, "kernel_fits", recording)
    stock, fused = _bf16_model(), _bf16_model()
    install_fused_attention(fused)
    with torch.no_grad():
        want = stock(**_inputs(batch=2), return_dict=False)[0]
        got = fused(**_inputs(batch=2), return_dict=False)[0]
    assert len(fits) == 12 and all(fits)  # 2 double blocks x 2 parts x (query, key) + 2 single blocks x 2
    assert torch.equal(got, want)


def test_calls_the_kernel_cannot_serve_go_to_the_stock_processor(monkeypatch):
    """An attention mask, fused projections or a rotary table of another length: the stock processor's business."""
    monkeypatch.setattr(flux_attention, "qk_norm_rope_into", _broken)
    model = _bf16_model()
    install_fused_attention(model)
    attn = model.transformer_blocks[0].attn
    inputs = _inputs()
    hidden = torch.randn(1, 16, 64, dtype=torch.bfloat16)
    text = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    cos, sin = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
    with torch.no_grad():
        with pytest.raises(AssertionError, match="fused path taken"):  # the control: this call is the fused one's
            attn(hidden, text, image_rotary_emb=(cos, sin))
        attn(hidden, text, attention_mask=torch.ones(1, 1, 24, 24, dtype=torch.bool), image_rotary_emb=(cos, sin))
        with pytest.raises(RuntimeError):  # 20 angles for 24 tokens: the stock processor refuses, as it would
            attn(hidden, text, image_rotary_emb=(cos[:20], sin[:20]))
        attn.fused_projections = True
        attn.to_qkv, attn.to_added_qkv = _fused_linears(attn)
        attn(hidden, text, image_rotary_emb=(cos, sin))


def _fused_linears(attn):
    def join(*layers):
        out = torch.nn.Linear(layers[0].in_features, sum(x.out_features for x in layers), dtype=torch.bfloat16)
        out.weight.data = torch.cat([x.weight.data for x in layers])
        out.bias.data = torch.cat([x.bias.data for x in layers])
        return out

    return join(attn.to_q, attn.to_k, attn.to_v), join(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)


def test_the_fused_path_runs_only_without_autograd_in_eval_mode(monkeypatch):
    """Negative control: with the fused op broken, only the eval, no-grad, bf16 forward may notice."""
    monkeypatch.setattr(flux_attention, "qk_norm_rope_into", _broken)
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


def test_the_fused_path_steps_aside_in_a_streamed_training_pass(monkeypatch):
    """A streamed block's checkpointed forward runs without autograd, in whatever mode the model is left: the
    runtime marks it, and the processor keeps to the stock ops its recompute will run."""
    from squareq.runtime.blocks import training_pass

    monkeypatch.setattr(flux_attention, "qk_norm_rope_into", _broken)
    model = _bf16_model()
    install_fused_attention(model)
    with torch.no_grad(), training_pass(True):
        model(**_inputs(), return_dict=False)
    with torch.no_grad(), training_pass(False), pytest.raises(AssertionError, match="fused path taken"):
        model(**_inputs(), return_dict=False)


def test_a_streamed_training_forward_is_marked_as_one(tiny_slab):
    from squareq import runtime
    from squareq.runtime.blocks import in_training_pass

    # left in eval mode, as load returns it
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    runtime.add_lora(model, rank=2)
    model.enable_gradient_checkpointing()
    seen = []
    model.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda module, args: seen.append((in_training_pass(), torch.is_grad_enabled())))
    inputs = tiny_flux_inputs(side=4, text_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            model(**inputs, return_dict=False)
        for _ in range(2):  # the first step's forward learns which outputs are constant, with autograd on
            loss = model(**inputs, return_dict=False)[0].float().pow(2).mean()
            loss.backward()
    assert seen[0] == (False, False)  # inference
    # the training steps' forwards and recomputes, the second step's checkpointed forward without autograd
    assert all(marked for marked, _ in seen[1:]) and (True, False) in seen[1:]

