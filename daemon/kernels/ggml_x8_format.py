"""GGUF block rows interleaved in groups of eight: the "x8" layouts of a ggml bank on the CPU.

native/cpu/ggml_x8.h describes the layouts and why (one 32-bit lane per row: one activation broadcast
multiplies eight rows, one conversion and multiply-add serve eight blocks). An x8 matrix holds exactly
the bytes of its GGUF rows, permuted within each group of eight rows (Q4_K's 6-bit scales re-packed
bit for bit), under its own type id ``X8_BASE + GGUF type``. This module is the torch twin of the
native packing (written from the layout description, not from the C): ``unpack`` gives back the GGUF
rows, so ``dequantize`` of an x8 matrix is gguf's own decode of those rows, the reference its kernels
are tested against.
"""

from __future__ import annotations

import torch

from moed.kernels import gguf_quants as q

X8_BASE = 1100
X8_OF: dict[int, int] = {t: X8_BASE + t for t in (q.Q4_0, q.Q4_1, q.Q5_0, q.Q5_1, q.Q8_0, q.Q4_K, q.Q5_K, q.IQ4_NL, q.IQ4_XS,
                                                   q.MXFP4, q.NVFP4)}
# the 32-weight types and NVFP4 (64): bytes of scale fields before the codes, and the size of one field
_B32_HEAD: dict[int, tuple[int, int]] = {q.Q4_0: (2, 2), q.Q8_0: (2, 2), q.IQ4_NL: (2, 2), q.Q4_1: (4, 2),
                                         q.Q5_0: (2, 2), q.Q5_1: (4, 2), q.MXFP4: (1, 1), q.NVFP4: (4, 1)}
_FIVE = (q.Q5_0, q.Q5_1)  # their 4 qh bytes re-packed into a plane after the head
BASE_OF: dict[int, int] = {v: k for k, v in X8_OF.items()}


def is_x8(ggml_type: int) -> bool:
    return int(ggml_type) in BASE_OF


def base_type(ggml_type: int) -> int:
    """The GGUF type whose blocks a matrix of ``ggml_type`` holds (itself unless x8)."""
    return BASE_OF.get(int(ggml_type), int(ggml_type))


def type_name(ggml_type: int) -> str:
    return f"{q.type_name(BASE_OF[ggml_type])}_x8" if is_x8(ggml_type) else q.type_name(ggml_type)


