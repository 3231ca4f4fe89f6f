import pytest
import torch

from slmedge.compress.quant import (QuantSpec, dequantize_codes, pack_codes, pack_mask, quantize_groups, unpack_codes,
                                    unpack_mask)
from slmedge.errors import ConfigError


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 48, -1])
def test_codes_dequantize_exactly_to_the_weights(bits, symmetric, group_size):
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(bits))
    spec = QuantSpec(bits, group_size, symmetric)
    deq, codes, scales, zeros = quantize_groups(w, spec)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= spec.maxq
    assert scales.dtype == torch.float16
    assert scales.shape == (24, spec.num_groups(80))
    assert torch.equal(dequantize_codes(codes, scales, zeros, spec), deq)
    # Rounding error is at most half a step, except where values are clipped at the range ends.
    step = dequantize_codes(torch.ones_like(codes), scales, zeros, spec) - dequantize_codes(torch.zeros_like(codes), scales, zeros, spec)
    assert ((deq - w).abs() <= step.abs() * 0.5 + 1e-6).float().mean() > 0.95


def test_ragged_last_group_has_its_own_parameters():
    w = torch.randn(4, 80)
    w[:, 64:] *= 100  # the last, 16-wide group of g=32 has a very different range
    spec = QuantSpec(4, 32, False)
    deq, codes, scales, zeros = quantize_groups(w, spec)
    assert scales.shape == (4, 3)
    assert (scales[:, 2].float().abs() > 10 * scales[:, 1].float().abs()).all()
    assert (deq[:, :64] - w[:, :64]).abs().max() < 0.5


def test_symmetric_keeps_the_extreme_value_and_zero_point():
    w = torch.tensor([[0.1, -0.7, 0.3, 0.2]])
    deq, codes, scales, zeros = quantize_groups(w, QuantSpec(4, -1, True))
    assert int(zeros[0, 0]) == 8
    assert abs(float(deq[0, 1]) + 0.7) < 1e-3  # -0.7 is exact up to the fp16 scale


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("cols", [7, 8, 33])
def test_pack_unpack_round_trip(bits, cols):
    codes = torch.randint(0, 2**bits, (5, cols), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, cols), codes)


def test_four_bit_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols,width", [(96, 32), (96, 96), (80, 32), (7, 7)])
def test_grouped_dequantize_is_the_per_element_formula(bits, cols, width):
    # Whole groups are broadcast, a ragged last group goes the expanded way: both must give
    # dequantize(q, s, z) = s * (q - z) of the expanded parameters, to the bit.
    from slmedge.models.codes import dequantize, dequantize_grouped, expand_columns
    g = torch.Generator().manual_seed(bits * cols)
    n_groups = -(-cols // width)
    codes = torch.randint(0, 2**bits, (6, cols), dtype=torch.uint8, generator=g)
    scales = (torch.rand(6, n_groups, generator=g) * 0.2 - 0.1).half()
    zeros = torch.randint(0, 2**bits, (6, n_groups), dtype=torch.uint8, generator=g)
    expected = dequantize(codes.float(), expand_columns(scales.float(), width, cols), expand_columns(zeros.float(), width, cols))
    got = dequantize_grouped(codes, scales, zeros, width)
    assert got.shape == (6, cols) and torch.equal(got.view(torch.int32), expected.view(torch.int32))
    as_float = codes.float()
    dequantize_grouped(as_float, scales, zeros, width)
    assert torch.equal(as_float, codes.float())  # the caller's codes are not computed in


@pytest.mark.parametrize("bits", [2, 4])
def test_packed_bytes_are_the_codes_bit_fields(bits):
    # Each byte holds k codes of 8/k bits, the first code in the low bits (odd widths padded with 0).
    codes = torch.randint(0, 2**bits, (3, 11), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    k, width = 8 // bits, bits
    packed = pack_codes(codes, bits)
    padded = torch.nn.functional.pad(codes.int(), (0, (-11) % k)).view(3, -1, k)
    expected = sum(padded[:, :, j] << (width * j) for j in range(k))
    assert packed.dtype == torch.uint8 and packed.tolist() == expected.tolist()


def test_mask_round_trip():
    mask = torch.rand(6, 19) > 0.5
    assert torch.equal(unpack_mask(pack_mask(mask), 19), mask)


@pytest.mark.parametrize("bits", [0, 1, 9])
def test_bits_out_of_range_are_refused(bits):
    with pytest.raises(ConfigError):
        QuantSpec(bits, 32, False)
