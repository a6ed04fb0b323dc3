"""DeepSeek-V4's KV compressors (issue #33; paper sections 2.3.1-2.3.2): windows of ``r`` tokens pooled into one
compressed key/value entry, in one pass over a whole sequence (``compress``) or a token at a time (``OpenWindows``,
the state a paged cache keeps between steps).

Each token projects to ``kv`` and ``gate`` (``Linear(D, c)`` each); gate + a learned per-slot ``bias`` gives the
weights of a per-channel softmax over the window's slots, and the entry is ``kv_norm(sum softmax(gate) * kv)``
with the compress rotary applied at the window's first position ``w r`` (pairs in place on the trailing
``rope_dim`` channels, ``rope_pairs``). Two kinds:

- heavily compressed (HCA, ``r`` = 128 in V4): ``c = head_dim``, non-overlapping windows of ``r`` slots;
- compressed sparse (CSA, ``r`` = 4, and the lightning indexer's own compressor): ``c = 2 head_dim``, each token
  giving two series, ``Ca`` (its first half: a slot of the *next* window's entry) and ``Cb`` (its second half: a
  slot of its own window's entry), so entry ``w`` pools ``2 r`` slots: window ``w - 1``'s ``Ca`` then window
  ``w``'s ``Cb`` (entry 0 has only its ``Cb``).

``OpenWindows`` pools the open window(s) online: per channel a running max, a running sum of exp(gate - max) and
of exp(gate - max) * kv, rescaled when the max grows, so the state is 3 vectors per open entry (two for CSA:
the entry being closed and the next one's ``Ca`` part) whatever ``r`` is, and an entry is emitted when its
window's last token arrives. Its entries equal ``compress``'s up to float rounding (tested): the form moed's
paged cache will keep between steps, checkpointed like a hybrid model's recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moed.layers.layer_config import AttentionConfig
from moed.layers.linear import linear
from moed.layers.rotary import RotaryEmbedding


def cache_entries_for(att: AttentionConfig, ratio: int, indexer: bool) -> dict[str, tuple[int, ...]]:
    """A V4 attention layer's per-token entries in the paged pool (docs/design.md, DeepSeek-V4): the shared K=V
    row, and for a compressed layer its entries sliced over their windows' slots (head_dim / ratio a token),
    the indexer's keys too on a CSA layer."""
    entries = {"kv": (att.head_dim,)}
    if ratio:
        entries["ckv"] = (att.head_dim // ratio,)
        if indexer:
            entries["cidx"] = (att.index_head_dim // ratio,)
    return entries


def open_window_floats(att: AttentionConfig, ratio: int, indexer: bool) -> int:
    """Floats of one sequence's open-window state on one layer (``OpenWindows``: 3 vectors a pool; CSA keeps two
    pools for its entries and two for its indexer's)."""
    if not ratio:
        return 0
    return 3 * (2 * att.head_dim + 2 * att.index_head_dim if indexer else att.head_dim)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., C]`` with its trailing ``2 R`` channels rotated as pairs (x0, x1), (x2, x3)... in place (the pair
    layout kept: V4 reads its rotated keys as values too); ``cos``/``sin`` ``[..., R]`` broadcast over ``x``'s
    leading dims. ``sin`` negated rotates back."""
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


@dataclass(frozen=True)
class CompressorWeights:
    """One compressor's weights (transformers names: ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``)."""

    kv_proj: torch.Tensor  # [c, D]
    gate_proj: torch.Tensor  # [c, D]
    position_bias: torch.Tensor  # [r, c]
    kv_norm: torch.Tensor  # [head_dim]
    overlap: bool  # CSA (two series per token) or HCA

    @property
    def ratio(self) -> int:
        return self.position_bias.shape[0]

    @property
    def head_dim(self) -> int:
        return self.kv_norm.shape[0]


def project(w: CompressorWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [T, D]`` -> (kv, gate) ``[T, c]`` float32 (the bias is added per slot later)."""
    h = hidden.float()
    return linear(h, w.kv_proj), linear(h, w.gate_proj)


def finish(w: CompressorWeights, pooled: torch.Tensor, first_positions: torch.Tensor, rotary: RotaryEmbedding,
           eps: float) -> torch.Tensor:
    """Pooled windows ``[W, head_dim]`` -> entries: kv_norm, then the compress rotary at each window's first
    position ``[W]``."""
    normed = _rms_norm(pooled, w.kv_norm, eps)
    cos, sin = rotary.cos_sin(first_positions.view(1, -1))
    return rope_pairs(normed, cos[0], sin[0])


def compress(w: CompressorWeights, hidden: torch.Tensor, rotary: RotaryEmbedding, eps: float) -> torch.Tensor:
    """Every whole window of ``hidden [T, D]`` (positions 0..T-1) as entries ``[T // r, head_dim]`` float32, the
    trailing partial window left out (the reference form: one pass, a softmax per window)."""
    r, hd = w.ratio, w.head_dim
    n = hidden.shape[0] // r
    kv, gate = project(w, hidden[: n * r])
    kv, gate = kv.view(n, r, -1), gate.view(n, r, -1) + w.position_bias.float()
    if w.overlap:  # slots: window w-1's Ca (first halves), then window w's Cb (second halves)
        slot_kv = torch.zeros(n, 2 * r, hd)
        slot_gate = torch.full((n, 2 * r, hd), float("-inf"))
        slot_kv[:, r:], slot_gate[:, r:] = kv[..., hd:], gate[..., hd:]
        slot_kv[1:, :r], slot_gate[1:, :r] = kv[:-1, :, :hd], gate[:-1, :, :hd]
        kv, gate = slot_kv, slot_gate
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    return finish(w, pooled, torch.arange(n) * r, rotary, eps)


@dataclass
class _Pool:
    """An online softmax over slots, per channel: running max ``m``, sums ``s`` and ``a``."""

    m: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor

    @classmethod
    def empty(cls, c: int) -> "_Pool":
        return cls(torch.full((c,), float("-inf")), torch.zeros(c), torch.zeros(c))

    def add(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        m = torch.maximum(self.m, gate)
        old = torch.exp(self.m - m)  # exp(-inf) = 0 for a fresh pool
        new = torch.exp(gate - m)
        self.s = self.s * old + new
        self.a = self.a * old + new * kv
        self.m = m

    def value(self) -> torch.Tensor:
        return self.a / self.s


@dataclass
class OpenWindows:
    """One sequence's open window(s) of one compressor, fed a token at a time (``add``), emitting each entry
    when its window closes. ``position`` is the next token's position (a resumed prefix starts from its state)."""

    weights: CompressorWeights
    position: int = 0
    current: _Pool | None = None
    following: _Pool | None = None  # CSA: the next entry's Ca slots, gathered while the current window runs
    entries: list[torch.Tensor] = field(default_factory=list)

    def add(self, hidden: torch.Tensor, rotary: RotaryEmbedding, eps: float) -> list[torch.Tensor]:
        """Feed ``hidden [T, D]`` (the next T tokens); returns the entries (``[head_dim]``) their windows closed."""
        w, r, hd = self.weights, self.weights.ratio, self.weights.head_dim
        kv, gate = project(w, hidden)
        bias = w.position_bias.float()
        emitted = []
        for t in range(hidden.shape[0]):
            slot = self.position % r
            if self.current is None:
                self.current = _Pool.empty(hd)
            g = gate[t] + bias[slot]
            if w.overlap:
                if self.following is None:
                    self.following = _Pool.empty(hd)
                self.current.add(kv[t, hd:], g[hd:])
                self.following.add(kv[t, :hd], g[:hd])
            else:
                self.current.add(kv[t], g)
            self.position += 1
            if slot == r - 1:
                first = torch.tensor([self.position - r])
                emitted.append(finish(w, self.current.value().view(1, -1), first, rotary, eps)[0])
                self.current, self.following = self.following, None
        self.entries.extend(emitted)
        return emitted
