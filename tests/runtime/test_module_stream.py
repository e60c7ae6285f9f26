"""stream_module: an in-memory module (a text encoder) runs with its blocks streamed, exactly as it ran whole."""
from __future__ import annotations

import copy

import pytest
import torch

from squareq.runtime import stream_module
from squareq.runtime.module_stream import largest_block_list


def _t5(layers: int = 3):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=120, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                   feed_forward_proj="gated-gelu")
    return T5EncoderModel(cfg).eval()


def _clip(layers: int = 2):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(1)
    cfg = CLIPTextConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, max_position_embeddings=16, projection_dim=32, bos_token_id=0,
                         eos_token_id=1)
    return CLIPTextModel(cfg).eval()


@pytest.mark.parametrize("build, layers", [(_t5, 3), (_clip, 2)])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_streamed_encoder_equals_the_whole_one(build, layers, prefetch):
    whole = build()
    streamed = stream_module(copy.deepcopy(whole), "cpu", prefetch=prefetch)
    assert len(whole.get_submodule(largest_block_list(whole))) == layers  # the layer list, wherever the class keeps it
    ids = torch.randint(0, 120, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = whole(ids).last_hidden_state
        for _ in range(2):
            assert torch.equal(streamed(ids).last_hidden_state, expected)
    # grad mode on but nothing to train (how diffusers' encode_prompt may call it): still a plain streamed forward
    assert torch.equal(streamed(ids).last_hidden_state, expected)


def test_block_tensors_move_into_the_blobs_instead_of_doubling(monkeypatch):
    from squareq.runtime.host import staging as host

    model = _t5()
    originals = {n: p.data_ptr() for n, p in model.encoder.block.named_parameters()}
    arenas = []
    real = host.PinnedArena.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        arenas.append(self)

    monkeypatch.setattr(host.PinnedArena, "__init__", spy)
    stream_module(model, "cpu", prefetch=1)
    (arena,) = arenas
    start, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.host_bytes
    for name, p in model.encoder.block.named_parameters():
        assert p.data_ptr() != originals[name]
        assert start <= p.data_ptr() < end, f"{name} is not in the blob arena"
    assert arena.host_bytes < 1.02 * sum(p.numel() * p.element_size() for p in model.encoder.block.parameters()) + \
        256 * sum(1 for _ in model.encoder.block.parameters())


def test_release_frees_the_blobs_now():
    from squareq.runtime import release_module
    from squareq.runtime.module_stream import _HANDLE

    model = stream_module(_t5(), "cpu", prefetch=2)
    streamer, blocks = model.__dict__[_HANDLE]
    memory = streamer.host.memory
    release_module(model)
    assert not memory._finalizer.alive and streamer.closed
    assert all(p is None for b in blocks for p in b._parameters.values())
    assert "forward" not in blocks[0].__dict__
    release_module(model)  # a second call does nothing


@pytest.mark.parametrize("build", [_t5, _clip])
def test_ring_streams_the_module_s_own_tensors_with_few_blocks_pinned(build):
    """host="ring": the blocks are packed on demand from the module's own tensors (left where they are: a weights
    file's pages) into a few page-locked buffers, cast to the run dtype as they are copied; the output is the whole
    module's in that dtype."""
    from squareq.runtime.host.pinned import held_bytes
    from squareq.runtime.module_stream import RING_STAGES

    whole = build(layers=8)
    model = copy.deepcopy(whole).to(torch.float64)  # the "file" dtype: cast block by block, never all at once
    blocks = model.get_submodule(largest_block_list(model))
    originals = {n: p.data_ptr() for n, p in blocks.named_parameters()}
    largest = max(sum(p.numel() for p in b.parameters()) * 4 for b in blocks)
    before = held_bytes()
    streamed = stream_module(model, "cpu", prefetch=1, host="ring", dtype=torch.float32)
    pinned = held_bytes() - before
    assert pinned <= RING_STAGES * (largest + 256 * 64)
    assert pinned < 0.5 * sum(p.numel() * 4 for p in blocks.parameters())
    seen = []
    blocks[0].register_forward_pre_hook(lambda *_: seen.append(held_bytes() - before))
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(streamed(ids).last_hidden_state, whole(ids).last_hidden_state, atol=1e-6)
    assert seen and max(seen) == pinned
    for name, p in blocks[:4].named_parameters():  # blocks out of the slots are back on their own host tensors
        assert p.data_ptr() == originals[name] and p.dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.parametrize("host", ["pinned", "ring"])
def test_on_the_gpu_a_streamed_encoder_gives_the_whole_one_s_output(host):
    """On CUDA, through the copy stream and its events: the blocks pinned whole, or packed from the module's own host
    tensors into the ring's page-locked buffers while earlier blocks compute; the output is the whole encoder's on the
    GPU, bit for bit, and the ring holds RING_STAGES blocks."""
    from squareq.runtime.host.pinned import held_bytes
    from squareq.runtime.module_stream import RING_STAGES, blob_bytes

    whole = _t5(layers=8)
    ids = torch.randint(0, 120, (4, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = copy.deepcopy(whole).cuda()(ids.cuda()).last_hidden_state
    before = held_bytes()
    streamed = stream_module(whole, "cuda", prefetch=2, host=host)
    blocks = whole.get_submodule(largest_block_list(whole))
    sizes = [blob_bytes(b) for b in blocks]
    assert held_bytes() - before == (RING_STAGES * max(sizes) if host == "ring" else sum(sizes))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(streamed(ids.cuda()).last_hidden_state, expected)
