"""Mamba-2: the selective state-space layer of NVIDIA Nemotron-H (torch path, any device).

Shapes: T new tokens of one row, D hidden; H heads of P channels (I = H * P), G groups of B / C of N state
channels (head h reads group h // (H / G)), K the conv kernel, C = I + 2 * G * N conv channels.

Per token t: ``in_proj`` gives z [I], the conv input xBC [C] and dt [H]; xBC goes through a depthwise causal
conv (kernel K, bias, SiLU) and splits into x [H, P], B [G, N] and C [G, N]; with dt = softplus(dt + dt_bias)
(clamped to ``time_step_limit``) and A = -exp(A_log), each head's state S [P, N] becomes
S <- exp(dt A) S + dt x B^T and y = S C + D x. The output is gated by SiLU(z), RMS-normed per group of I / G
channels (gate first, then norm), scaled by the norm weight and projected back to D (``out_proj``).

What a sequence carries from step to step is its state: the last K-1 conv inputs ``[C, K-1]`` and S of every
head ``[H, P, N]`` (float32); ``forward`` reads and updates them in ``states`` (one row per sequence), as the
gated DeltaNet does (``gated_deltanet.LinearAttentionBlock`` runs either). Decode steps run the recurrence
token by token (``recurrent_ssd``, also the reference); a prefill of CHUNKED_FROM tokens or more runs the
chunked form (``chunked_ssd``: the state-space duality of Mamba-2, a few matrix products per chunk of CHUNK
tokens and one pass over the state per chunk). Checked against transformers' NemotronHMamba2Mixer
(tests/layers/test_mamba2.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moed.layers.causal_conv import causal_conv
from moed.layers.gated_deltanet import _decay, run_rows
from moed.layers.linear import linear


@dataclass(frozen=True)
class Mamba2Config:
    num_heads: int  # H (mamba_num_heads)
    head_dim: int  # P (mamba_head_dim)
    num_groups: int  # G (n_groups)
    state_size: int  # N (ssm_state_size)
    conv_kernel: int  # K
    eps: float = 1e-5  # the gated norm's (layer_norm_epsilon)
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj biases (use_bias)
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = math.inf

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_dim + 2 * self.num_groups * self.state_size

    @property
    def projection_dim(self) -> int:
        return self.inner_dim + self.conv_dim + self.num_heads  # z | xBC | dt

    def __post_init__(self) -> None:
        if min(self.num_heads, self.head_dim, self.num_groups, self.state_size, self.conv_kernel) < 1:
            raise ValueError("mamba2: heads, head size, groups, state size and conv kernel must be positive")
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba2: {self.num_heads} heads are not a multiple of {self.num_groups} groups")
        if not 0.0 <= self.dt_min <= self.dt_max:
            raise ValueError(f"mamba2: time_step_limit ({self.dt_min}, {self.dt_max}) is not a range")

    # what the model-level code asks of a linear-attention config (DeltaNetConfig answers the same)
    def layer(self, weights: dict[str, torch.Tensor], prefix: str) -> "Mamba2Mixer":
        return Mamba2Mixer(self, weights, prefix)

    def state_floats(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_size

    def step_floats(self, tokens: int) -> int:
        """Floats of a step's temporaries: the projections, conv input and output, x / y / z / gated, and one
        chunk's per-head matrices."""
        chunk = min(tokens, CHUNK)
        per_token = 2 * self.projection_dim + 2 * self.conv_dim + 4 * self.inner_dim
        return tokens * per_token + 3 * self.num_heads * chunk * chunk

    def weight_shapes(self, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
        shapes = {f"{prefix}.in_proj.weight": (self.projection_dim, hidden),
                  f"{prefix}.conv1d.weight": (self.conv_dim, 1, self.conv_kernel),
                  f"{prefix}.dt_bias": (self.num_heads,), f"{prefix}.A_log": (self.num_heads,),
                  f"{prefix}.D": (self.num_heads,), f"{prefix}.norm.weight": (self.inner_dim,),
                  f"{prefix}.out_proj.weight": (hidden, self.inner_dim)}
        if self.conv_bias:
            shapes[f"{prefix}.conv1d.bias"] = (self.conv_dim,)
        if self.proj_bias:
            shapes[f"{prefix}.in_proj.bias"] = (self.projection_dim,)
            shapes[f"{prefix}.out_proj.bias"] = (hidden,)
        return shapes


class Mamba2Mixer:
    def __init__(self, cfg: Mamba2Config, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.cfg = cfg
        get = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.w_in, self.b_in = get("in_proj.weight"), weights.get(f"{prefix}.in_proj.bias")
        self.conv_w = get("conv1d.weight").reshape(cfg.conv_dim, cfg.conv_kernel).float()  # [C, K]
        self.conv_b = weights[f"{prefix}.conv1d.bias"].float() if cfg.conv_bias else None
        self.dt_bias, self.a = get("dt_bias").float(), -get("A_log").float().exp()
        self.d_skip, self.norm_w = get("D").float(), get("norm.weight").float()
        self.w_out, self.b_out = get("out_proj.weight"), weights.get(f"{prefix}.out_proj.bias")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence state: the last K-1 conv inputs and every head's state matrix."""
        c = self.cfg
        return {"conv": (c.conv_dim, c.conv_kernel - 1), "recurrent": (c.num_heads, c.head_dim, c.state_size)}

    def forward_row(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One sequence's ``x [T, D]`` -> ``[T, D]``; ``conv_state [C, K-1]`` and ``state [H, P, N]`` (float32)
        are read and updated in place."""
        c = self.cfg
        t = x.shape[0]
        zxbcdt = linear(x.float(), self.w_in, self.b_in)
        z, xbc, dt = zxbcdt.split([c.inner_dim, c.conv_dim, c.num_heads], dim=-1)
        conv = F.silu(causal_conv(xbc, conv_state, self.conv_w, self.conv_b))  # [T, C]
        xs, b, cc = conv.split([c.inner_dim, c.num_groups * c.state_size, c.num_groups * c.state_size], dim=-1)
        xs = xs.reshape(t, c.num_heads, c.head_dim)
        b, cc = b.reshape(t, c.num_groups, c.state_size), cc.reshape(t, c.num_groups, c.state_size)
        dt = F.softplus(dt + self.dt_bias)
        if c.dt_min > 0.0 or c.dt_max < math.inf:
            dt = dt.clamp(c.dt_min, c.dt_max)
        ssd = chunked_ssd if t >= CHUNKED_FROM else recurrent_ssd
        y = ssd(xs, dt, self.a, b, cc, state) + self.d_skip[:, None] * xs  # [T, H, P]
        gated = y.reshape(t, c.inner_dim) * F.silu(z)
        grouped = gated.view(t, c.num_groups, -1)
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + c.eps)).reshape(t, c.inner_dim)
        return linear(normed * self.norm_w, self.w_out, self.b_out)

    def forward(self, x: torch.Tensor, lengths: list[int], conv_states, states, *, rows: list[int] | None = None,
                offsets: list[int] | None = None) -> torch.Tensor:
        """``x [R, T, D]`` with sequence i's ``lengths[i]`` tokens at places ``offsets[i]..`` of row ``rows[i]``
        (default: row i from place 0) -> ``[R, T, D]`` (zeros where no sequence is); sequence i's states are
        ``conv_states[i]`` / ``states[i]``, updated in place."""
        return run_rows(self.forward_row, self.w_out.shape[0], x, lengths, conv_states, states, rows, offsets)


CHUNKED_FROM = 8  # tokens of one row from which the chunked form is the faster one
CHUNK = 128  # tokens per chunk (Nemotron-H's chunk_size; the result does not depend on it)


def _per_head(groups: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: head h reads group h // (H / G)."""
    return groups.repeat_interleave(heads // groups.shape[-2], dim=-2)


def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  state: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token (the reference). ``x [T, H, P]``, ``dt [T, H]``, ``a [H]`` (negative),
    ``b, c [T, G, N]``; ``state [H, P, N]`` (float32) is updated in place. Returns ``y [T, H, P]`` (without the
    D skip)."""
    heads = x.shape[1]
    bh, ch = _per_head(b, heads), _per_head(c, heads)  # [T, H, N]
    decay = (dt * a).exp()  # [T, H]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    s = state
    for i in range(x.shape[0]):
        s = s * decay[i][:, None, None] + (dt[i][:, None] * x[i])[:, :, None] * bh[i][:, None, :]
        out[i] = torch.einsum("hpn,hn->hp", s, ch[i])
    state.copy_(s)
    return out


def chunked_ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same recurrence, ``chunk`` tokens at a time (same arguments and result as ``recurrent_ssd``).

    Within a chunk, with L_i the cumulative log decay (sum of dt_j a up to token i) and S0 the state before it:
    y_i = sum_{j <= i} exp(L_i - L_j) (C_i . B_j) dt_j x_j + exp(L_i) S0 C_i, and the state after the chunk is
    exp(L_m) S0 + sum_j exp(L_m - L_j) dt_j x_j B_j^T. C . B is computed per group and shared by its heads.
    Decay factors below e^-30 are 0 (gated_deltanet's floor: no subnormal arithmetic)."""
    t, heads, p = x.shape
    groups = b.shape[1]
    rep = heads // groups
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    out = torch.empty(t, heads, p, dtype=torch.float32, device=x.device)
    s = state.float()
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        m = end - start
        xc = x[start:end].float()  # [m, H, P]
        dtc = dt[start:end].float()  # [m, H]
        bc, cc = b[start:end].float().transpose(0, 1), c[start:end].float().transpose(0, 1)  # [G, m, N]
        log_a = (dtc * a).t().cumsum(-1)  # [H, m]
        decay_ij = _decay(log_a[:, :, None] - log_a[:, None, :], ~causal[:m, :m])  # [H, m, m]
        cb = (cc @ bc.transpose(-1, -2)).repeat_interleave(rep, dim=0)  # [H, m, m]
        xdt = (xc * dtc[..., None]).transpose(0, 1)  # [H, m, P]
        ch = cc.repeat_interleave(rep, dim=0)  # [H, m, N]
        y = (cb.mul_(decay_ij)) @ xdt  # within the chunk
        y += (ch @ s.transpose(-1, -2)) * _decay(log_a)[..., None]  # from the state before it
        out[start:end] = y.transpose(0, 1)
        last = log_a[:, -1:]  # [H, 1]
        bh = bc.repeat_interleave(rep, dim=0)  # [H, m, N]
        s = s * _decay(last)[..., None] + (xdt * _decay(last - log_a)[..., None]).transpose(-1, -2) @ bh
    state.copy_(s)
    return out
