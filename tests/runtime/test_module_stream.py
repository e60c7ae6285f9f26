"""stream_module: an in-memory module (a text encoder) runs with its blocks streamed, exactly as it ran whole."""
from __future__ import annotations

import copy

import pytest
import torch

from squareq.runtime import stream_module
from squareq.runtime.module_stream import largest_block_list


def _t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=120, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,
                   feed_forward_proj="gated-gelu")
    return T5EncoderModel(cfg).eval()


def _clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(1)
    cfg = CLIPTextConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
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