def _groups(raw: torch.Tensor, ggml_type: int, k: int) -> tuple[torch.Tensor, int]:
    """``uint8 [rows, row_bytes]`` (rows a multiple of 8) as ``[groups, 8, blocks, block_bytes]``."""
    weights, size = q.block_size(ggml_type)
    rows = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or rows % 8 or k % weights or raw.shape[1] != k // weights * size:
        raise ValueError(f"x8 {q.type_name(ggml_type)}: rows must be uint8 [8n, {k // weights * size}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.reshape(rows // 8, 8, k // weights, size), rows


def pack(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """GGUF rows ``uint8 [rows, row_bytes]`` of a type in ``X8_OF`` -> the same bytes in the x8 layout."""
    g, rows = _groups(raw, ggml_type, k)
    n, nb = g.shape[0], g.shape[2]
    if ggml_type in _B32_HEAD:
        head, field = _B32_HEAD[ggml_type]  # scale fields: an E8M0 byte, fp16 d, or Q4_1's d and m
        five = 4 if ggml_type in _FIVE else 0
        codes = g.shape[3] - head - five  # 16 bytes of nibbles, or Q8_0's 32 int8 codes
        d = g[..., 0:head].reshape(n, 8, nb, head // field, field).permute(0, 2, 3, 1, 4).reshape(n, nb, 8 * head)
        qs = g[..., head + five:].reshape(n, 8, nb, codes // 4, 4).permute(0, 2, 3, 1, 4).reshape(n, nb, 8 * codes)
        qh = [_qh_plane(g[..., head:head + 4])] if five else []
        return torch.cat([d, *qh, qs], dim=-1).reshape(rows, -1)
    if ggml_type == q.IQ4_XS:
        return _iq4_xs_pack(g).reshape(rows, -1)
    if ggml_type not in (q.Q4_K, q.Q5_K):
        raise ValueError(f"no x8 layout for {q.type_name(ggml_type)}")
    b = g.permute(0, 2, 1, 3).to(torch.int32)  # [n, nb, 8 rows, 144 or 176]
    d, dmin = b[..., 0:2].reshape(n, nb, 16), b[..., 2:4].reshape(n, nb, 16)
    sc, m = _k4_scales(b[..., 4:16])  # [n, nb, 8 rows, 8 sub-blocks]
    # row r = 4 qr + r_, sub-block s = 4 h + s_
    sc5, m5 = (t.reshape(n, nb, 2, 4, 2, 4) for t in (sc, m))  # [.., qr, r_, h, s_]
    lows = ((sc5 & 15) | (m5 & 15) << 4).permute(0, 1, 4, 2, 5, 3).reshape(n, nb, 64)  # h, qr, s_, r_
    hi = (sc5 >> 4) | (m5 >> 4) << 2  # [.., qr, r_, h, s_]
    highs = (hi[..., 0, :] | hi[..., 1, :] << 4).permute(0, 1, 2, 4, 3).reshape(n, nb, 32)  # qr, s_, r_
    at = 48 if ggml_type == q.Q5_K else 16  # Q5_K: qh [16, 48), its codes after
    qs = b[..., at:at + 128].reshape(n, nb, 8, 4, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(n, nb, 1024)  # p, c, r, j
    qh = b[..., 16:48].reshape(n, nb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 256)  # c, r, j
    parts = [d, dmin, lows, highs] + ([qh] if ggml_type == q.Q5_K else []) + [qs]
    return torch.cat(parts, dim=-1).to(torch.uint8).reshape(rows, -1)


def unpack(raw: torch.Tensor, x8_type: int, k: int) -> torch.Tensor:
    """An x8 matrix ``uint8 [rows, row_bytes]`` -> its GGUF rows."""
    ggml_type = BASE_OF.get(int(x8_type))
    if ggml_type is None:
        raise ValueError(f"type {x8_type} is not an x8 layout")
    g, rows = _groups(raw, ggml_type, k)
    n, nb = g.shape[0], g.shape[2]
    blocks = g.reshape(n, nb, -1)  # a group's bytes are its x8 blocks one after the other
    if ggml_type in _B32_HEAD:
        head, field = _B32_HEAD[ggml_type]
        five = 32 if ggml_type in _FIVE else 0
        codes = g.shape[3] - head - five // 8
        d = blocks[..., 0:8 * head].reshape(n, nb, head // field, 8, field).permute(0, 1, 3, 2, 4).reshape(n, nb, 8, head)
        qs = blocks[..., 8 * head + five:].reshape(n, nb, codes // 4, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 8, codes)
        qh = [_qh_bytes(blocks[..., 8 * head:8 * head + 32])] if five else []
        out = torch.cat([d, *qh, qs], dim=-1)  # [n, nb, 8 rows, block bytes]
    elif ggml_type == q.IQ4_XS:
        out = _iq4_xs_unpack(blocks)
    else:
        b = blocks.to(torch.int32)
        d, dmin = b[..., 0:16].reshape(n, nb, 8, 2), b[..., 16:32].reshape(n, nb, 8, 2)
        lows = b[..., 32:96].reshape(n, nb, 2, 2, 4, 4)  # h, qr, s_, r_
        highs = b[..., 96:128].reshape(n, nb, 1, 2, 4, 4)  # qr, s_, r_
        hi = torch.cat([highs & 15, highs >> 4], dim=2)  # h, qr, s_, r_
        sc = ((lows & 15) | (hi & 3) << 4).permute(0, 1, 3, 5, 2, 4).reshape(n, nb, 8, 8)  # [row, sub-block]
        m = ((lows >> 4) | (hi >> 2) << 4).permute(0, 1, 3, 5, 2, 4).reshape(n, nb, 8, 8)
        s6 = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                        (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], dim=-1)
        at = 384 if ggml_type == q.Q5_K else 128
        qs = b[..., at:at + 1024].reshape(n, nb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(n, nb, 8, 128)
        qh = b[..., 128:384].reshape(n, nb, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(n, nb, 8, 32)
        parts = [d, dmin, s6] + ([qh] if ggml_type == q.Q5_K else []) + [qs]
        out = torch.cat(parts, dim=-1).to(torch.uint8)  # [n, nb, 8 rows, 144 or 176]
    return out.permute(0, 2, 1, 3).reshape(rows, -1)


def _k4_scales(s12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes (int32 ``[..., 12]``) -> the 6-bit scales and mins ``[..., 8]`` (gguf's get_scale_min)."""
    lo_sc, lo_m, mix = s12[..., 0:4], s12[..., 4:8], s12[..., 8:12]
    sc = torch.cat([lo_sc & 63, (mix & 15) | (lo_sc >> 6) << 4], dim=-1)
    m = torch.cat([lo_m & 63, (mix >> 4) | (lo_m >> 6) << 4], dim=-1)
    return sc, m


def _iq4_xs_pack(g: torch.Tensor) -> torch.Tensor:
    """IQ4_XS groups ``[n, 8 rows, nb, 136]`` -> x8 blocks ``[n, nb, 1088]``."""
    n, nb = g.shape[0], g.shape[2]
    b = g.permute(0, 2, 1, 3).to(torch.int32)  # [n, nb, 8 rows, 136]
    d = b[..., 0:2].reshape(n, nb, 16)
    sh = b[..., 2] | b[..., 3] << 8  # [n, nb, 8 rows]
    sl = b[..., 4:8]
    sub = torch.arange(8)
    ls = ((sl[..., sub // 2] >> (4 * (sub % 2))) & 15) | ((sh[..., None] >> (2 * sub)) & 3) << 4  # [.., row, s]
    ls6 = ls.reshape(n, nb, 2, 4, 2, 4)  # qr, r_, h, s_
    lows = ((ls6[..., 0, :] & 15) | (ls6[..., 1, :] & 15) << 4).permute(0, 1, 2, 4, 3).reshape(n, nb, 32)  # qr, s_, r_
    hi = (ls6 >> 4).permute(0, 1, 5, 3, 2, 4)  # s_, r_, qr, h
    highs = (hi[..., 0, 0] | hi[..., 0, 1] << 2 | hi[..., 1, 0] << 4 | hi[..., 1, 1] << 6).reshape(n, nb, 16)
    qs = b[..., 8:136].reshape(n, nb, 8, 8, 4, 4).permute(0, 1, 3, 4, 2, 5).reshape(n, nb, 1024)  # s, c, r, j
    return torch.cat([d, lows, highs, qs], dim=-1).to(torch.uint8)


def _iq4_xs_unpack(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS x8 blocks ``[n, nb, 1088]`` -> GGUF blocks ``[n, nb, 8 rows, 136]``."""
    n, nb = blocks.shape[0], blocks.shape[1]
    b = blocks.to(torch.int32)
    d = b[..., 0:16].reshape(n, nb, 8, 2)
    lows = b[..., 16:48].reshape(n, nb, 2, 4, 4)  # qr, s_, r_
    highs = b[..., 48:64].reshape(n, nb, 4, 4)  # s_, r_
    lo = torch.stack([lows & 15, lows >> 4], dim=2)  # [.., h, qr, s_, r_]
    shift = 2 * (2 * torch.arange(2).view(1, 2) + torch.arange(2).view(2, 1))  # [h, qr] -> 2 (2 qr + h)
    hi = (highs[:, :, None, None] >> shift[..., None, None]) & 3  # [.., h, qr, s_, r_]
    ls = (lo | hi << 4).permute(0, 1, 3, 5, 2, 4).reshape(n, nb, 8, 8)  # [row, s = 4 h + s_]
    sub = torch.arange(8)
    sh = (((ls >> 4) & 3) << (2 * sub)).sum(-1)  # [.., row]
    sl = (ls[..., 0::2] & 15) | (ls[..., 1::2] & 15) << 4
    qs = b[..., 64:1088].reshape(n, nb, 8, 4, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(n, nb, 8, 128)
    return torch.cat([d, (sh & 255)[..., None], (sh >> 8)[..., None], sl, qs], dim=-1).to(torch.uint8)


def _qh_plane(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 qh bytes ``[n, 8 rows, nb, 4]`` -> their x8 plane ``[n, nb, 32]``: byte 4 r + j, bit c the
    fifth bit of weight 4 c + j, bit 4 + c that of weight 16 + 4 c + j."""
    bits = ((qh.to(torch.int32)[..., :, None] >> torch.arange(8)) & 1).reshape(*qh.shape[:-1], 2, 4, 4)  # h, c, j
    lane = (bits << (4 * torch.arange(2).view(2, 1, 1) + torch.arange(4).view(1, 4, 1))).sum(dim=(-3, -2))  # [.., j]
    return lane.permute(0, 2, 1, 3).reshape(qh.shape[0], qh.shape[2], 32).to(torch.uint8)


def _qh_bytes(plane: torch.Tensor) -> torch.Tensor:
    """The x8 plane ``[n, nb, 32]`` -> qh bytes ``[n, nb, 8 rows, 4]``."""
    lane = plane.to(torch.int32).reshape(*plane.shape[:2], 8, 4)  # [.., r, j]
    bits = (lane[..., None] >> torch.arange(8)) & 1  # [.., j, bit = 4 h + c]
    bits = bits.reshape(*lane.shape, 2, 4).permute(0, 1, 2, 4, 5, 3)  # [.., h, c, j]: weight 16 h + 4 c + j
    qh = bits.reshape(*lane.shape[:3], 4, 8)  # byte b = weights 8 b .. 8 b + 7
    return (qh << torch.arange(8)).sum(-1).to(torch.uint8)
