"""Gated DeltaNet: the linear-attention layer of Qwen3-Next / Qwen3.5-MoE (torch path, any device).

Shapes: B rows, T new tokens, D hidden; Hk query/key heads of Dk, Hv value heads of Dv (Hv a
multiple of Hk: each key head serves Hv / Hk consecutive value heads); C = 2 * Hk * Dk + Hv * Dv
conv channels, K the conv kernel.

Per token t of a row: a depthwise causal conv (kernel K, SiLU) over the projected q, k, v channels,
q and k L2-normalised (q also scaled by Dk^-1/2), then the gated delta rule on the recurrent state
S [Hv, Dk, Dv]: S <- exp(g_t) * S; S <- S + k_t (beta_t * (v_t - S^T k_t))^T; o_t = S^T q_t, with
g_t = -exp(A_log) * softplus(a_t + dt_bias) and beta_t = sigmoid(b_t). The output is RMS-normed per
value head, gated by SiLU(z_t), and projected back to D. What a sequence carries from step to step
is its state: the last K-1 conv inputs ``[C, K-1]`` and S; ``forward`` reads and updates them in
``states`` (one row per sequence). Checked against transformers' Qwen3NextGatedDeltaNet
(tests/layers/test_gated_deltanet.py). Decode steps run the rule token by token
(``recurrent_delta_rule``, also the reference); a prefill of CHUNKED_FROM tokens or more runs the
chunk-parallel form (``chunked_delta_rule``, the WY form of the flash-linear-attention project):
128 tokens per set of matrix products, one triangular solve per chunk, one pass over the state per
chunk instead of per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moed.layers.causal_conv import causal_conv
from moed.layers.linear import linear


@dataclass(frozen=True)
class DeltaNetConfig:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float = 1e-6
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / _z / _b / _a; Qwen3-Next: in_proj_qkvz / _ba

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    # what the model-level code asks of a linear-attention config (mamba2.Mamba2Config answers the same)
    def layer(self, weights: dict[str, torch.Tensor], prefix: str) -> "GatedDeltaNet":
        return GatedDeltaNet(self, weights, prefix)

    def state_floats(self) -> int:
        """Floats of one sequence's state in one layer: the conv window and the delta-rule matrices."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.k_head_dim * self.v_head_dim

    def step_floats(self, tokens: int) -> int:
        """Floats of a step's temporaries: projections, conv input and output, the rule's inputs and outputs (the
        per-chunk matrices are small beside them)."""
        key, value = self.key_dim, self.value_dim
        projections = 2 * key + 2 * value + 2 * self.num_v_heads  # qkv, z, b, a
        return tokens * (2 * projections + 2 * (2 * key + value) + 3 * value)

    def weight_shapes(self, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
        d, p = hidden, prefix
        if self.split_projections:
            proj = {f"{p}.in_proj_qkv.weight": (self.conv_dim, d), f"{p}.in_proj_z.weight": (self.value_dim, d),
                    f"{p}.in_proj_b.weight": (self.num_v_heads, d), f"{p}.in_proj_a.weight": (self.num_v_heads, d)}
        else:
            proj = {f"{p}.in_proj_qkvz.weight": (2 * self.key_dim + 2 * self.value_dim, d),
                    f"{p}.in_proj_ba.weight": (2 * self.num_v_heads, d)}
        return {**proj, f"{p}.conv1d.weight": (self.conv_dim, 1, self.conv_kernel),
                f"{p}.dt_bias": (self.num_v_heads,), f"{p}.A_log": (self.num_v_heads,),
                f"{p}.norm.weight": (self.v_head_dim,), f"{p}.out_proj.weight": (d, self.value_dim)}

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear attention: {self.num_v_heads} value heads are not a multiple of "
                             f"{self.num_k_heads} key heads")
        if self.conv_kernel < 1:
            raise ValueError(f"linear attention: conv kernel {self.conv_kernel} must be >= 1")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class LinearAttentionBlock:
    """A gated DeltaNet as a decoder layer's token mixer: its per-sequence state lives in the KV cache
    object (``cache.state(layer, name)`` ``[slots, ...]``); a row whose step starts at token 0 starts from
    a zero state."""

    def __init__(self, net: "GatedDeltaNet", layer: int) -> None:
        self.net, self.layer = net, layer

    def cache_entries(self) -> dict[str, tuple[int, ...]]:
        return {}  # no per-token K/V

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.net.state_shapes()

    def forward(self, x: torch.Tensor, batch, cache, cos_sin) -> torch.Tensor:
        conv, rec = cache.state(self.layer, "conv"), cache.state(self.layer, "recurrent")
        slots = cache.state_slots(batch)
        for slot, start, n in zip(slots, batch.starts, batch.lengths):
            if n and start == 0:
                conv[slot].zero_()
                rec[slot].zero_()
        return self.net.forward(x, batch.lengths, [conv[s] for s in slots], [rec[s] for s in slots],
                                rows=batch.rows, offsets=batch.offsets)


