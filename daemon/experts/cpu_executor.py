"""CpuExecutor: every routed expert runs on the CPU from the host expert bank (numba kernels)."""

from __future__ import annotations

import torch

from moed.cache.host_bank import ExpertBank
from moed.experts.engine_stats import EngineStats
from moed.experts.executor import merge_expert_outputs
from moed.experts.expert_ffn import run_expert
from moed.experts.routed_ffn import run_routed, uses_native


class CpuExecutor:
    def __init__(self, bank: ExpertBank) -> None:
        self.bank = bank
        self.num_experts_run = 0  # (layer, expert) executions, for status and tests
        self.stats = EngineStats(device="cpu", policy="cpu-all")

    def run(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        if uses_native(self.bank, num_tokens):  # every routed expert of the layer in one native call
            flat = topk_ids + self.bank.flat_id(moe_layer, 0)
            _, y = run_routed(self.bank, hidden, flat, topk_weights)
            self.count_native(len(set(flat.view(-1).tolist())))
            return y
        per_slot = hidden.new_empty(num_tokens, top_k, hidden.shape[1])  # [N, A, D]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist()):
            picks = order[start : start + count]  # positions in the flattened [N * A]
            start += count
            tokens = picks // top_k
            out = run_expert(self.bank, self.bank.flat_id(moe_layer, expert), hidden[tokens].contiguous())
            per_slot.view(-1, hidden.shape[1])[picks] = out
        self.num_experts_run += len(experts)
        self.stats.misses += len(experts)
        self.stats.cpu_experts += len(experts)
        return merge_expert_outputs(per_slot, topk_weights)

    def whole_cpu_bank(self) -> ExpertBank:
        """The bank every expert runs from on the CPU (the model's native decode chain runs them itself)."""
        return self.bank

    def count_native(self, n_experts: int) -> None:
        """Account ``n_experts`` (layer, expert) executions run natively (here or by the decode chain)."""
        self.num_experts_run += n_experts
        self.stats.misses += n_experts
        self.stats.cpu_experts += n_experts

    def close(self) -> None:
        pass
