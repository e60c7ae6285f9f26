"""One LoRA training step, the same for the streamed and the resident model, on any device."""
from __future__ import annotations

import contextlib

import torch

from squareq import runtime
from squareq.models import tiny_flux_inputs


def inputs(device, batch: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    return {k: v.to(device) for k, v in tiny_flux_inputs(batch=batch, dtype=dtype, seed=seed).items()}


def with_lora(model, seed: int = 0, targets=runtime.DEFAULT_TARGETS) -> list[torch.nn.Parameter]:
    """LoRA on ``targets``, with B nudged off zero so every factor gets a gradient."""
    params = runtime.add_lora(model, rank=4, seed=seed, targets=targets)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in params:
            p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device))
    return params


def step(model, batch: dict, checkpointing: bool, autocast: bool | torch.dtype = False):
    """Forward, MSE-to-zero loss, backward; the output and every LoRA gradient (cloned), grads cleared. ``autocast``:
    True (bf16) or the dtype to autocast to."""
    if checkpointing:
        model.enable_gradient_checkpointing()
    else:
        model.disable_gradient_checkpointing()
    device_type = next(iter(batch.values())).device.type
    dtype = torch.bfloat16 if autocast is True else autocast
    amp = torch.autocast(device_type, dtype=dtype) if autocast else contextlib.nullcontext()
    with amp:
        out = model(**batch, return_dict=False)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    params = runtime.lora_parameters(model)
    grads = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return out.detach(), grads


def assert_same(a, b) -> None:
    out_a, grads_a = a
    out_b, grads_b = b
    assert torch.equal(out_a, out_b), "outputs differ"
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"LoRA gradient of {name} differs"


def train_steps(model, device, steps: int, autocast: bool | torch.dtype = False, dtype: torch.dtype = torch.bfloat16,
                before_step=None):
    """``steps`` LoRA training steps on seeded batches (LoRA from :func:`with_lora`, an SGD step between them): each
    step's output and LoRA gradients, and the runtime's CUDA-graph counts of each step (None without graphs).
    ``before_step(model, i)``, if given, runs before step ``i``."""
    params = with_lora(model)
    opt = torch.optim.SGD(params, lr=0.5)
    graphs = runtime.runtime_of(model).graphs
    results, counts = [], []
    for i in range(steps):
        if before_step is not None:
            before_step(model, i)
        out, grads = step(model, inputs(device, seed=i, dtype=dtype), checkpointing=True, autocast=autocast)
        for name, p in runtime.lora_parameters(model).items():
            p.grad = grads[name].clone()
        opt.step()
        results.append((out, grads))
        counts.append(graphs.reset_stats() if graphs is not None else None)
    return results, counts
