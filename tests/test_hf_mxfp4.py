"""MXFP4 (compressed-tensors' mxfp4-pack-quantized): decode against values worked out by hand, then decode and encode
bit for bit against compressed-tensors itself, and malformed tensors refused with a message naming what is wrong."""

import math
import re

import pytest
import torch

from k3train.hf import HFFormatError
from k3train.hf.mxfp4 import MXFP4_FORMAT, decode_mxfp4, encode_mxfp4

# The 16 E2M1 codes, written out: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns, so -0.0 differs from 0.0 and equality is bit for bit."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_format_name():
    assert MXFP4_FORMAT == "mxfp4-pack-quantized"


def test_decode_every_code_in_both_nibbles():
    # byte j holds code j in its low nibble (column 2j) and code 15 - j in its high nibble (column 2j + 1)
    packed = torch.tensor([[j | ((15 - j) << 4) for j in range(16)]], dtype=torch.uint8)
    scale = torch.tensor([[127]], dtype=torch.uint8)  # 2 ** 0
    expected = []
    for j in range(16):
        expected += [CODE_VALUES[j], CODE_VALUES[15 - j]]
    w = decode_mxfp4(packed, scale, dtype=torch.float32)
    assert w.shape == (1, 32)
    assert torch.equal(bits(w), bits(torch.tensor([expected])))  # also -0.0 for code 8
    assert torch.equal(bits(decode_mxfp4(packed, scale)), bits(torch.tensor([expected], dtype=torch.bfloat16)))


def test_decode_low_nibble_is_the_even_column():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x72  # low 2 -> 1.0 at column 0, high 7 -> 6.0 at column 1
    packed[0, 1] = 0x0F  # low 15 -> -6.0 at column 2, high 0 -> 0.0 at column 3
    w = decode_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8), dtype=torch.float32)
    assert w[0, :4].tolist() == [1.0, 6.0, -6.0, 0.0]
    assert not w[0, 4:].any()


@pytest.mark.parametrize("exponent", [0, 1, 100, 125, 127, 128, 131, 200, 254])
def test_decode_scales_by_two_to_the_exponent_less_127(exponent):
    packed = torch.tensor([[j | ((15 - j) << 4) for j in range(16)]], dtype=torch.uint8)
    expected = []
    for j in range(16):
        expected += [CODE_VALUES[j], CODE_VALUES[15 - j]]
    expected = [v * math.ldexp(1.0, exponent - 127) for v in expected]  # exact in float64 and in float32
    w = decode_mxfp4(packed, torch.tensor([[exponent]], dtype=torch.uint8), dtype=torch.float32)
    assert torch.equal(bits(w), bits(torch.tensor([expected], dtype=torch.float64).float()))


def test_decode_each_group_of_32_columns_takes_its_own_scale():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every element is code 2, 1.0
    scale = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8)
    w = decode_mxfp4(packed, scale, dtype=torch.float32)
    assert w.shape == (2, 64)
    assert (w[0, :32] == 1.0).all() and (w[0, 32:] == 2.0).all()
    assert (w[1, :32] == 0.5).all() and (w[1, 32:] == 8.0).all()


def test_decode_exponent_255_is_inf_as_in_compressed_tensors():
    packed = torch.tensor([[0x12] + [0] * 15], dtype=torch.uint8)
    w = decode_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8), dtype=torch.float32)
    assert w[0, 0] == math.inf and w[0, 1] == math.inf and w[0, 2:].isnan().all()  # 0 * inf


@pytest.mark.parametrize(
    "packed_shape, scale_shape, dtypes, message",
    [
        (
            (8, 64),
            (8, 3),
            None,
            "weight_scale [8, 3] does not match weight_packed [8, 64]: expected [8, 4] (one scale per 32 columns)",
        ),
        ((8, 64), (4, 4), None, "weight_scale [4, 4] does not match weight_packed [8, 64]: expected [8, 4]"),
        ((8, 8), (8, 1), None, "weight_packed [8, 8] holds 16 columns, not a multiple of 32"),
        ((8, 64), (8, 4), (torch.int8, torch.uint8), "weight_packed is torch.int8, expected torch.uint8"),
        ((8, 64), (8, 4), (torch.uint8, torch.float32), "weight_scale is torch.float32, expected torch.uint8"),
        ((512,), (8, 4), None, "weight_packed [512] is 1-D, expected 2-D"),
        ((8, 64), (2, 4, 4), None, "weight_scale [2, 4, 4] is 3-D, expected 2-D"),
    ],
)
def test_decode_refuses_malformed_tensors(packed_shape, scale_shape, dtypes, message):
    packed_dtype, scale_dtype = dtypes or (torch.uint8, torch.uint8)
    packed = torch.zeros(packed_shape, dtype=packed_dtype)
    scale = torch.zeros(scale_shape, dtype=scale_dtype)
    with pytest.raises(HFFormatError, match=re.escape(message)):
        decode_mxfp4(packed, scale)


