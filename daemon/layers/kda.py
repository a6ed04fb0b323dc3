"""Kimi Delta Attention as a token mixer: Kimi-Linear's linear-attention layer, in the style of moed's GatedDeltaNet.

Shapes: T new tokens of one row, D hidden; H heads of Dk = Dv = head_dim (``linear_attn_config.num_heads`` /
``head_dim``), P = H * Dk, C = 3 * P conv channels (q, k, v), K the conv kernel (``short_conv_kernel_size``).

Per token t of a row (transformers' KimiLinearDeltaAttention):

    q, k, v   = q_proj x, k_proj x, v_proj x                         each [P]
    q, k, v   = SiLU(depthwise causal conv, kernel K, no bias) of each (q_conv1d / k_conv1d / v_conv1d)
    q         = l2norm(q per head) * Dk^-1/2 ;  k = l2norm(k per head)  (x / sqrt(sum x^2 + 1e-6))
    g         = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj x) + dt_bias)   [H, Dk]  (per channel, float32)
    beta      = sigmoid(b_proj x)                                       [H]
    o         = KDA(q, k, v, beta, g; S)                                [H, Dv]   (``chunked_kda`` / ``recurrent_kda`` below)
    o         = RMSNorm_per_head(o; o_norm.weight [Dv], eps=rms_norm_eps) * sigmoid(g_b_proj(g_a_proj x))
    out       = o_proj(o)                                               [D]

The per-sequence state: the last K-1 conv inputs ``[C, K-1]`` and S ``[H, Dk, Dv]`` float32.
Tensor names are the checkpoint's (Moonshot's remote-code names, which transformers' save_pretrained writes back):
``{prefix}.q_proj / k_proj / v_proj / q_conv1d / k_conv1d / v_conv1d / f_a_proj / f_b_proj / A_log / dt_bias /
b_proj / g_a_proj / g_b_proj / o_norm / o_proj``.

The rule
--------
Kimi Delta Attention (KDA): the delta rule with a per-channel decay (Kimi-Linear's linear-attention rule).

Shapes (one sequence): T tokens, H heads, Dk key channels, Dv value channels per head. ``q, k [T, H, Dk]``
(already L2-normalised, q also scaled by Dk^-1/2), ``v [T, H, Dv]``, ``beta [T, H]`` (sigmoid of b_proj),
``log_decay [T, H, Dk]`` (g_t = -exp(A_log[h]) * softplus(f_b(f_a(x_t)) + dt_bias), one value per key channel,
<= 0), state ``S [H, Dk, Dv]`` float32.

Per token t (transformers' ``recurrent_kimi_delta_attention`` / flash-linear-attention's ``naive_recurrent_kda``)::

    S <- diag(exp(g_t)) S                      # row d of S (key channel d) decays by exp(g_t[d])
    S <- S + k_t (beta_t (v_t - S^T k_t))^T    # the delta rule on the decayed state
    o_t = S^T q_t

The gated delta rule of Qwen3-Next (``moed.layers.gated_deltanet``) is the special case g_t[d] = g_t for all d.

``recurrent_kda`` runs it token by token (decode steps, and the reference); ``chunked_kda`` runs ``chunk``
tokens at a time in the WY / UT-transform form (flash-linear-attention's ``chunk_kda``). Within a chunk, with
G_i = g_1 + ... + g_i the cumulative log decay (per channel, non-increasing in i), S0 the state before it and
u_j the value token j writes (u_j = beta_j (v_j - S'_j^T k_j), S'_j the decayed state it reads)::

    A_ij   = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])                        (j < i)
    (I + diag(beta) A) U = beta V - (beta exp(G) * K) S0                      (unit lower-triangular solve)
    O      = (exp(G) * Q) S0 + Aqk U,   Aqk_ij = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])   (j <= i)
    S_end  = diag(exp(G_C)) S0 + (exp(G_C - G) * K)^T U

Unlike the per-head case, A and Aqk are not (q k^T) * M for one matrix M of decays: the decay sits inside the
sum over channels. Writing exp(G_i - G_j) = exp(G_i) exp(-G_j) turns them into one matrix product but
overflows float32 as soon as a chunk's decay passes e^-88 (exp(-G_j) > 3e38); transformers' torch fallback
instead builds the [C, C, Dk] tensor of pairwise decays for every chunk at once (exact, but C times the size of
the keys: 4.3 GB at 32 heads x 128 for 4096 tokens).

Here the pairs are split by a binary tree over the chunk (``_intra_chunk_scores``): at each level the chunk is
cut into blocks of 2s tokens, and the pairs with i in a block's second half and j in its first half get
exp(G_i - G_j) = exp(G_i - r) exp(r - G_j) with r = G at the second half's first token, so G_i <= r <= G_j and
both factors are <= 1: one batched [2s, Dk] x [Dk, s] matrix product per block, log2(C) levels, every pair
(j < i) in exactly one of them (the level where the tree first separates them); the diagonal (i = j, decay 1)
of Aqk is q_i . k_i. Nothing is ever > 1, so nothing overflows whatever the decays, and a factor flushed to 0
(below e^DECAY_FLOOR, as moed's ``_decay`` does for the gated delta rule: keeps the arithmetic out of float32's
subnormal range) bounds the true product by the same e^-30. The triangular solve runs in float64 (as in
``chunked_delta_rule``).

G is summed in float64: every decay used is a difference of two G's, and with fast channels G reaches -1000s
within a chunk, where float32's rounding (|G| * 6e-8) would put an absolute error of ~1e-4 into exponents of
order 1 (measured: 1.8e-5 relative error of the outputs, which is what transformers' torch chunk_kda shows);
the differences are taken in float64 and rounded to float32 before the exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moed.layers.causal_conv import causal_conv
from moed.layers.gated_deltanet import DECAY_FLOOR, SOLVE_FLOOR, _l2norm, run_rows
from moed.layers.linear import linear


# tokens per chunk (a power of two); on 2 cores at Kimi-Linear's shape (32 heads x 128), T = 2048-4096: 64 and 32
# within noise of each other (~0.23-0.26 ms/token), 128 ~10% and 16 ~15% slower; the token-by-token rule ~0.72 ms
CHUNK = 64


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) in float32 (log_decay float32 or float64), 0 where log_decay is below DECAY_FLOOR."""
    return F.threshold(log_decay.float(), DECAY_FLOOR, float("-inf")).exp_()


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                  log_decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """KDA token by token (the reference). ``q, k [T, H, Dk]``, ``v [T, H, Dv]``, ``beta [T, H]``,
    ``log_decay [T, H, Dk]``; ``state [H, Dk, Dv]`` (float32) is updated in place. Returns ``[T, H, Dv]``
    float32. Decay factors below e^DECAY_FLOOR are 0 (no subnormal state rows)."""
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    decay = _decay(log_decay)  # [T, H, Dk]
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    s = state.float()
    for i in range(q.shape[0]):
        s = s * decay[i][:, :, None]  # per key channel
        recalled = torch.einsum("hkv,hk->hv", s, k[i])
        delta = (v[i] - recalled) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", s, q[i])
    state.copy_(s)
    return out


