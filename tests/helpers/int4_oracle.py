"""Independent oracles for the device matmuls: float64 math from the formats' definitions, and error bounds.

Nothing here calls the code under test (``moed.devices.cuda_kernels``) or the bank's dequantizer:
the int4 layout is restated from its definition (``native/expert_int4.cu``, ``moed.kernels.int4_format``):
``q`` uint8 ``[..., K, N/2]``, byte ``[k, j]`` = level of column ``j`` (low nibble) and of column
``j + N/2`` (high nibble); ``scale`` / ``min`` bf16 ``[..., K/32, N]``; ``w = level * scale + min``.
Products are formed in float64, where every dequantized weight is exact (a 4-bit level times an
8-bit bf16 mantissa, plus a bf16) and the matmul's rounding is ~1e-16, i.e. nothing next to the
float32 error under test.

Tolerance: any float32 evaluation of ``y = sum_k x_k w_k`` (any summation order, FMA or not)
is within ``gamma_n * sum_k |x_k| |w_k|`` of the exact value, ``gamma_n ~ n u`` with ``u = 2^-24``
and ``n`` the number of roundings along one output's chain. For ``K`` products that is ``K + 1``;
dequantizing ``q * scale + min`` in float32 first adds up to 2 more relative to
``A = level |scale| + |min|`` (>= |w|, the magnitude a float32 evaluation of ``w`` works with), and
the CUDA kernel's per-group ``scale * sum(x q) + min * sum(x)`` stays within ``32 + 2 K/32 + 1 <= K + 4``.
So ``|y - y64| <= (K + 4) u (|x| @ A)`` elementwise. A wrong nibble, group, slot or token row is
off by O(|x| @ |w|), orders of magnitude more; so is bf16 or fp16 accumulation.
"""

from __future__ import annotations

from fractions import Fraction

import torch

GROUP = 32  # weights per (scale, min) pair along K: the format's definition, restated
U32 = 2.0**-24  # float32 unit roundoff


def levels_f64(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K, N/2]`` -> the 4-bit levels as float64 ``[..., K, N]`` (integer arithmetic, no bit tricks)."""
    b = q.to(torch.int64)
    return torch.cat([torch.remainder(b, 16), torch.div(b, 16, rounding_mode="floor")], dim=-1).double()


def _per_group(levels: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
    """``levels [..., K, N]`` and ``per_group [..., K/32, N]`` -> ``[..., K/32, 32, N]`` views for broadcasting."""
    *lead, k, n = levels.shape
    return levels.reshape(*lead, k // GROUP, GROUP, n), per_group.double().unsqueeze(-2)


def dequant_f64(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The exact weights ``level * scale + min`` as float64 ``[..., K, N]``."""
    lv, s = _per_group(levels_f64(q), scale)
    m = mn.double().unsqueeze(-2)
    w = lv * s + m
    return w.reshape(*w.shape[:-3], -1, w.shape[-1])


