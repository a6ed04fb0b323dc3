"""Synthetic Qwen3-MoE Hugging Face checkpoints of any size, written one layer at a time.

For memory tests and benchmarks of `moed convert`: the writer itself holds one layer's tensors
at a time (one safetensors shard per decoder layer, plus one for embeddings / final norm /
lm_head), so it can write a real-size Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts
x 768, 32 q / 4 kv heads x 128, vocab 151936 upstream; 49152 here by default) without needing
the model's size in RAM.

Tensor names and shapes are those transformers' ``save_pretrained`` writes for
``Qwen3MoeForCausalLM`` (the on-disk checkpoint layout: per-expert
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers >= 5 fuses the
experts in its in-memory ``state_dict`` and unfuses them on save).  ``expected_tensor_shapes``
gives the same table without writing anything; tests/weights/test_streaming_memory.py checks it
against a tiny transformers model.  config.json is what ``transformers.Qwen3MoeConfig(...)``
writes (``config.save_pretrained``).

Weights are random: ``randn * 0.02`` (norm weights 1), generated directly in ``dtype``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHARD_PATTERN = "model-{i:05d}-of-{n:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def qwen3_moe_config(*, num_layers: int, hidden: int = 2048, num_experts: int = 128, moe_intermediate: int = 768,
                     top_k: int = 8, num_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 128,
                     vocab: int = 49152, dtype: torch.dtype = torch.bfloat16):
    """The ``transformers.Qwen3MoeConfig`` of the synthetic checkpoint (all layers MoE)."""
    import transformers as tf

    return tf.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=6144,  # the dense-MLP size of Qwen3-30B-A3B; unused (no mlp_only_layers)
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        # the tiny test tokenizer's specials (tests/helpers/tiny_tokenizer.py): pad 0, bos 1, eos <|im_end|> 3
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=3,
        dtype=dtype,
        architectures=["Qwen3MoeForCausalLM"],
    )


def _layer_shapes(i: int, *, hidden: int, num_experts: int, moe_intermediate: int, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
        p + "self_attn.q_norm.weight": (head_dim,),
        p + "self_attn.k_norm.weight": (head_dim,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "mlp.gate.weight": (num_experts, hidden),
    }
    for e in range(num_experts):
        q = f"{p}mlp.experts.{e}."
        shapes[q + "gate_proj.weight"] = (moe_intermediate, hidden)
        shapes[q + "up_proj.weight"] = (moe_intermediate, hidden)
        shapes[q + "down_proj.weight"] = (hidden, moe_intermediate)
    return shapes


def _outer_shapes(*, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    return {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }


def expected_tensor_shapes(*, num_layers: int, hidden: int = 2048, num_experts: int = 128, moe_intermediate: int = 768,
                           num_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 128,
                           vocab: int = 49152, **_ignored) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> shape the checkpoint holds (nothing is written)."""
    shapes = dict(_outer_shapes(hidden=hidden, vocab=vocab))
    for i in range(num_layers):
        shapes.update(_layer_shapes(i, hidden=hidden, num_experts=num_experts, moe_intermediate=moe_intermediate,
                                    num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim))
    return shapes


def checkpoint_nbytes(*, dtype: torch.dtype = torch.bfloat16, **sizes) -> int:
    """Bytes of tensor data the checkpoint holds (safetensors headers excluded)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for shape in expected_tensor_shapes(**sizes).values():
        n = 1
        for d in shape:
            n *= d
        total += n * itemsize
    return total


def _make(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # input/post_attention_layernorm, q_norm, k_norm, model.norm
        return torch.ones(shape, dtype=dtype)
    t = torch.randn(shape, generator=gen, dtype=dtype)
    return t.mul_(0.02)


def write_qwen3_moe_checkpoint(dst: str | Path, *, num_layers: int, hidden: int = 2048, num_experts: int = 128,
                               moe_intermediate: int = 768, top_k: int = 8, num_heads: int = 32,
                               num_kv_heads: int = 4, head_dim: int = 128, vocab: int = 49152,
                               dtype: torch.dtype = torch.bfloat16, seed: int = 0, tokenizer: bool = True) -> Path:
    """Write a random Qwen3-MoE Hugging Face directory at ``dst`` (created); return ``dst``.

    Files: config.json, model-0000k-of-0000n.safetensors (shard 1: embeddings, final norm,
    lm_head; shard 2 + i: decoder layer i), model.safetensors.index.json, and with
    ``tokenizer=True`` the tiny test tokenizer (tokenizer.json, tokenizer_config.json).
    Peak memory of the writer is about one layer's tensors.
    """
    from safetensors.torch import save_file

    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = qwen3_moe_config(num_layers=num_layers, hidden=hidden, num_experts=num_experts,
                              moe_intermediate=moe_intermediate, top_k=top_k, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, vocab=vocab, dtype=dtype)
    config.save_pretrained(dst)  # config.json exactly as transformers writes it

    gen = torch.Generator().manual_seed(seed)
    num_shards = num_layers + 1
    weight_map: dict[str, str] = {}
    total_size = 0
    groups = [_outer_shapes(hidden=hidden, vocab=vocab)] + [
        _layer_shapes(i, hidden=hidden, num_experts=num_experts, moe_intermediate=moe_intermediate,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        for i in range(num_layers)
    ]
    for k, shapes in enumerate(groups):
        shard = SHARD_PATTERN.format(i=k + 1, n=num_shards)
        tensors = {name: _make(name, shape, dtype, gen) for name, shape in shapes.items()}
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = shard
            total_size += t.numel() * t.element_size()
        del tensors  # the next shard reuses the memory: the writer holds one layer at a time
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    if tokenizer:
        from helpers.tiny_tokenizer import write_tiny_tokenizer

        write_tiny_tokenizer(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    """``python tests/helpers/synthetic_checkpoint.py DST --layers N [--hidden ...]``: write one checkpoint."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tokenizer", action="store_true")
    a = parser.parse_args(argv)
    write_qwen3_moe_checkpoint(a.dst, num_layers=a.layers, hidden=a.hidden, num_experts=a.experts,
                               moe_intermediate=a.inter, top_k=a.top_k, num_heads=a.heads, num_kv_heads=a.kv_heads,
                               head_dim=a.head_dim, vocab=a.vocab, seed=a.seed, tokenizer=not a.no_tokenizer)
    print(a.dst)
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `helpers.tiny_tokenizer` imports
    raise SystemExit(main())
