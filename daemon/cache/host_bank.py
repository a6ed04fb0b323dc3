"""The host expert bank: every routed expert of every MoE layer, one contiguous tensor per kind.

An expert is addressed by one flat id, ``moe_layer * num_experts + expert``, where
``moe_layer`` counts MoE layers only (dense layers such as DeepSeek-V3's first ones take no
slots). Weights are stored input-major ("k-major", ``[K, N]`` per expert, the transpose of
``nn.Linear.weight``) so that ``x @ W`` needs no transpose and the CPU kernels stream rows
of the reduction dimension with long contiguous inner loops.

Layout by ``dtype`` (N = number of experts in the bank, D = hidden size, I = expert
intermediate size, G = INT4_GROUP_SIZE = 32, the group size of every packed format):

- ``fp32``: ``gate_up`` float32 ``[N, D, 2I]`` (columns ``[:I]`` gate, ``[I:]`` up),
  ``down`` float32 ``[N, I, D]``.
- ``bf16``: the same shapes in torch.bfloat16.
- ``int4``: per matrix ``M`` in (gate_up, down) with per-expert shape ``[K, Ncols]``:
  ``M.q`` uint8 ``[N, K, Ncols/2]`` (byte ``[k, j]``: low nibble = column ``j``, high
  nibble = column ``j + Ncols/2``), ``M.scale`` and ``M.min`` bfloat16 ``[N, K/G, Ncols]``;
  ``w[k, n] = q[k, n] * scale[k // G, n] + min[k // G, n]`` with ``q`` in 0..15.
- ``q8`` (GGUF Q8_0's block, symmetric): ``M.qs`` int8 ``[N, K, Ncols]``, ``M.d`` float16
  ``[N, K/G, Ncols]``; ``w[k, n] = qs[k, n] * d[k // G, n]`` (kernels/q8_format.py).
- ``mxfp4`` (OCP MX FP4, as gpt-oss ships): ``M.fp4`` uint8 ``[N, K, Ncols/2]`` (int4's nibble
  packing; each nibble an E2M1 code: bit 3 sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6),
  ``M.e8m0`` uint8 ``[N, K/G, Ncols]``; ``w[k, n] = e2m1(code[k, n]) * 2**(e8m0[k // G, n] - 127)``
  (kernels/mxfp4_format.py).
- ``ggml`` (a GGUF file's expert tensors as stored, kernels/ggml_rows_format.py): per MoE layer
  ``l`` and matrix ``M`` in (gate, up, down), ``M.{l}`` uint8 ``[E, rows, row_bytes]``, each expert
  the GGUF tensor's rows of blocks (gate/up: I rows of D weights; down: D rows of I weights), in
  the GGML type ``row_types["M.{l}"]`` (a layer's matrices may differ, as a Q4_K_M file's Q6_K
  down in some layers). Addressed by layer, not by flat id. Non-gated experts (Nemotron-H's relu^2)
  have no gate: ``gate.{l}`` is the ``up.{l}`` tensor itself (one copy in memory, read once). Optional
  ``M.{l}.scale`` float32 ``[E]``: a factor per expert on that matrix's outputs (an NVFP4
  checkpoint's per-tensor global scale; its blocks stay as stored).
- optional biases (gpt-oss), always float32: ``gate_up_bias`` ``[N, 2I]``, ``down_bias``
  ``[N, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moed.cache.expert_dtypes import EXPERT_DTYPES, GGML_BANK, PACKED_DTYPES  # noqa: F401  (re-exported)
from moed.kernels.int4_format import INT4_GROUP_SIZE  # noqa: F401  (re-exported: part of the bank layout)

ACTIVATIONS = ("silu", "gpt_oss", "clamped_silu", "relu2", "gelu_tanh")


@dataclass(frozen=True)
class ExpertActivation:
    """How gate and up combine: ``silu`` is SwiGLU; ``gpt_oss`` its clamped variant with a sigmoid gate and a
    shifted up; ``clamped_silu`` (DeepSeek-V4) SwiGLU on gate <= limit and |up| <= limit; ``relu2`` (Nemotron-H's
    non-gated relu(up)^2 experts, stored with their up matrix in the gate half too) max(gate, 0) * up; ``gelu_tanh``
    (Gemma-4) gelu(gate, tanh approximation) * up."""

    kind: str = "silu"
    alpha: float = 1.702  # gpt_oss only
    limit: float = 7.0  # gpt_oss and clamped_silu

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not one of {ACTIVATIONS}")


@dataclass
class ExpertBank:
    """All routed experts in host memory; the source of truth, always complete."""

    num_moe_layers: int
    num_experts: int
    hidden_size: int  # D
    intermediate_size: int  # I
    dtype: str  # one of EXPERT_DTYPES, or GGML_BANK
    activation: ExpertActivation
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    row_types: dict[str, int] = field(default_factory=dict)  # ggml bank: tensor name -> GGML type id

    @property
    def num_slots(self) -> int:
        return self.num_moe_layers * self.num_experts

    def flat_id(self, moe_layer: int, expert: int) -> int:
        return moe_layer * self.num_experts + expert

    @property
    def has_bias(self) -> bool:
        return "gate_up_bias" in self.tensors

    def bytes_per_expert(self) -> int:
        """Bytes read to run one expert once (all of its tensors; a ggml bank's average over layers)."""
        if self.dtype == GGML_BANK:
            return self.nbytes() // max(1, self.num_slots)
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def ggml_matrix(self, kind: str, moe_layer: int) -> tuple[torch.Tensor, int]:
        """A ggml bank's ``kind`` (gate, up or down) of one MoE layer: ``(uint8 [E, rows, row_bytes], GGML type)``."""
        name = f"{kind}.{moe_layer}"
        return self.tensors[name], self.row_types[name]

    def ggml_scale(self, kind: str, moe_layer: int) -> torch.Tensor | None:
        """A ggml bank matrix's factor per expert (float32 ``[E]``, on the outputs), or None (1)."""
        return self.tensors.get(f"{kind}.{moe_layer}.scale")

    def storage(self) -> list[torch.Tensor]:
        """The bank's tensors, each once (a ggml bank's non-gated experts hold one tensor under two names)."""
        seen: dict[int, torch.Tensor] = {}
        for t in self.tensors.values():
            seen.setdefault(id(t), t)
        return list(seen.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage())

    def gate_is_up(self, moe_layer: int) -> bool:
        """A ggml bank's non-gated layer: its gate is its up matrix (relu^2 experts; the kernels read it once)."""
        return self.dtype == GGML_BANK and self.tensors.get(f"gate.{moe_layer}") is self.tensors.get(f"up.{moe_layer}")
