#!/usr/bin/env python3
"""A full-depth GGUF from a shallow one: the same architecture, tokenizer and tensor shapes, N layers of
random valid blocks in llama.cpp's Q4_K_M tensor-type layout (or every tensor in one type, or IQ4_XS experts).

    .venv/bin/python benchmarks/build_real_size_gguf.py SRC.gguf OUT.gguf [--layers 48] [--layout q4_k_m|q4_0|iq4_xs]

SRC is a GGUF llama.cpp's converter wrote (bench_vs_llamacpp.py makes a 2-layer Qwen3-30B-A3B-shaped one);
its metadata is copied (block_count set to --layers, context_length to at least Qwen3-30B-A3B's 40960), its token embedding, output and norms are copied,
and each layer i gets layer (i mod src layers)'s norms and router, and fresh random blocks for its
attention and expert matrices: scales set to small finite float16 values, quants random. ``q4_k_m``
follows llama.cpp's rule for that mix (llama-quant.cpp, use_more_bits: the first and last eighth of
the layers and every third layer between get Q6_K for attn_v and ffn_down(_exps), the rest Q4_K);
``q4_0`` makes every layer matrix Q4_0; ``iq4_xs`` makes the experts' gate and up IQ4_XS (the dynamic "UD"
mixes' expert type) and keeps the Q4_K_M rule for the rest. Streams one tensor at a time (a 48-layer Qwen3-30B-A3B shape
is ~17 GiB in Q4_K_M; the builder holds one expert tensor, ~0.2 GB). Not part of CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

CONTEXT_LENGTH = 40960  # Qwen3-30B-A3B's max_position_embeddings
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                  "ffn_gate", "ffn_up", "ffn_down")


def use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def layer_type(kind: str, layer: int, layers: int, layout: str) -> T:
    if layout == "q4_0":
        return T.Q4_0
    if layout == "iq4_xs" and kind in ("ffn_gate_exps", "ffn_up_exps"):
        return T.IQ4_XS
    if kind in ("attn_v", "ffn_down_exps", "ffn_down") and use_more_bits(layer, layers):
        return T.Q6_K
    return T.Q4_K


def random_blocks(qtype: T, values: int, rng: np.random.Generator) -> np.ndarray:
    """``values`` (a multiple of the block size) as random blocks of ``qtype`` whose float16 scales are small
    and finite (raw uint8, the layout ggml-common.h gives each block)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    count = values // block
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    def scales(offset: int, value: float) -> None:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    if qtype == T.Q4_K:  # d, dmin, scales[12], qs[128]
        scales(0, 2e-4)
        scales(2, 1e-3)
    elif qtype == T.Q6_K:  # ql[128], qh[64], scales[16] (int8), d
        scales(208, 4e-5)
    elif qtype == T.IQ4_XS:  # d, scales_h, scales_l[4], qs[128]: |w| <= 127 * 32 * d
        scales(0, 2e-5)
    elif qtype in (T.Q4_0, T.Q8_0):  # d, qs
        scales(0, 2e-3 if qtype == T.Q4_0 else 4e-4)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(-1)


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, layers: int, layout: str) -> None:
    arch = reader.fields["general.architecture"].contents()
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture",):
            continue
        value = field.contents()
        if key == f"{arch}.block_count":
            value = layers
        elif key == f"{arch}.context_length":
            value = max(int(value), CONTEXT_LENGTH)  # the real model's, whatever the shallow source says
        elif key == "general.file_type":
            value = {"q4_k_m": 15, "q4_0": 2, "iq4_xs": 30}[layout]  # LLAMA_FTYPE_MOSTLY_Q4_K_M / Q4_0 / IQ4_XS
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, value, vtype, sub_type=sub)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--layout", default="q4_k_m", choices=("q4_k_m", "q4_0", "iq4_xs"))
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    src_layers = int(reader.fields[f"{arch}.block_count"].contents())
    by_name = {t.name: t for t in reader.tensors}
    writer = gguf.GGUFWriter(args.out, arch)
    copy_fields(reader, writer, args.layers, args.layout)
    plan = []  # (name, logical shape (ggml order reversed: numpy order), type, source tensor or None)
    for t in reader.tensors:
        if not t.name.startswith("blk."):
            plan.append((t.name, t, None))
    for layer in range(args.layers):
        src = layer % src_layers
        for t in reader.tensors:
            if not t.name.startswith(f"blk.{src}."):
                continue
            suffix = t.name.split(".", 2)[2]
            kind = suffix.rsplit(".", 1)[0]
            name = f"blk.{layer}.{suffix}"
            plan.append((name, t, layer_type(kind, layer, args.layers, args.layout) if kind in LAYER_MATRICES else None))
    for name, t, qtype in plan:
        shape = [int(d) for d in reversed(t.shape)]  # numpy order: rows last-dim-contiguous
        if qtype is None:
            writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = [*shape[:-1], shape[-1] // block * size]
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    total = len(plan)
    for i, (name, t, qtype) in enumerate(plan):
        if qtype is None:
            writer.write_tensor_data(t.data)
        else:
            writer.write_tensor_data(random_blocks(qtype, int(np.prod([int(d) for d in t.shape])), rng))
        if i % 50 == 0:
            print(f"{i}/{total} {name}", file=sys.stderr, flush=True)
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB, {args.layers} layers, {args.layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
