"""The gradient gate redoes a measurement whose gradients a cuDNN attention backward made NaN (simulated on the CPU),
as the trainer redoes such a step; without that way out, the NaN fails the gate."""
import pytest
import torch

import squareq.acceptance.gradients as gradients
from squareq.acceptance.convergence import ConvergenceSettings
from squareq.slab import open_slab
from squareq.sources import open_source
from squareq.train.tiny_dataset import write_tiny_dataset

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def _gate(tiny_slab, tmp_path, monkeypatch, retry: bool):
    real = gradients.denoising_loss
    calls = {"n": 0}

    def poisoned_once(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss  # the slab's first backward

    retries = []
    monkeypatch.setattr(gradients, "denoising_loss", poisoned_once)
    monkeypatch.setattr(gradients.runtime, "retry_without_cudnn",
                        lambda device: retry and not retries and not retries.append(device))
    settings = ConvergenceSettings(data=str(write_tiny_dataset(tmp_path / "data")), lr=5e-3, resolution=64,
                                   max_sequence_length=32, compute="bf16")
    with open_slab(tiny_slab) as slab:
        result = gradients.gradient_gate(open_source("tiny-flux"), slab, "tiny-flux", tmp_path / "work", settings,
                                          0.8, 0.2, steps=1, timesteps=2, device="cpu", echo=lambda *a: None)
    return result, retries, calls["n"]


def test_a_nan_measurement_is_redone_once_cudnn_is_off(tiny_slab, tmp_path, monkeypatch):
    result, retries, losses = _gate(tiny_slab, tmp_path, monkeypatch, retry=True)
    assert len(retries) == 1 and losses == 6  # 2 times x 2 models, and the first time's pair again
    assert result.status == "PASS" and all(torch.isfinite(torch.tensor(r["cosine"])) for r in result.details["per_step"])


def test_without_a_retry_the_nan_fails_the_gate(tiny_slab, tmp_path, monkeypatch):
    result, retries, losses = _gate(tiny_slab, tmp_path, monkeypatch, retry=False)
    assert losses == 4 and result.status == "FAIL"
