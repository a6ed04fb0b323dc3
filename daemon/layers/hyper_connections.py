"""Manifold-constrained hyper-connections (DeepSeek-V4's residual stream, issue #33; paper section 2.2).

The residual is ``n`` parallel streams ``[T, n, D]`` instead of one ``[T, D]``. Before a block (attention
or MoE) a learned projection of the RMS-normalised, flattened streams gives three mixes per token:

- ``pre``  ``[T, n]``: sigmoid(.) + eps, the weights that collapse the streams into the block's input;
- ``post`` ``[T, n]``: 2 sigmoid(.), how the block's output is spread back over the streams;
- ``comb`` ``[T, n, n]``: softmax(.) + eps, projected towards a doubly-stochastic matrix by Sinkhorn-Knopp
  (``iters`` alternating column / row normalisations, columns first), which mixes the old streams.

After the block, ``streams' = post * out + comb^T @ streams``. The head collapses the final streams with
its own ``pre`` mix before the last norm. All of it runs in float32 (transformers' reference keeps these
weights in float32 too); ``HyperConnectionConfig`` holds ``n``, the Sinkhorn iterations and the eps.

Weights (per transformers' DeepSeek-V4 checkpoints): ``fn [(2 + n) n, n D]``, ``base [(2 + n) n]``, ``scale [3]``
for a block; ``hc_fn [n, n D]``, ``hc_base [n]``, ``hc_scale [1]`` for the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HyperConnectionConfig:
    streams: int  # n (config hc_mult)
    sinkhorn_iters: int  # t_max (config hc_sinkhorn_iters)
    eps: float  # the Sinkhorn floor (config hc_eps)
    norm_eps: float  # the unweighted RMSNorm's (config rms_norm_eps)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb [..., n, n]`` (positive) towards doubly stochastic: a column normalisation, then ``iters - 1``
    rounds of row then column normalisation, each denominator floored by ``eps``."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def block_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                cfg: HyperConnectionConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [T, n, D]`` -> ``(post [T, n], comb [T, n, n], collapsed [T, D])``, float32: the block's input
    is ``collapsed`` (the streams weighted by ``pre``)."""
    n = cfg.streams
    flat = _rms(streams.reshape(streams.shape[0], -1).float(), cfg.norm_eps)
    mixes = flat @ fn.float().t()  # [T, (2 + n) n]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + cfg.eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + cfg.eps
    comb = sinkhorn(comb, cfg.sinkhorn_iters, cfg.eps)
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
    return post, comb, collapsed


def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``post * out`` spread over the streams plus ``comb^T @ streams``, float32
    ``[T, n, D]``."""
    return post.unsqueeze(-1) * block_out.float().unsqueeze(1) + comb.transpose(-1, -2) @ streams.float()


def head_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  cfg: HyperConnectionConfig) -> torch.Tensor:
    """The final streams ``[T, n, D]`` collapsed to ``[T, D]`` (float32) before the model's last norm."""
    flat = _rms(streams.reshape(streams.shape[0], -1).float(), cfg.norm_eps)
    pre = torch.sigmoid((flat @ fn.float().t()) * scale.float() + base.float()) + cfg.eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1)


def expand(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """The embeddings ``[T, D]`` as ``n`` identical streams ``[T, n, D]`` (the residual's start)."""
    return hidden.float().unsqueeze(1).expand(-1, streams, -1).contiguous()
