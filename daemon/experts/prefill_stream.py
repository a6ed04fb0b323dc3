"""Full-layer double-buffered prefill: while layer l computes from one buffer, the link fills the other.

docs/design.md, "Prefill". A prefill step touches nearly every expert of every layer, so the
hybrid executor streams whole layers instead of splitting misses: two layer-sized buffers at the
top of the slot pool (the expert cache gives them up for the prefill: it shrinks by two layers,
keeping its most valuable entries, and grows back at the next decode step); layer l+1's copy is
queued before layer l computes, before l+1's routing is known (the copy waits only for the
compute that last read its buffer); layer 0's at the start of each step. With room for one layer
only, each layer's routed experts are copied on demand once its routing is known, and compute
waits for them (no overlap). With less than a layer, prefill takes the split policy like decode.

Control code only: which layer sits in which buffer, and the copies in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STREAM_MIN_TOKENS = 64  # a prefill step with fewer tokens takes the split policy (few experts each)


def stream_buffers(num_slots: int, num_experts: int, want: int) -> int:
    """Layer buffers a pool of ``num_slots`` slots can give a prefill: ``want`` (1 or 2) or fewer, 0 if none."""
    if want not in (1, 2):
        raise ValueError(f"prefill buffers must be 1 (on-demand loading) or 2 (double buffering), got {want}")
    return min(want, num_slots // num_experts) if num_experts > 0 else 0


@dataclass
class PrefillStream:
    """The buffers of one streamed prefill (from its first step to the next decode step)."""

    num_buffers: int  # 2: double buffering; 1: on-demand loading
    base_slot: int  # buffer b holds slots base_slot + b * num_experts ...
    num_experts: int
    num_layers: int
    pending: dict[int, object] = field(default_factory=dict)  # moe layer -> copy handle of its whole-layer load

    def buffer_of(self, moe_layer: int) -> int:
        return moe_layer % self.num_buffers

    def slot(self, moe_layer: int, expert: int) -> int:
        """The slot that holds ``expert`` of ``moe_layer`` while that layer is loaded."""
        return self.base_slot + self.buffer_of(moe_layer) * self.num_experts + expert

    def layer_slots(self, moe_layer: int) -> list[int]:
        first = self.slot(moe_layer, 0)
        return list(range(first, first + self.num_experts))

    @property
    def double(self) -> bool:
        return self.num_buffers == 2