def int4_magnitude(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """``A = level |scale| + |min|`` float64 ``[..., K, N]``: what float32 rounding of ``x @ W`` scales with."""
    lv, s = _per_group(levels_f64(q), scale.abs())
    a = lv * s + mn.abs().double().unsqueeze(-2)
    return a.reshape(*a.shape[:-3], -1, a.shape[-1])


def grouped_f64(x: torch.Tensor, w64: torch.Tensor, slot_ids: list[int], offsets: list[int]) -> torch.Tensor:
    """``y64 [T, N]``: rows ``offsets[e]:offsets[e+1]`` of ``x`` times slot ``slot_ids[e]`` of ``w64 [S, K, N]``, in float64."""
    x64 = x.detach().cpu().double()
    y = torch.full((x64.shape[0], w64.shape[-1]), float("nan"), dtype=torch.float64)  # rows no expert owns stay NaN
    for e, s in enumerate(slot_ids):
        a, b = offsets[e], offsets[e + 1]
        y[a:b] = x64[a:b] @ w64[s]
    return y


def fp32_bound(x: torch.Tensor, a64: torch.Tensor, slot_ids: list[int], offsets: list[int]) -> torch.Tensor:
    """Elementwise ``(K + 4) u (|x| @ A[slot])`` for grouped rows (``a64 [S, K, N]`` float64 magnitudes)."""
    k = a64.shape[-2]
    return (k + 4) * U32 * grouped_f64(x.abs(), a64, slot_ids, offsets)


def assert_within(y: torch.Tensor, ref64: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """``|y - ref64| <= bound`` everywhere (and the shapes agree); the message names the worst element."""
    y64 = y.detach().cpu().double()
    assert y64.shape == ref64.shape, f"{what}: shape {tuple(y64.shape)} != {tuple(ref64.shape)}"
    assert bool(torch.isfinite(ref64).all()), f"{what}: the oracle has rows no expert owns"
    if ref64.numel() == 0:
        return
    err = torch.nan_to_num((y64 - ref64).abs(), nan=float("inf"))  # a NaN in y fails
    ratio = err / (bound + 1e-300)
    worst = int(torch.argmax(ratio))
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref64.shape))
    assert bool((err <= bound).all()), (
        f"{what}: error {err.flatten()[worst].item():.3g} at {at} exceeds the float32 bound "
        f"{bound.flatten()[worst].item():.3g} (y {y64.flatten()[worst].item():.6g}, exact {ref64.flatten()[worst].item():.6g})"
    )


# --------------------------------------------------------------------------- a hand-checkable case
# Small dyadic numbers: every correct float32 evaluation is exact, so results must be *equal*.
# Columns N = 4 tell "low nibble = column j, high = column j + N/2" from an interleaved (2j, 2j+1)
# layout; K = 64 (two groups) tells scale/min of group 0 from group 1; two slots tell slot mixups.

HAND_S, HAND_K, HAND_N = 2, 64, 4
HAND_SLOT_IDS, HAND_OFFSETS = [1, 0], [0, 2, 3]  # tokens 0-1 -> slot 1, token 2 -> slot 0


def _hand_level(s: int, k: int, n: int) -> int:
    return (3 * k + 5 * n + 7 * s) % 16


def _hand_scale(s: int, g: int, n: int) -> Fraction:
    return Fraction(2) ** (n - g - s)  # 1/4 .. 8: exact in bf16


def _hand_min(s: int, g: int, n: int) -> Fraction:
    return Fraction(-(n + 1)) + Fraction(g, 2) - s  # multiples of 1/2: exact in bf16


def _hand_x(t: int, k: int) -> int:
    return (t + 2 * k) % 5 - 2


def hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, q, scale, min, y_expected)`` built with Python loops; ``y_expected`` from exact rational arithmetic."""
    half = HAND_N // 2
    q = [[[_hand_level(s, k, j) | (_hand_level(s, k, j + half) << 4) for j in range(half)]
          for k in range(HAND_K)] for s in range(HAND_S)]
    groups = HAND_K // GROUP
    scale = [[[float(_hand_scale(s, g, n)) for n in range(HAND_N)] for g in range(groups)] for s in range(HAND_S)]
    mn = [[[float(_hand_min(s, g, n)) for n in range(HAND_N)] for g in range(groups)] for s in range(HAND_S)]
    tokens = HAND_OFFSETS[-1]
    x = [[float(_hand_x(t, k)) for k in range(HAND_K)] for t in range(tokens)]
    y = []
    for t in range(tokens):
        e = max(i for i in range(len(HAND_SLOT_IDS)) if HAND_OFFSETS[i] <= t)
        s = HAND_SLOT_IDS[e]
        row = []
        for n in range(HAND_N):
            acc = Fraction(0)
            for k in range(HAND_K):
                g = k // GROUP
                acc += _hand_x(t, k) * (_hand_level(s, k, n) * _hand_scale(s, g, n) + _hand_min(s, g, n))
            row.append(float(acc))  # exact: a dyadic rational far inside float32's 24 bits
        y.append(row)
    return (
        torch.tensor(x, dtype=torch.float32),
        torch.tensor(q, dtype=torch.uint8),
        torch.tensor(scale, dtype=torch.float32).to(torch.bfloat16),
        torch.tensor(mn, dtype=torch.float32).to(torch.bfloat16),
        torch.tensor(y, dtype=torch.float32),
    )