def _intra_chunk_scores(qc: torch.Tensor, kc: torch.Tensor, gc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's decayed key-key and query-key scores. ``qc, kc [H, C, Dk]`` float32, ``gc [H, C, Dk]`` the
    cumulative log decay (float64), C a power of two -> ``akk [H, C, C]`` (sum_d k_i k_j e^(G_i - G_j) for
    j < i, zero elsewhere) and ``aqk [H, C, C]`` (sum_d q_i k_j e^(G_i - G_j) for j <= i, zero above the
    diagonal)."""
    h, c, dk = kc.shape
    akk = kc.new_zeros(h, c, c)
    aqk = kc.new_zeros(h, c, c)
    aqk.diagonal(dim1=1, dim2=2).copy_((qc * kc).sum(-1))
    s = c // 2
    while s:
        nb = c // (2 * s)  # blocks of 2s tokens; rows: their second halves, columns: their first halves
        g = gc.view(h, nb, 2, s, dk)
        ref = g[:, :, 1, :1]  # [H, nb, 1, Dk]: G at the first token of each second half (G_i <= ref <= G_j)
        row_decay = _decay(g[:, :, 1] - ref)  # [H, nb, s, Dk], <= 1
        cols = kc.view(h, nb, 2, s, dk)[:, :, 0] * _decay(ref - g[:, :, 0])  # [H, nb, s, Dk]
        rows = torch.cat([kc.view(h, nb, 2, s, dk)[:, :, 1], qc.view(h, nb, 2, s, dk)[:, :, 1]], dim=2)
        scores = (rows * row_decay.repeat(1, 1, 2, 1)) @ cols.transpose(-1, -2)  # [H, nb, 2s (k | q), s]
        for dest, part in ((akk, scores[:, :, :s]), (aqk, scores[:, :, s:])):
            # block b's [second half, first half] corner of dest, for every b at once: [H, s, s, nb]
            corner = dest.view(h, nb, 2, s, nb, 2, s).diagonal(dim1=1, dim2=4)[:, 1, :, 0]
            corner.copy_(part.permute(0, 2, 3, 1))
        s //= 2
    return akk, aqk


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """KDA ``chunk`` tokens at a time (same arguments and result as ``recurrent_kda``; see the module docstring
    for the algebra). ``chunk`` is a power of two; the last chunk is padded to the next power of two of its
    length with tokens that change nothing (k = q = v = 0, beta = 0, decay 1)."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunked_kda: chunk {chunk} is not a power of two")
    t, h, dk = k.shape
    dv = v.shape[2]
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    s = state.float()
    for start in range(0, t, chunk):  # one chunk at a time: its [H, C, C] and [H, C, D] tensors stay in cache
        end = min(start + chunk, t)
        m = end - start
        size = chunk if m == chunk else 1 << (m - 1).bit_length()
        pad = (0, 0, 0, size - m)
        qc, kc, vc = (F.pad(x[start:end].transpose(0, 1).float(), pad) for x in (q, k, v))  # [H, C, D]
        bc = F.pad(beta[start:end].t().float(), pad[2:])  # [H, C]
        gc = F.pad(log_decay[start:end].transpose(0, 1).double(), pad).cumsum(1)  # G [H, C, Dk], float64
        akk, aqk = _intra_chunk_scores(qc, kc, gc)
        lower = akk.mul_(bc[:, :, None])  # diag(beta) A, strictly lower; the solve takes the unit diagonal as read
        decay_g = _decay(gc)  # e^G [H, C, Dk]
        rhs = torch.cat([bc[..., None] * vc, (bc[..., None] * decay_g) * kc], dim=-1)  # [H, C, Dv + Dk]
        # float64: the solve's long products of small factors fall below float32's normal range
        solved = torch.linalg.solve_triangular(lower.double(), rhs.double(), upper=False, unitriangular=True)
        solved = solved.masked_fill_(solved.abs() < SOLVE_FLOOR, 0.0).float()
        u = solved[..., :dv] - solved[..., dv:] @ s  # [H, C, Dv]: the values this chunk writes
        out[start:end] = ((qc * decay_g) @ s + aqk @ u)[:, :m].transpose(0, 1)
        last = gc[:, -1:]  # G at the chunk's end [H, 1, Dk] (padding does not decay)
        s = s * _decay(last).transpose(-1, -2) + (kc * _decay(last - gc)).transpose(-1, -2) @ u
    state.copy_(s)
    return out


