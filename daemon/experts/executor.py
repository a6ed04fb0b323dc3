"""The expert-executor seam: the MoE layer routes, an executor decides where each expert runs.

Contract: ``run(moe_layer, hidden [N, D], topk_ids [N, A], topk_weights [N, A]) -> [N, D]`` equals
``sum_a topk_weights[:, a] * expert_{topk_ids[:, a]}(hidden)``, summed over ``a`` in ascending
order so the result never depends on where an expert ran.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ExpertExecutor(Protocol):
    def run(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor: ...


def merge_expert_outputs(per_slot: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """per_slot [N, A, D] (output of the expert in top-k slot a), topk_weights [N, A] -> [N, D], fixed order."""
    out = per_slot[:, 0] * topk_weights[:, 0, None]
    for a in range(1, per_slot.shape[1]):
        out = out + per_slot[:, a] * topk_weights[:, a, None]
    return out
