"""An independent numpy model of docs/design.md's FP8 cast (section 2), used as the oracle by the tests.

Nothing here calls torch: bf16 inputs arrive as their raw uint16 bit patterns, all arithmetic is
numpy float32 (IEEE, correctly rounded) or exact float64, and the e4m3 encoder is written out by
hand from the 256 float8_e4m3fn codes. The rule's constants are ep_layer.quant's, their one home.
"""

from __future__ import annotations

import numpy as np

from ep_layer import quant

GROUP = quant.FP8_GROUP
PACK = quant.UE8M0_PACK
FP8_MAX = quant.FP8_MAX
AMAX_FLOOR = np.float32(quant.AMAX_FLOOR)


def _e4m3fn_table() -> np.ndarray:
    """float64 value of every float8_e4m3fn code (NaN for 0x7F / 0xFF): 1 sign, 4 exponent (bias 7), 3
    mantissa bits, no infinities, exponent field 0 = subnormal."""
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values[code] = np.nan
        elif exponent == 0:
            values[code] = sign * mantissa / 8.0 * 2.0 ** -6
        else:
            values[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return values


E4M3_VALUES = _e4m3fn_table()
# Codes 0x00..0x7E are the non-negative finite values in increasing order: 0, ..., 448.
_POSITIVE = E4M3_VALUES[:0x7F]
assert np.all(np.diff(_POSITIVE) > 0) and _POSITIVE[-1] == FP8_MAX
# Midpoint between code c and c + 1 (exact in float64: both have 4-bit significands).
_MIDPOINTS = (_POSITIVE[:-1] + _POSITIVE[1:]) / 2


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 array -> uint8 e4m3fn codes: round to nearest, ties to even code (= even mantissa),
    saturating at +-448; the sign bit is kept for zeros (so -0.0 and tiny negatives give 0x80)."""
    v = np.asarray(v, dtype=np.float32)
    assert not np.isnan(v).any()
    a = np.minimum(np.abs(v.astype(np.float64)), FP8_MAX)
    # lo = largest code whose value is <= a; the candidates are lo and lo + 1.
    lo = np.searchsorted(_POSITIVE, a, side="right") - 1
    lo = np.clip(lo, 0, len(_POSITIVE) - 1)
    hi = np.minimum(lo + 1, len(_POSITIVE) - 1)
    mid = _MIDPOINTS[np.minimum(lo, len(_MIDPOINTS) - 1)]
    exact = _POSITIVE[lo] == a
    code = np.where(a < mid, lo, np.where(a > mid, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(exact, lo, code).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 7)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bf16 bit patterns (uint16 / int16) -> the identical float32 values (bf16 is fp32's top half)."""
    return (np.asarray(bits).astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def pow2_ceil(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(2 ** ceil(log2 q) as float32, the exponent as int64) for positive float32 q, via float64 log2."""
    exponent = np.ceil(np.log2(np.asarray(q, dtype=np.float64))).astype(np.int64)
    scale = np.ldexp(1.0, exponent)
    # Self-check of the oracle: the smallest power of two >= q (log2 of a float64 is plenty precise
    # for fp32 quotients, which lie far from the next power of two or are one exactly).
    assert np.all(scale >= q) and np.all(scale / 2 < q)
    return scale.astype(np.float32), exponent


def cast_to_fp8(bits: np.ndarray, round_scale: bool = False, use_ue8m0: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """docs/design.md section 2 on bf16 bit patterns [N, H] -> (uint8 codes [N, H], scales).

    Scales are float32 [N, H/128], or with use_ue8m0 int32 [N, H/512] (four biased exponents each,
    group g in byte g % 4 of int g // 4).
    """
    x = bf16_bits_to_f32(bits)
    n, h = x.shape
    assert h % GROUP == 0 and (not use_ue8m0 or (round_scale and h % (GROUP * PACK) == 0))
    groups = x.reshape(n, h // GROUP, GROUP)
    amax = np.maximum(np.abs(groups).max(axis=-1, initial=np.float32(0)), AMAX_FLOOR).astype(np.float32)
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)  # one correctly rounded fp32 division
    exponent = None
    if round_scale:
        scale, exponent = pow2_ceil(scale)
    with np.errstate(over="raise", invalid="raise"):
        quotient = (groups / scale[:, :, None]).astype(np.float32)
    codes = encode_e4m3(quotient).reshape(n, h)
    if not use_ue8m0:
        return codes, scale
    assert exponent is not None
    biased = (exponent + 127).astype(np.uint32)
    assert np.all((biased > 0) & (biased < 255))
    biased = biased.reshape(n, h // (GROUP * PACK), PACK)
    packed = np.zeros(biased.shape[:2], dtype=np.uint32)
    for byte in range(PACK):
        packed |= biased[:, :, byte] << np.uint32(8 * byte)
    return codes, packed.view(np.int32)


def unpack_ue8m0(packed: np.ndarray) -> np.ndarray:
    """int32 [N, P] -> float32 power-of-two scales [N, 4P]."""
    u = np.asarray(packed).view(np.uint32)
    biased = np.stack([(u >> np.uint32(8 * b)) & np.uint32(0xFF) for b in range(PACK)], axis=-1)
    return np.ldexp(1.0, biased.astype(np.int64) - 127).astype(np.float32).reshape(u.shape[0], -1)


def random_bf16_bits(rng: np.random.Generator, n: int, h: int) -> np.ndarray:
    """Random bf16 rows [n, h] as uint16 bit patterns, mixing every regime the cast must handle:
    normal values at one scale, values spread over many decades, whole-row zeros (+0 and -0),
    values under the amax floor, bf16 subnormals, values near bf16's maximum, any finite bit
    pattern, exact e4m3 ties (5-bit significands with a power-of-two amax), and groups of
    different magnitude in one row."""
    out = np.empty((n, h), dtype=np.uint16)
    for i in range(n):
        kind = int(rng.integers(10))
        if kind == 0:
            row = rng.standard_normal(h).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))
            out[i] = f32_to_bf16_bits(row)
        elif kind == 1:
            row = rng.standard_normal(h) * 10.0 ** rng.uniform(-30, 30, h)
            out[i] = f32_to_bf16_bits(row.astype(np.float32))
        elif kind == 2:
            out[i] = 0x8000 if rng.integers(2) else 0
        elif kind == 3:
            out[i] = f32_to_bf16_bits((rng.standard_normal(h) * 1e-6).astype(np.float32))
        elif kind == 4:  # subnormal bf16: exponent field 0, random mantissa and sign
            out[i] = rng.integers(0, 0x80, h).astype(np.uint16) | (rng.integers(0, 2, h) << 15).astype(
                np.uint16)
        elif kind == 5:  # huge: exponent field 0xFD / 0xFE (up to ~3.39e38)
            exp = rng.integers(0xFD, 0xFF, h).astype(np.uint16)
            out[i] = (exp << 7) | rng.integers(0, 0x80, h).astype(np.uint16) | (
                rng.integers(0, 2, h) << 15).astype(np.uint16)
        elif kind == 6:  # any finite bit pattern
            bits = rng.integers(0, 1 << 16, h).astype(np.uint16)
            finite = (bits & 0x7F80) != 0x7F80
            out[i] = np.where(finite, bits, bits & 0x807F)
        elif kind == 7:  # e4m3 ties: every value a midpoint times 2**k, each group's amax 448 * 2**k
            k = int(rng.integers(-20, 20))
            idx = rng.integers(0, len(_MIDPOINTS), h)
            row = _MIDPOINTS[idx] * np.where(rng.integers(0, 2, h) == 1, -1.0, 1.0)
            row[::GROUP] = FP8_MAX * (1 if rng.integers(2) else -1)
            out[i] = f32_to_bf16_bits(np.ldexp(row, k).astype(np.float32))
        else:  # mixed-scale groups
            groups = rng.standard_normal((h // GROUP, GROUP)) * 10.0 ** rng.uniform(-8, 8, (h // GROUP, 1))
            groups[rng.random(h // GROUP) < 0.2] = 0.0
            out[i] = f32_to_bf16_bits(groups.reshape(h).astype(np.float32))
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (finite inputs that stay finite)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    bits = rounded.astype(np.uint16)
    # Values that would round up to infinity are clamped to the largest finite bf16.
    inf = (bits & 0x7F80) == 0x7F80
    return np.where(inf, (bits & 0x8000) | 0x7F7F, bits).astype(np.uint16)


def every_finite_bf16(arrangement: str, size: int, seed: int) -> np.ndarray:
    """Every finite bf16 bit pattern (-0 included) as uint16, padded with zeros to `size`.
    `neighbours`: sorted by magnitude, so that each 128-channel group holds neighbouring magnitudes and
    the quotients sweep the FP8 range near every rounding boundary; `shuffled`: in random order, so
    that small values meet large scales."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]  # drop infinities and NaNs
    if arrangement == "neighbours":
        bits = bits[np.argsort(bits & 0x7FFF, kind="stable")]
    else:
        bits = np.random.default_rng(seed).permutation(bits)
    return np.concatenate([bits, np.zeros(size - bits.size, dtype=np.uint16)])
