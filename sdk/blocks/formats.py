"""Number formats of weights and caches - their torch definitions, which the device tiles match bit
for bit: E2M1 (fp4) codes, UE8M0 power-of-two scales, and MXFP4 = E2M1 codes with a UE8M0 scale
per 32 values (the OCP block format: the experts' weights, V4.1's CSA indexer keys). Pure torch.

An E2M1 code is sign (bit 3) | a 3-bit magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6; two codes
a byte, value 2i in the low nibble. Quantising rounds to the nearest magnitude, ties to the even
code, saturating at 6. A UE8M0 byte E means 2^(E - 127); the chosen E is the smallest with the
group's max |x| <= the element format's max x 2^(E - 127), computed from the max's exponent and
mantissa (no log2, no division: exact at the edges), clamped to [0, 254]; a format may floor the
max first (V4.1's writers do: MXFP4 at 6 x 2^-126, the fp8 window at 1e-4), so that a zero or
tiny group gets that floor's scale.
"""
from __future__ import annotations

import math

import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# round to nearest, ties to the even code: a code is passed at t (y > t) or, its upper neighbour
# even, at t itself (y >= t) - 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
MXFP4_GROUP = 32
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126     # V4.1's MXFP4 writer: a zero group's scale byte is 1, not 0


def ue8m0_exponents(x: torch.Tensor, group: int, max_value: float, floor: float = 0.0) -> torch.Tensor:
    """The UE8M0 scale byte E of every `group`-value group of x [..., n] (int32 [..., n / group]):
    the smallest 2^(E - 127) with amax <= max_value * 2^(E - 127), amax = max(max |x|, floor) -
    with amax = f 2^e and max_value = fm 2^em (f, fm in [0.5, 1)), E = e + 127 - em, + 1 when
    f > fm - clamped to [0, 254]; 0 for amax = 0."""
    fm, em = math.frexp(max_value)
    amax = x.float().abs().unflatten(-1, (-1, group)).amax(-1).clamp(min=floor)
    f, ex = torch.frexp(amax)
    e = ex.to(torch.int32) + (127 - em) + (f > fm).to(torch.int32)
    return torch.where(amax > 0, e, torch.zeros_like(e)).clamp(0, 254)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """y (values already divided by their scale) -> E2M1 codes int32: the magnitude's nearest
    code, ties to even, saturating at 6 (E2M1_STEPS); the sign in bit 3 (-0 kept for small
    negatives)."""
    a = y.abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for t, inclusive in E2M1_STEPS:
        code += (a >= t if inclusive else a > t).int()
    return code | ((y < 0).int() << 3)


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] (0..15) -> bytes uint8 [..., n / 2], code 2i in the low nibble."""
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., n / 2] of packed E2M1 codes -> their fp32 values [..., n] (computed, no
    host table: CUDA-graph capturable)."""
    nib = packed.to(torch.int32)
    code = torch.stack([nib & 15, nib >> 4], dim=-1).flatten(-2)
    m = code & 7
    mag = torch.where(m < 2, m * 0.5, torch.ldexp(1.0 + 0.5 * (m & 1), (m >> 1) - 1))
    return mag * torch.where(code >= 8, -1.0, 1.0)


def mxfp4_bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of 32) -> (codes uint8 [..., n / 2], scale bytes uint8 [..., n / 32]):
    per 32 values E = ue8m0_exponents(x, 32, 6.0, MXFP4_AMAX_FLOOR), each value's E2M1 code of
    x / 2^(E - 127)."""
    e = ue8m0_exponents(x, MXFP4_GROUP, 6.0, MXFP4_AMAX_FLOOR)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    code = e2m1_codes(x.float().unflatten(-1, (-1, MXFP4_GROUP)) / scale[..., None]).flatten(-2)
    return pack_nibbles(code), e.to(torch.uint8)


def mxfp4_values(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """(codes uint8 [..., n / 2], scale bytes uint8 [..., n / 32]) -> fp32 values [..., n]."""
    scale = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps.to(torch.int32) - 127)
    return (e2m1_values(codes).unflatten(-1, (-1, MXFP4_GROUP)) * scale[..., None]).flatten(-2)


def mxfp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> its MXFP4 values rounded to bf16 (exact unless below bf16's normal range):
    what a reader of x's MXFP4 form sees - V4.1's indexer keys and queries."""
    return mxfp4_values(*mxfp4_bytes(x)).to(torch.bfloat16)
