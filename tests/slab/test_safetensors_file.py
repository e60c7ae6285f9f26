"""Deterministic safetensors files: readable by the safetensors library, and equal bytes for equal contents."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from squareq.slab.safetensors_file import safetensors_bytes


def _tensors():
    return {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "f32": torch.randn(7), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4), "bool": torch.tensor([True, False, True]), "i64": torch.arange(5),
        "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3), "f16": torch.randn(2, 2).half(),
        "strided": torch.randn(4, 6).t(),
    }


def test_the_safetensors_library_reads_it_back_exactly(tmp_path):
    tensors, metadata = _tensors(), {"b": "2", "a": "{\"x\": 1}", "format": "pt"}
    path = tmp_path / "t.safetensors"
    path.write_bytes(safetensors_bytes(tensors, metadata))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
        assert sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), name


def test_equal_contents_give_equal_bytes_whatever_the_order():
    tensors = _tensors()
    metadata = {f"k{i}": str(i) for i in range(8)}
    first = safetensors_bytes(tensors, metadata)
    reordered = safetensors_bytes(dict(reversed(list(tensors.items()))), dict(reversed(list(metadata.items()))))
    assert first == reordered
    plain = {k: v.contiguous() for k, v in tensors.items()}
    assert len({save(plain, metadata) for _ in range(8)}) > 1  # negative control: the library's own writer varies


def test_an_unstorable_dtype_is_refused():
    with pytest.raises(ValueError, match="complex"):
        safetensors_bytes({"c": torch.zeros(2, dtype=torch.complex64)})
