"""Deterministic safetensors files: readable by the safetensors library, and equal bytes for equal contents."""
import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from squareq.slab.digest import DigestError, file_sha256, hashed_safetensors, read_hashed
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


def test_a_hashed_cache_entry_comes_from_the_same_writer_and_reads_back(tmp_path):
    """slab/digest.py writes cache entries through safetensors_bytes: equal tensors give equal bytes, and
    read_hashed gives them back with their hash checked."""
    tensors = _tensors()
    first = hashed_safetensors(tensors)
    assert first == hashed_safetensors(dict(reversed(list(tensors.items()))))
    path = tmp_path / "entry.safetensors"
    path.write_bytes(first)
    back = read_hashed(path)
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[name], t) for name, t in tensors.items())
    damaged = bytearray(first)
    damaged[-1] ^= 1  # the last tensor's last byte
    path.write_bytes(bytes(damaged))
    with pytest.raises(DigestError, match="does not match its hash"):
        read_hashed(path)


def test_file_sha256_is_the_sha256_of_the_bytes(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 5000  # more than one read of file_digest's buffer
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    path.write_bytes(data[:-1] + b"\0")
    assert file_sha256(path) != hashlib.sha256(data).hexdigest()