# tokens of one row from which the chunk-parallel rule is used: measured on 2 cores at 32 heads x 128, recurrent
# vs chunked: 2 tokens 1.17 / 1.12 ms, 4: 2.07 / 1.60, 8: 4.69 / 2.51, 16: 9.96 / 3.97
CHUNKED_FROM = 4


@dataclass(frozen=True)
class KdaConfig:
    num_heads: int  # linear_attn_config.num_heads
    head_dim: int  # linear_attn_config.head_dim (Dk = Dv)
    conv_kernel: int  # linear_attn_config.short_conv_kernel_size
    eps: float = 1e-5  # o_norm's (rms_norm_eps)

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.proj_dim

    def layer(self, weights: dict[str, torch.Tensor], prefix: str) -> "KimiDeltaAttention":
        return KimiDeltaAttention(self, weights, prefix)

    def state_floats(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.head_dim

    def step_floats(self, tokens: int) -> int:
        """Floats of a step's temporaries: q/k/v projections and conv in and out, the per-channel decay, the
        output gate, the rule's output and the norm's (the per-chunk matrices are small beside them)."""
        p = self.proj_dim
        return tokens * (2 * 3 * p + 3 * p + p + p + 3 * p + 2 * self.head_dim + self.num_heads)

    def weight_shapes(self, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
        d, p, h, dk, k = hidden, self.proj_dim, self.num_heads, self.head_dim, self.conv_kernel
        return {f"{prefix}.q_proj.weight": (p, d), f"{prefix}.k_proj.weight": (p, d), f"{prefix}.v_proj.weight": (p, d),
                f"{prefix}.q_conv1d.weight": (p, 1, k), f"{prefix}.k_conv1d.weight": (p, 1, k),
                f"{prefix}.v_conv1d.weight": (p, 1, k),
                f"{prefix}.f_a_proj.weight": (dk, d), f"{prefix}.f_b_proj.weight": (p, dk),
                f"{prefix}.A_log": (1, 1, h, 1), f"{prefix}.dt_bias": (p,), f"{prefix}.b_proj.weight": (h, d),
                f"{prefix}.g_a_proj.weight": (dk, d), f"{prefix}.g_b_proj.weight": (p, dk),
                f"{prefix}.o_norm.weight": (dk,), f"{prefix}.o_proj.weight": (d, p)}


class KimiDeltaAttention:
    def __init__(self, cfg: KdaConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.cfg = cfg
        get = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.w_q, self.w_k, self.w_v = get("q_proj.weight"), get("k_proj.weight"), get("v_proj.weight")
        # [P, 1, K] in the checkpoint ([P, K] in some conversions): one [C, K] kernel for the q | k | v channels
        self.conv_w = torch.cat([get(f"{n}_conv1d.weight").reshape(cfg.proj_dim, cfg.conv_kernel)
                                 for n in ("q", "k", "v")]).float()
        self.w_fa, self.w_fb = get("f_a_proj.weight"), get("f_b_proj.weight")
        self.a = get("A_log").float().reshape(cfg.num_heads, 1).exp()  # exp(A_log) [H, 1]
        self.dt_bias = get("dt_bias").float().reshape(cfg.num_heads, cfg.head_dim)
        self.w_b, self.w_ga, self.w_gb = get("b_proj.weight"), get("g_a_proj.weight"), get("g_b_proj.weight")
        self.norm_w, self.w_out = get("o_norm.weight").float(), get("o_proj.weight")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"conv": (c.conv_dim, c.conv_kernel - 1), "recurrent": (c.num_heads, c.head_dim, c.head_dim)}

    def forward_row(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                    rule=None) -> torch.Tensor:
        """One sequence's ``x [T, D]`` -> ``[T, D]``; ``conv_state [C, K-1]`` and ``state [H, Dk, Dv]`` (float32)
        are read and updated in place. ``rule`` overrides the choice of recurrent / chunked (tests)."""
        c = self.cfg
        t, h, dk = x.shape[0], c.num_heads, c.head_dim
        x = x.float()
        mixed = torch.cat([linear(x, self.w_q), linear(x, self.w_k), linear(x, self.w_v)], dim=-1)  # [T, C]
        conv = F.silu(causal_conv(mixed, conv_state, self.conv_w))
        q, k, v = conv.view(t, 3, h, dk).unbind(1)
        q = _l2norm(q) * dk ** -0.5
        k = _l2norm(k)
        log_decay = -self.a * F.softplus(linear(linear(x, self.w_fa), self.w_fb).view(t, h, dk) + self.dt_bias)
        beta = torch.sigmoid(linear(x, self.w_b))  # [T, H]
        if rule is None:
            rule = chunked_kda if t >= CHUNKED_FROM else recurrent_kda
        out = rule(q, k, v, beta, log_decay, state)  # [T, H, Dv]
        gate = linear(linear(x, self.w_ga), self.w_gb).view(t, h, dk)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c.eps) * self.norm_w
        return linear((normed * torch.sigmoid(gate)).reshape(t, h * dk), self.w_out)

    def forward(self, x: torch.Tensor, lengths: list[int], conv_states, states, *, rows: list[int] | None = None,
                offsets: list[int] | None = None) -> torch.Tensor:
        """As ``GatedDeltaNet.forward`` (what ``gated_deltanet.LinearAttentionBlock`` calls): ``x [R, T, D]`` with
        sequence i's ``lengths[i]`` tokens at places ``offsets[i]..`` of row ``rows[i]`` -> ``[R, T, D]``."""
        return run_rows(self.forward_row, self.w_out.shape[0], x, lengths, conv_states, states, rows, offsets)
