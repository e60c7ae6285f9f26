"""The trainer's GPU-only paths: 8-bit AdamW (bitsandbytes) and the streamed T5 encoder that fills the cache."""
import pytest
import torch

from squareq.sources import encoders

from .test_loop import unbroken_and_resumed, workspace  # noqa: F401  (the module-scoped tiny slab + data fixture)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def math_attention():
    """Deterministic attention, so an interrupted and an uninterrupted run can be compared; cuDNN attention off
    (its backward fails on the device image)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def test_streamed_t5_gives_the_cache_entries_of_the_whole_t5(tmp_path):
    from squareq.sources.encoder_placement import EncoderRun

    from ..models.tiny_folders import write_pipeline

    folder = str(write_pipeline("tiny-flux", tmp_path / "flux", text_layers=4))  # more blocks than device slots
    texts = ["a red square", "two blue circles on a grey floor", ""]
    cuda = torch.device("cuda")
    with encoders.open_encoders(folder, cuda, "flux", run=EncoderRun(tokens=16, pixels=64 * 64)) as enc:
        assert enc.placement.streamed == ()  # the free memory of the device holds it whole
        whole = enc.encode_prompts(texts, 16)
        need = enc.placement.expected
    with encoders.open_encoders(folder, cuda, "flux", run=EncoderRun(need - 1, 16, 64 * 64)) as enc:
        assert enc.placement.streamed == ("text_encoder_2",)
        assert next(enc.pipeline.text_encoder_2.encoder.block.parameters()).is_pinned()
        streamed = enc.encode_prompts(texts, 16)
    for a, b in zip(whole, streamed, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_adamw8bit_trains_and_resumes(workspace, tmp_path):  # noqa: F811
    pytest.importorskip("bitsandbytes")
    a, b = unbroken_and_resumed(workspace, tmp_path, 3, optimizer="adamw8bit", steps=6, save_every=3, lr=1e-2)
    assert all(torch.isfinite(t).all() for t in a.values())
    moved = 0
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
        moved += int("lora_B" in name and bool(a[name].abs().sum() > 0))
    assert moved > 0, "8-bit AdamW did not move lora_B away from its zero init"
