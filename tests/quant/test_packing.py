import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from squareq.quant import pack, packed_row_bytes, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 6, 8]), n=st.integers(1, 5), k=st.integers(1, 70), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int32)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (n, packed_row_bytes(bits, k))
    assert torch.equal(unpack(packed, bits, k), q)


def test_packed_sizes():
    assert packed_row_bytes(4, 5) == 3  # two per byte, padded
    assert packed_row_bytes(6, 5) == 6  # four per three bytes, padded to 8 values
    assert packed_row_bytes(6, 8) == 6
    assert packed_row_bytes(8, 5) == 5


def test_documented_bit_layout():
    # W4: column 2j in the low nibble, 2j+1 in the high nibble, stored as q + 8.
    assert pack(torch.tensor([[-8, 7]]), 4).tolist() == [[0 | (15 << 4)]]
    # W6: 24-bit little-endian word u0 | u1<<6 | u2<<12 | u3<<18 with u = q + 32.
    word = 1 | (2 << 6) | (3 << 12) | (63 << 18)
    assert pack(torch.tensor([[1 - 32, 2 - 32, 3 - 32, 31]]), 6).tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]
    # W8: two's complement bytes.
    assert pack(torch.tensor([[-1, 5]]), 8).tolist() == [[255, 5]]


def test_out_of_range_codes_are_refused():
    with pytest.raises(ValueError):
        pack(torch.tensor([[8]]), 4)
    with pytest.raises(ValueError):
        unpack(torch.zeros(2, 3, dtype=torch.uint8), 6, 5)
