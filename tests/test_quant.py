"""ep_layer.quant against the independent numpy oracle in fp8_oracle.py, bit for bit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from fp8_oracle import (
    E4M3_VALUES,
    FP8_MAX,
    GROUP,
    bf16_bits_to_f32,
    cast_to_fp8,
    decode_e4m3,
    encode_e4m3,
    pow2_ceil,
    random_bf16_bits,
    unpack_ue8m0,
)

from ep_layer.quant import ceil_pow2, per_token_cast_back, per_token_cast_to_fp8
from ep_layer.quant import unpack_ue8m0 as lib_unpack

MODES = {"plain": (False, False), "round_scale": (True, False), "ue8m0": (True, True)}


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def first_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    where = tuple(int(i) for i in bad[0])
    return f"{len(bad)} mismatches, first at {where}: got {got[where]!r}, want {want[where]!r}"


# ---------------------------------------------------------------------------------------- the oracle
def test_oracle_encoder_is_round_to_nearest_even() -> None:
    """The hand-written encoder itself: exact on every code, ties to the even code, saturating."""
    finite = [c for c in range(256) if not np.isnan(E4M3_VALUES[c])]
    values = E4M3_VALUES[finite].astype(np.float32)
    assert np.array_equal(encode_e4m3(values), np.array(finite, dtype=np.uint8))
    positive = E4M3_VALUES[:0x7F]
    mids = ((positive[:-1] + positive[1:]) / 2).astype(np.float32)
    want = np.array([c if c % 2 == 0 else c + 1 for c in range(0x7E)], dtype=np.uint8)
    assert np.array_equal(encode_e4m3(mids), want)
    assert np.array_equal(encode_e4m3(-mids), want | 0x80)
    # Just off a midpoint, the nearest code wins whatever its parity.
    above = np.nextafter(mids, np.float32(np.inf))
    below = np.nextafter(mids, np.float32(0))
    assert np.array_equal(encode_e4m3(above), np.arange(1, 0x7F, dtype=np.uint8))
    assert np.array_equal(encode_e4m3(below), np.arange(0, 0x7E, dtype=np.uint8))
    big = np.array([448.0, 463.9, 464.0, 500.0, 1e30, 3e38], dtype=np.float32)
    assert np.all(encode_e4m3(big) == 0x7E) and np.all(encode_e4m3(-big) == 0xFE)
    tiny = np.array([1e-30, 2.0 ** -10, np.float32(2.0 ** -10) * np.float32(1 + 2 ** -20)], dtype=np.float32)
    assert encode_e4m3(tiny).tolist() == [0, 0, 1]
    assert encode_e4m3(np.array([-0.0, -1e-30], dtype=np.float32)).tolist() == [0x80, 0x80]


# ---------------------------------------------------------------------------------------- the cast
@pytest.mark.parametrize("mode", list(MODES))
def test_cast_is_bit_exact(mode: str, seed: int) -> None:
    round_scale, use_ue8m0 = MODES[mode]
    rng = np.random.default_rng(seed)
    hiddens = [512, 1024, 2048, 7168] if use_ue8m0 else [128, 256, 384, 640, 1024, 7168]
    for it in range(24):
        n = [0, 1][it] if it < 2 else int(rng.integers(1, 48))
        h = int(rng.choice(hiddens))
        bits = random_bf16_bits(rng, n, h)
        data, scales = per_token_cast_to_fp8(bits_to_bf16(bits), round_scale, use_ue8m0)
        want_data, want_scales = cast_to_fp8(bits, round_scale, use_ue8m0)
        ctx = f"seed={seed} iteration={it} N={n} H={h} mode={mode}"
        assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (n, h), ctx
        got_data = data.view(torch.uint8).numpy()
        assert np.array_equal(got_data, want_data), f"{ctx}: data {first_mismatch(got_data, want_data)}"
        if use_ue8m0:
            assert scales.dtype == torch.int32 and tuple(scales.shape) == (n, h // 512), ctx
        else:
            assert scales.dtype == torch.float32 and tuple(scales.shape) == (n, h // GROUP), ctx
        got_scales = scales.numpy().view(np.uint32)
        want_bits = want_scales.view(np.uint32)
        assert np.array_equal(got_scales, want_bits), f"{ctx}: scales {first_mismatch(got_scales, want_bits)}"


def test_cast_special_rows() -> None:
    """Rows that hit every edge at once, deterministic so that each is surely exercised."""
    h = 1024
    rows = np.zeros((6, h), dtype=np.uint16)
    rows[1] = 0x8000  # all -0.0
    rows[2, :] = 0x0001  # smallest bf16 subnormal: amax floored to 1e-4
    rows[3, :] = 0x7F7F  # largest finite bf16
    rows[3, 1::2] = 0xFF7F  # and its negative
    rows[4] = np.tile(np.array([0x3F80, 0x0000, 0x0001, 0x7F7F], dtype=np.uint16), h // 4)  # 1, 0, sub, max
    rows[5, :GROUP] = 0x3F80  # one group of ones, the rest zeros
    for mode, (round_scale, use_ue8m0) in MODES.items():
        data, scales = per_token_cast_to_fp8(bits_to_bf16(rows), round_scale, use_ue8m0)
        want_data, want_scales = cast_to_fp8(rows, round_scale, use_ue8m0)
        assert np.array_equal(data.view(torch.uint8).numpy(), want_data), mode
        assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32)), mode
    # The all-zero groups are stored as 0 with scale 1e-4 / 448 (nothing divides by zero).
    data, scales = per_token_cast_to_fp8(bits_to_bf16(rows[:1]))
    assert scales[0, 0].item() == float(np.float32(np.float32(1e-4) / np.float32(448)))
    assert not data.view(torch.uint8).any()
    # -0.0 keeps its sign, as e4m3 -0 (0x80).
    assert (per_token_cast_to_fp8(bits_to_bf16(rows[1:2]))[0].view(torch.uint8) == 0x80).all()


def test_ue8m0_packing_layout(seed: int) -> None:
    """Group g's biased exponent is byte g % 4 of int g // 4, including bytes >= 128 (sign bit)."""
    rng = np.random.default_rng(seed)
    n, h = 8, 4096
    # Per-group amax = 448 * 2**e (>= the 1e-4 floor), so the scale is 2**e exactly.
    exps = rng.integers(-20, 110, (n, h // GROUP))
    x = rng.uniform(-0.5, 0.5, (n, h))
    x = x * np.repeat(np.ldexp(448.0, exps), GROUP, axis=1)
    x[:, ::GROUP] = np.ldexp(448.0, exps)
    bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine here
    _, packed = per_token_cast_to_fp8(bits_to_bf16(bits), round_scale=True, use_ue8m0=True)
    u = packed.numpy().view(np.uint32)
    for g in range(h // GROUP):
        byte = (u[:, g // 4] >> (8 * (g % 4))) & 0xFF
        assert np.array_equal(byte.astype(np.int64), exps[:, g] + 127), f"seed={seed} group={g}"
    assert (packed < 0).any(), f"seed={seed}: expected some exponent byte >= 128 in byte 3"


# ---------------------------------------------------------------------------------------- helpers
def test_ceil_pow2_matches_log2_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    exps = rng.integers(-125, 126, 20000)
    q = np.ldexp(rng.uniform(0.5, 1.0, exps.size), exps).astype(np.float32)
    powers = np.ldexp(1.0, rng.integers(-125, 126, 2000)).astype(np.float32)
    q = np.concatenate([q, powers, np.nextafter(powers, np.float32(0)), np.nextafter(powers, np.float32(1e38))])
    want, _ = pow2_ceil(q)
    got = ceil_pow2(torch.from_numpy(q)).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"seed={seed}: {first_mismatch(got, want)}"


@pytest.mark.parametrize("mode", list(MODES))
def test_cast_back_is_bit_exact(mode: str, seed: int) -> None:
    """per_token_cast_back = fp32(decoded e4m3 * scale), and UE8M0 unpacks to the oracle's scales."""
    round_scale, use_ue8m0 = MODES[mode]
    rng = np.random.default_rng(seed)
    n, h = 33, 2048
    bits = random_bf16_bits(rng, n, h)
    data, scales = per_token_cast_to_fp8(bits_to_bf16(bits), round_scale, use_ue8m0)
    codes, want_scales = cast_to_fp8(bits, round_scale, use_ue8m0)
    if use_ue8m0:
        unpacked = unpack_ue8m0(want_scales)
        assert np.array_equal(lib_unpack(scales).numpy().view(np.uint32), unpacked.view(np.uint32)), seed
        want_scales = unpacked
    # float64 product of a 4-bit and a 24-bit significand is exact; one rounding to fp32 = torch's fp32 multiply.
    # Codes near 448 times scales near 2**120 overflow fp32 to inf, in the library and here alike.
    with np.errstate(over="ignore"):
        want = (decode_e4m3(codes).reshape(n, h // GROUP, GROUP) * want_scales[:, :, None]).astype(np.float32)
    got = per_token_cast_back(data, scales).numpy()
    assert np.array_equal(got.view(np.uint32), want.reshape(n, h).view(np.uint32)), f"seed={seed} mode={mode}"
    # Leading batch dims are accepted as the [E_l, R*T, H] dispatch layout has them.
    batched = per_token_cast_back(data.view(3, 11, h), scales.view(3, 11, -1)).numpy()
    assert np.array_equal(batched.reshape(n, h).view(np.uint32), want.reshape(n, h).view(np.uint32)), seed


@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip_error_bound(mode: str, seed: int) -> None:
    """|x_hat - x| <= (2**-4 + 2**-20) |x| + 2**-10 * scale for every element, x_hat in float64.

    Why: v = fp32(x / s) is x / s within a relative 2**-24. e4m3 keeps 3 mantissa bits, so rounding a
    normal |v| (>= 2**-6) moves it by at most half an ulp <= 2**-4 |v|, and a subnormal one by at most
    half the subnormal step, 2**-10. Saturation only trims |v| <= 448 * (1 + 2**-23) (plain scale)
    or never (power-of-two scales are >= amax / 448). Multiplying back by s (float64, exact)
    scales both terms by s; the 2**-20 term absorbs the fp32 division's rounding with room to spare.
    """
    round_scale, use_ue8m0 = MODES[mode]
    rng = np.random.default_rng(seed)
    bits = random_bf16_bits(rng, 64, 2048)
    x = bf16_bits_to_f32(bits).astype(np.float64)
    data, scales = per_token_cast_to_fp8(bits_to_bf16(bits), round_scale, use_ue8m0)
    s = lib_unpack(scales).numpy() if use_ue8m0 else scales.numpy()
    s = np.repeat(s.astype(np.float64), GROUP, axis=1)
    x_hat = decode_e4m3(data.view(torch.uint8).numpy()) * s
    bound = (2.0 ** -4 + 2.0 ** -20) * np.abs(x) + 2.0 ** -10 * s
    err = np.abs(x_hat - x)
    bad = np.argwhere(err > bound)
    assert not len(bad), (f"seed={seed} mode={mode}: {len(bad)} elements over the bound, first "
                          f"{tuple(bad[0])}: x={x[tuple(bad[0])]!r} x_hat={x_hat[tuple(bad[0])]!r}")
    # The bound is attained to within a factor 2 somewhere (it is not vacuous): e4m3 really has 3 bits.
    normal = np.abs(x) >= 2.0 ** -6 * s
    assert (err[normal] / np.abs(x[normal])).max() > 2.0 ** -5, f"seed={seed}"
    # And the scale never lets a group overflow: every |x| / s <= 448 up to fp32 rounding.
    assert np.all(np.abs(x) / s <= FP8_MAX * (1 + 2.0 ** -22)), f"seed={seed}"


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("h", "round_scale", "use_ue8m0", "names"), [
    (100, False, False, ("x", "hidden", "128")),
    (130, True, False, ("x", "hidden", "128")),
    (128 * 3, True, True, ("x", "hidden", "512")),
    (256, True, True, ("x", "hidden", "512")),
    (512, False, True, ("use_ue8m0", "round_scale")),
])
def test_cast_rejects_bad_arguments(h: int, round_scale: bool, use_ue8m0: bool, names: tuple[str, ...]) -> None:
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        per_token_cast_to_fp8(x, round_scale, use_ue8m0)
    msg = str(info.value)
    for name in names:
        assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", msg), f"{name!r} not named in {msg!r}"