class GatedDeltaNet:
    def __init__(self, cfg: DeltaNetConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.cfg = cfg
        get = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        if cfg.split_projections:
            self.w_qkv, self.w_z = get("in_proj_qkv.weight"), get("in_proj_z.weight")
            self.w_b, self.w_a = get("in_proj_b.weight"), get("in_proj_a.weight")
        else:
            self.w_qkvz, self.w_ba = get("in_proj_qkvz.weight"), get("in_proj_ba.weight")
        self.conv_w = get("conv1d.weight").reshape(cfg.conv_dim, cfg.conv_kernel).float()  # [C, K]
        self.dt_bias, self.a_log = get("dt_bias").float(), get("A_log").float()
        self.norm_w, self.w_out = get("norm.weight").float(), get("out_proj.weight")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence state: the last K-1 conv inputs and the recurrent matrix of every value head."""
        c = self.cfg
        return {"conv": (c.conv_dim, c.conv_kernel - 1), "recurrent": (c.num_v_heads, c.k_head_dim, c.v_head_dim)}

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> the conv input [T, C] (q, k, v channels), z [T, Hv, Dv], b and a [T, Hv].

        Qwen3-Next's projections group their outputs by key head: for each of the Hk key heads, its
        q (Dk), k (Dk), then the v and z of its Hv/Hk value heads; b and a likewise. Qwen3.5's are
        four plain projections.
        """
        c = self.cfg
        t = x.shape[0]
        if c.split_projections:  # q, k, v channels in order; z, b, a by value head
            x = x.float()
            return (linear(x, self.w_qkv), linear(x, self.w_z).view(t, c.num_v_heads, c.v_head_dim),
                    linear(x, self.w_b), linear(x, self.w_a))
        per = c.num_v_heads // c.num_k_heads
        qkvz = linear(x.float(), self.w_qkvz).view(t, c.num_k_heads, 2 * c.k_head_dim + 2 * per * c.v_head_dim)
        q, k, v, z = qkvz.split([c.k_head_dim, c.k_head_dim, per * c.v_head_dim, per * c.v_head_dim], dim=-1)
        ba = linear(x.float(), self.w_ba).view(t, c.num_k_heads, 2 * per)
        b, a = ba.split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)  # [T, C]
        return (mixed, z.reshape(t, c.num_v_heads, c.v_head_dim), b.reshape(t, c.num_v_heads),
                a.reshape(t, c.num_v_heads))

    def forward_row(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One sequence's ``x [T, D]`` -> ``[T, D]``; ``conv_state [C, K-1]`` and ``state [Hv, Dk, Dv]``
        (float32) are read and updated in place."""
        c = self.cfg
        t = x.shape[0]
        mixed, z, b, a = self._split(x)
        conv = F.silu(causal_conv(mixed, conv_state, self.conv_w))  # [T, C]
        q, k, v = conv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        rep = c.num_v_heads // c.num_k_heads
        q = _l2norm(q.reshape(t, c.num_k_heads, c.k_head_dim)).repeat_interleave(rep, dim=1) * c.k_head_dim ** -0.5
        k = _l2norm(k.reshape(t, c.num_k_heads, c.k_head_dim)).repeat_interleave(rep, dim=1)  # [T, Hv, Dk]
        v = v.reshape(t, c.num_v_heads, c.v_head_dim)
        beta = torch.sigmoid(b)  # [T, Hv]
        log_decay = -self.a_log.exp() * F.softplus(a + self.dt_bias)  # [T, Hv]
        rule = chunked_delta_rule if t >= CHUNKED_FROM else recurrent_delta_rule
        out = rule(q, k, v, beta, log_decay, state)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c.eps) * self.norm_w
        gated = (normed * F.silu(z)).reshape(t, c.value_dim)
        return linear(gated, self.w_out)

    def forward(self, x: torch.Tensor, lengths: list[int], conv_states, states, *, rows: list[int] | None = None,
                offsets: list[int] | None = None) -> torch.Tensor:
        """``x [R, T, D]`` with sequence i's ``lengths[i]`` tokens at places ``offsets[i]..`` of row ``rows[i]``
        (default: row i from place 0, right-padded) -> ``[R, T, D]`` (zeros where no sequence is); sequence i's
        states are ``conv_states[i]`` / ``states[i]`` (tensors updated in place: rows of a ``[B, ...]`` tensor,
        or views into a state store)."""
        return run_rows(self.forward_row, self.w_out.shape[0], x, lengths, conv_states, states, rows, offsets)


def run_rows(forward_row, width: int, x: torch.Tensor, lengths: list[int], conv_states, states,
             rows: list[int] | None, offsets: list[int] | None) -> torch.Tensor:
    """A recurrent layer over a step: ``forward_row(x [n, D], conv_state, state)`` for each sequence's segment,
    into a float32 ``[R, T, width]`` with zeros where no sequence is (the ``forward`` of every recurrent layer)."""
    out = torch.zeros(x.shape[0], x.shape[1], width, dtype=torch.float32, device=x.device)
    rows = list(range(len(lengths))) if rows is None else rows
    offsets = [0] * len(lengths) if offsets is None else offsets
    for seq, (row, off, n) in enumerate(zip(rows, offsets, lengths)):
        if n:
            out[row, off:off + n] = forward_row(x[row, off:off + n], conv_states[seq], states[seq])
    return out


CHUNKED_FROM = 16  # tokens of one row from which the chunk-parallel rule is the faster one
CHUNK = 128  # tokens per chunk: measured fastest on 2 cores at Qwen3-Next's head shape (64: 1.09 s, 128: 0.87 s per 8k)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         log_decay: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule token by token (the reference). ``q, k [T, H, Dk]``, ``v [T, H, Dv]``,
    ``beta, log_decay [T, H]``; ``state [H, Dk, Dv]`` (float32) is updated in place. Returns ``[T, H, Dv]``."""
    decay = log_decay.exp()
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    s = state
    for i in range(q.shape[0]):
        s = s * decay[i][:, None, None]
        recalled = torch.einsum("hkv,hk->hv", s, k[i])
        delta = (v[i] - recalled) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", s, q[i])
    state.copy_(s)
    return out


# decay factors below e^-30 are taken as 0: their products (through the triangular solve and the matmuls)
# would otherwise reach float32's subnormal range, which x86 computes ~100x slower (a head whose decay sums
# past -87 within a chunk made the whole chunk's arithmetic subnormal: 7x slower prefill, measured); the
# values dropped are below 1e-26 of the ones kept
DECAY_FLOOR = -30.0
SOLVE_FLOOR = 1e-30  # solved entries below this are dropped (float32's normal range ends at 1.2e-38)


def _decay(log_decay: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """exp(log_decay), 0 where log_decay is below DECAY_FLOOR (or where ``masked``)."""
    drop = log_decay < DECAY_FLOOR
    if masked is not None:
        drop |= masked
    return log_decay.masked_fill(drop, float("-inf")).exp_()


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       log_decay: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same rule, ``chunk`` tokens at a time (same arguments and result as ``recurrent_delta_rule``).

    Within a chunk, with G the cumulative log decay from the chunk's start, S0 the state before it and
    u_i the value token i writes (u_i = beta_i (v_i - S'_i^T k_i), S'_i the decayed state it reads):
    u = T (beta v) - T (beta e^G k) S0, where T = (I + diag(beta) A)^-1 and A_ij = e^(G_i - G_j) k_i.k_j
    for j < i (a unit lower-triangular solve); the outputs are o = e^G q S0 + (M * q k^T) u with
    M_ij = e^(G_i - G_j) for j <= i; the state after the chunk is e^G_C S0 + (e^(G_C - G) k)^T u.
    The last chunk may be shorter."""
    t, h, dk = k.shape
    dv = v.shape[2]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, device=q.device)
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    s = state.float()
    for start in range(0, t, chunk):  # one chunk at a time: its [H, C, C] and [H, C, D] tensors stay in cache
        end = min(start + chunk, t)
        m = end - start  # the last chunk may be shorter: the same algebra on fewer tokens
        qc, kc, vc = (x[start:end].transpose(0, 1).float().contiguous() for x in (q, k, v))  # [H, C, D]
        bc = beta[start:end].t().float()  # [H, C]
        # G: cumulative log decay within the chunk, summed in float64 (a head that spikes to -300 leaves float32 ~2e-5
        # of absolute error in the small differences of two G's); the differences rounded to float32 before the exp
        gc = log_decay[start:end].t().double().cumsum(-1)
        decay_ij = _decay((gc[:, :, None] - gc[:, None, :]).float(), ~causal[:m, :m])
        decay_g = _decay(gc.float())
        kk = kc @ kc.transpose(-1, -2)
        lower = (kk.mul_(decay_ij).mul_(bc[:, :, None])).tril_(-1).add_(eye[:m, :m])
        rhs = torch.cat([bc[..., None] * vc, (bc * decay_g)[..., None] * kc], dim=-1)  # [H, C, Dv + Dk]
        # float64: the solve's long products of small factors fall below float32's normal range (random keys:
        # ~6% of the entries), where x86 computes ~5-25x slower; what is that small is dropped before float32
        solved = torch.linalg.solve_triangular(lower.double(), rhs.double(), upper=False, unitriangular=True)
        solved = solved.masked_fill_(solved.abs() < SOLVE_FLOOR, 0.0).float()
        u = solved[..., :dv] - solved[..., dv:] @ s  # [H, C, Dv]: the values this chunk writes
        attn = (qc @ kc.transpose(-1, -2)).mul_(decay_ij)  # zero above the diagonal
        out[start:end] = ((qc * decay_g[..., None]) @ s + attn @ u).transpose(0, 1)
        last = gc[:, -1:]  # [H, 1]
        s = s * _decay(last.float())[..., None] + (kc * _decay((last - gc).float())[..., None]).transpose(-1, -2) @ u
    state.copy_(s)
    return out

