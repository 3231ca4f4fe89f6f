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


def test_mask_round_trip():
    mask = torch.rand(6, 19) > 0.5
    assert torch.equal(unpack_mask(pack_mask(mask), 19), mask)


@pytest.mark.parametrize("bits", [0, 1, 9])
def test_bits_out_of_range_are_refused(bits):
    with pytest.raises(ConfigError):
        QuantSpec(bits, 32, False)
