"""compressed-tensors' `mxfp4-pack-quantized` weights, the format the released Kimi K3 stores its routed experts in.

A weight W [out, in] (in % 32 == 0) is stored as two tensors:

    <name>.weight_packed  uint8 [out, in/2]   two E2M1 codes a byte: the even column in the low nibble
    <name>.weight_scale   uint8 [out, in/32]  one E8M0 scale per 32 columns of a row: the biased exponent byte

    W[r, c] = e2m1(nibble(r, c)) * 2 ** (weight_scale[r, c // 32] - 127)

where an E2M1 code n is (-1 if n & 8 else 1) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][n & 7] (the OCP Microscaling formats
spec, https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf).

`decode_mxfp4` is what loading such a checkpoint needs; `encode_mxfp4` exists so tests can make checkpoints in the
released layout. Both were checked bit for bit against compressed-tensors 0.20.1 (tests/test_hf_mxfp4.py):
    https://github.com/vllm-project/compressed-tensors/blob/main/src/compressed_tensors/compressors/mxfp4/base.py
    https://github.com/vllm-project/compressed-tensors/blob/main/src/compressed_tensors/compressors/mx_utils.py
    https://github.com/vllm-project/compressed-tensors/blob/main/src/compressed_tensors/compressors/nvfp4/helpers.py
    https://github.com/vllm-project/compressed-tensors/blob/main/src/compressed_tensors/quantization/utils/mxfp_utils.py
    https://github.com/vllm-project/compressed-tensors/blob/main/src/compressed_tensors/quantization/utils/fp4_utils.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3train.hf import HFFormatError

MXFP4_FORMAT = "mxfp4-pack-quantized"
GROUP_SIZE = 32  # columns that share one E8M0 scale

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code n & 7
_E8M0_BIAS = 127
# floor(log2(6)), 6 being E2M1's largest value: a group's scale is its (rounded) amax's power of two over 2 ** 2, so
# the amax lands in [4, 8) and is clamped to 6 at worst (mxfp_utils._MX_ELEM_OFFSET).
_E2M1_EXP_OFFSET = 2


def _byte_table() -> torch.Tensor:
    """[256, 2] float32: the (low nibble, high nibble) values of every byte, so decoding is one lookup per byte."""
    codes = torch.arange(256)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)

    def value(nibble: torch.Tensor) -> torch.Tensor:
        return torch.where(nibble & 8 != 0, -1.0, 1.0) * values[nibble & 7]

    return torch.stack([value(codes & 0x0F), value(codes >> 4)], dim=1)


_BYTE_VALUES = _byte_table()
# 2 ** (e - 127) for every exponent byte, exactly (ldexp in float64, then float32): e = 0 is the subnormal 2 ** -127,
# e = 255 overflows to inf. The MX spec reserves 255 for NaN; compressed-tensors computes 2 ** 128 = inf, and so do we.
_E8M0_VALUES = torch.tensor([math.ldexp(1.0, e - _E8M0_BIAS) for e in range(256)], dtype=torch.float64).float()


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> None:
    for name, t in (("weight_packed", packed), ("weight_scale", scale)):
        if t.dtype != torch.uint8:
            raise HFFormatError(f"{name} is {t.dtype}, expected torch.uint8 ({MXFP4_FORMAT})")
        if t.ndim != 2:
            raise HFFormatError(f"{name} {_shape(t)} is {t.ndim}-D, expected 2-D ({MXFP4_FORMAT})")
    rows, half = packed.shape
    if (2 * half) % GROUP_SIZE != 0:
        raise HFFormatError(
            f"weight_packed {_shape(packed)} holds {2 * half} columns, not a multiple of {GROUP_SIZE} ({MXFP4_FORMAT}"
            f" packs two columns a byte and scales each {GROUP_SIZE})"
        )
    expected = [rows, 2 * half // GROUP_SIZE]
    if list(scale.shape) != expected:
        raise HFFormatError(
            f"weight_scale {_shape(scale)} does not match weight_packed {_shape(packed)}: expected {expected}"
            f" (one scale per {GROUP_SIZE} columns)"
        )


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [out, in] from weight_packed uint8 [out, in/2] and weight_scale uint8 [out, in/32], in dtype.

    Computed in float32, where every product of an E2M1 value and 2 ** (e - 127) is exact (the smallest, 0.5 * 2 **
    -127, is well above float32's smallest subnormal), then rounded once to dtype; for bfloat16 that rounding is exact
    too (same exponent range, and E2M1 values carry 2 significant bits), so the result equals compressed-tensors'
    bfloat16 decompression bit for bit. Works on the tensors' device."""
    _check_packed(packed, scale)
    rows, half = packed.shape
    # int32, not int64, indices: the index tensor is the decode's largest temporary after the float32 values
    values = F.embedding(packed.to(torch.int32), _BYTE_VALUES.to(packed.device))  # [out, in/2, 2]
    values = values.view(rows, scale.shape[1], GROUP_SIZE)
    values.mul_(F.embedding(scale.to(torch.int32), _E8M0_VALUES.view(256, 1).to(packed.device)))
    return values.view(rows, 2 * half).to(dtype)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte for each group's amax (float32, >= 0): compressed-tensors' generate_mx_scales on the bits.

    round_to_power_2 adds 1 << (23 - 1 - 1) to the float32 bit pattern and keeps sign and exponent, so a significand
    of 1.75 or more carries into the next power of two (1.75 * 4 = 7 would round past 6); then 127 + log2 of that
    power of two - 2, clamped to a byte (a zero or subnormal amax gives -inf or less than 0, hence exponent 0). A
    bfloat16 weight widened to float32 keeps its significand, so the rule gives the same byte on either dtype."""
    bits = amax.contiguous().view(torch.int32)
    biased = ((bits + (1 << 21)) >> 23) & 0xFF  # float32's biased exponent after the round
    exponent = biased - 127 + _E8M0_BIAS - _E2M1_EXP_OFFSET
    # a biased exponent of 0 is the value 0 (log2 = -inf), one of 255 an amax that rounded up to inf (log2 = inf):
    # compressed-tensors clamps those infinities to 0 and 255
    exponent = torch.where(biased == 0, 0, torch.where(biased == 255, 255, exponent))
    return exponent.clamp(0, 255).to(torch.uint8)


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) for a float weight [out, in], in % 32 == 0, as compressed-tensors writes them.

    Its rule, from a min-max observer's per-group amax (llm-compressor's default for weights): scale exponent =
    127 + floor(log2(round_to_power_2(amax))) - 2, then W / 2 ** (exponent - 127) clamped to +-6 and rounded to the
    nearest E2M1 value with ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4: fp4_utils.cast_to_fp4), a negative value that rounds to zero keeping its sign bit (code 8).

    Bit for bit equal to compressed-tensors 0.20.1 for float32 and bfloat16 weights. For float16 weights the amax is
    taken in float32 here; compressed-tensors computes in float16, where a group whose amax is below float16's normal
    range (2 ** -14) underflows, so such groups can differ."""
    if not weight.is_floating_point():
        raise ValueError(f"weight is {weight.dtype}, expected a floating-point tensor")
    if weight.ndim != 2:
        raise ValueError(f"weight {_shape(weight)} is {weight.ndim}-D, expected 2-D [out, in]")
    rows, cols = weight.shape
    if cols % GROUP_SIZE != 0:
        raise ValueError(
            f"weight {_shape(weight)} has {cols} columns, not a multiple of {GROUP_SIZE} ({MXFP4_FORMAT} scales each"
            f" {GROUP_SIZE} columns)"
        )
    w = weight.detach().float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    if not torch.isfinite(w).all():
        raise ValueError("weight holds inf or NaN values, which MXFP4 cannot represent")
    exponent = _mx_exponent(w.abs().amax(dim=-1))
    # dividing by a power of two is exact, so the thresholds below compare the true ratio
    y = (w / _E8M0_VALUES.to(w.device)[exponent.long()].unsqueeze(-1)).clamp_(-6.0, 6.0)
    a = y.abs()
    # the code is the count of boundaries passed: > at 0.25, 1.25, 2.5 and 5 (a tie stays on the lower, even code), >=
    # at 0.75, 1.75 and 3.5 (a tie goes up to the even code)
    code = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    code |= (y < 0).to(torch.uint8) << 3
    code = code.view(rows, cols // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed.contiguous(), exponent