def test_encode_refuses_what_mxfp4_cannot_hold():
    with pytest.raises(ValueError, match=re.escape("weight [4, 48] has 48 columns, not a multiple of 32")):
        encode_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=re.escape("weight [2, 4, 32] is 3-D, expected 2-D [out, in]")):
        encode_mxfp4(torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match="weight is torch.int32, expected a floating-point tensor"):
        encode_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    w = torch.zeros(4, 32)
    w[1, 3] = math.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        encode_mxfp4(w)


def test_encode_rounds_ties_to_the_even_code_and_clamps_to_six():
    # amax 6.5 = 1.625 * 4 rounds to the power of two 4: exponent 127 + 2 - 2, a scale of 1, so the ratios are these
    row = [6.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, -0.25, -0.1, 0.0, -0.0, 0.26, -2.9, -6.9]
    expected = [7, 0, 2, 2, 4, 4, 6, 6, 7, 0 | 8, 0 | 8, 0, 0, 1, 5 | 8, 7 | 8]  # negative zeros keep the sign bit
    w = torch.tensor([row + [0.0] * 16])
    packed, scale = encode_mxfp4(w)
    assert scale.tolist() == [[127]]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten().tolist()
    assert codes[:16] == expected


def test_encode_scale_exponent_rule():
    # amax -> round_to_power_2 (significand >= 1.75 carries up) -> 127 + log2 - 2, clamped to a byte
    cases = {1.0: 125, 1.7: 125, 1.75: 126, 3.0: 126, 0.02: 127 - 6 - 2, 0.0: 0, 2.0**-130: 0, 2.0**-120: 5}
    w = torch.zeros(len(cases), 32)
    w[:, 5] = torch.tensor(list(cases))
    _, scale = encode_mxfp4(w)
    assert scale[:, 0].tolist() == list(cases.values())


def test_encode_decode_error_is_within_half_an_e2m1_step():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    packed, scale = encode_mxfp4(w)
    back = decode_mxfp4(packed, scale, dtype=torch.float32)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)  # scale * 1 is E2M1's widest gap / 2
    assert ((back - w).abs() <= step).all()


# --- against compressed-tensors itself -------------------------------------------------------------------------------


def _compressed_tensors():
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed: pip install -e '.[test]'")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams

    return (
        ct,
        MXFP4PackedCompressor,
        QuantizationScheme(targets=["Linear"], **MXFP4A16),
        calculate_qparams,
        fake_quantize,
    )


def test_decode_matches_compressed_tensors_bit_for_bit():
    _, compressor, scheme, _, _ = _compressed_tensors()
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (96, 128), dtype=torch.uint8, generator=g)
    packed[0, :] = torch.arange(128, dtype=torch.uint8)  # every byte value at least once
    packed[1, :] = torch.arange(128, 256, dtype=torch.uint8)
    scale = torch.randint(0, 255, (96, 8), dtype=torch.uint8, generator=g)  # 0..254: every finite E8M0 scale
    scale[2, :] = torch.tensor([0, 1, 2, 126, 127, 128, 253, 254], dtype=torch.uint8)
    theirs = compressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    ours = decode_mxfp4(packed, scale)
    assert theirs.dtype == ours.dtype == torch.bfloat16
    assert torch.equal(bits(ours), bits(theirs))


def _their_quantization(w, scheme, calculate_qparams):
    """What llm-compressor's default weight observer (memoryless min-max) feeds compressed-tensors: per-group min and
    max, turned into a float scale by calculate_qparams."""
    groups = w.unflatten(-1, (-1, 32))
    return calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_and_round_trip_match_compressed_tensors_bit_for_bit(dtype):
    _, compressor, scheme, calculate_qparams, fake_quantize = _compressed_tensors()
    torch.manual_seed(0)
    w = torch.randn(128, 512) * 0.02
    w[0, :32] = 0.0  # an all-zero group: exponent 0
    w[1, :32] *= 1e-37  # a group near float32's subnormals
    w[2, :32] = torch.tensor([6.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # ties, at a scale of 1
    w[3, :32] *= 1e4
    w[4, 32:64] = torch.linspace(-1.75, 1.75, 32)  # amax 1.75 carries into the next power of two
    w[5, :3] = torch.tensor([-0.0, -1e-9, 1e-9])  # signed zeros: -0.0 encodes as code 0, -1e-9 as code 8
    w = w.to(dtype)
    scale_float, zero_point = _their_quantization(w, scheme, calculate_qparams)
    theirs = compressor.compress({"weight": w, "weight_scale": scale_float}, scheme)
    packed, scale = encode_mxfp4(w)
    assert torch.equal(scale, theirs["weight_scale"])
    assert torch.equal(packed, theirs["weight_packed"])
    # and the round trip: our decode of our encoding is their dequantised weight, and their fake quantisation
    decompressed = compressor.decompress(theirs, scheme)["weight"]
    assert torch.equal(bits(decode_mxfp4(packed, scale)), bits(decompressed))
    fake = fake_quantize(w, scale_float, zero_point, scheme.weights)
    assert fake.dtype == dtype
    assert torch.equal(bits(decode_mxfp4(packed, scale, dtype=dtype)), bits(fake))
