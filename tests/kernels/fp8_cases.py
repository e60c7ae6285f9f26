"""Inputs the FP8 kernels must turn into the reference's bits exactly, on the interpreter and on CUDA alike."""
import torch

from squareq.quant import QuantSpec, quantize

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def edge_rows() -> torch.Tensor:
    """bf16 rows with every E4M3 value, the midpoints between neighbours (ties), values one bf16 step off them,
    subnormals, and a row of zeros; row 0's largest magnitude is 448 (scale 1), so values land where chosen."""
    values = E4M3[~E4M3.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = mids.to(torch.bfloat16).float() * (1 + 2 ** -7), mids.to(torch.bfloat16).float() * (1 - 2 ** -7)
    row = torch.cat([values, mids, up.clamp(-448, 448), down]).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(3, row.numel(), generator=g) * torch.logspace(-8, 3, row.numel())).to(torch.bfloat16)
    return torch.cat([row[None], torch.zeros(1, row.numel(), dtype=torch.bfloat16), wide])


def int_weights():
    """Quantized int weights of every width, with and without zero points and smoothing, on awkward shapes."""
    g = torch.Generator().manual_seed(1)
    for bits in (4, 6, 8):
        for symmetric in (False, True):
            for n, k, group in ((16, 256, 64), (5, 200, 64), (32, 96, 32)):
                smooth = symmetric and bits != 8
                spec = QuantSpec(bits=bits, group_size=group, symmetric=symmetric, smooth=smooth)
                s = torch.rand(k, generator=g) + 0.5 if smooth else None
                yield f"W{bits} {n}x{k} g{group} sym={symmetric}", quantize(torch.randn(n, k, generator=g), spec, s)
    for bits, group in ((4, 64), (6, 32), (8, 128)):  # rotated layers: the butterfly on the tile, before E4M3
        spec = QuantSpec(bits=bits, group_size=group, symmetric=bits == 8, smooth=bits == 4, rotate=True)
        s = torch.rand(256, generator=g) + 0.5 if spec.smooth else None
        yield f"W{bits} 16x256 g{group} rotated", quantize(torch.randn(16, 256, generator=g), spec, s)
