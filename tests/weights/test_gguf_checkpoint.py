"""GgufCheckpoint reads a llama.cpp GGUF file as HfCheckpoint reads the Hugging Face directory it came from.

Tiny transformers models are written as GGUF in llama.cpp's layout (helpers/gguf_writer.py). In F32
everything must equal the Hugging Face checkpoint exactly; quantised experts must repack into the
matching bank dtype so that dequantising the bank gives what gguf-py's reference dequantiser gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import FAMILIES, write_bare_gguf, write_tiny_gguf
from moed.cache.bank_builder import dequantize_bank_rows
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.kernels.int4_format import quantize_int4
from moed.text.tokenizer import Tokenizer
from moed.weights.expert_chunk import bank_rows
from moed.weights.gguf_checkpoint import GgufCheckpoint
from moed.weights.gguf_file import GgufFile, is_gguf_file
from moed.weights.hf_checkpoint import HfCheckpoint
from moed.weights.model_loader import load_model

K_QUANT_DIMS = dict(hidden_size=256, moe_intermediate_size=256)  # rows of whole 256-weight K-quant blocks


def reference_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantised by gguf-py's reference, float32 in numpy shape."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(shape).copy())
    return out


def reference_bank(ref: dict[str, torch.Tensor], config) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 bank rows from the reference tensors: gate_up [N, D, 2I] (gate | up), down [N, I, D]."""
    gate_up, down = [], []
    for layer in range(config.num_layers):
        b = f"blk.{layer}."
        stacked = torch.cat([ref[b + "ffn_gate_exps.weight"], ref[b + "ffn_up_exps.weight"]], dim=1)  # [E, 2I, D]
        gate_up.append(stacked.transpose(1, 2))
        down.append(ref[b + "ffn_down_exps.weight"].transpose(1, 2))
    return torch.cat(gate_up), torch.cat(down)


def bank_of(checkpoint: GgufCheckpoint, **kw) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Every chunk, dequantised to float32 rows and stacked; also the chunks themselves."""
    chunks = list(checkpoint.expert_chunks(**kw))
    rows = [dequantize_bank_rows(dict(c.packed), c.packed_dtype) if c.packed is not None else (c.gate_up, c.down)
            for c in chunks]
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), chunks


@pytest.fixture(scope="module", params=FAMILIES)
def f32_model(request, tmp_path_factory):
    path, hf_dir, _ = write_tiny_gguf(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, hf_dir


def test_f32_file_equals_the_hugging_face_checkpoint(f32_model):
    family, path, hf_dir = f32_model
    gg, hf = GgufCheckpoint(path), HfCheckpoint(hf_dir)
    assert gg.family.name == family
    assert gg.config == hf.config
    assert sorted(gg.weight_keys) == sorted(hf.weight_keys)
    assert gg.weight_shapes() == hf.weight_shapes()
    for name in hf.weight_keys:
        ours, theirs = gg.read_weight(name), hf.read_weight(name)
        assert ours.dtype == theirs.dtype == gg.weight_dtype(name) == torch.float32, name
        assert torch.equal(ours, theirs), name
    assert gg.default_bank_dtype() == "fp32"
    assert gg.num_bank_rows == hf.num_bank_rows
    pairs = list(zip(gg.expert_chunks(chunk_experts=3), hf.expert_chunks(chunk_experts=3), strict=True))
    assert len(pairs) == hf.config.num_moe_layers * 3  # 8 experts in chunks of 3, 3, 2
    for ours, theirs in pairs:
        assert ours.start == theirs.start and ours.packed is None
        for part in ("gate_up", "down", "gate_up_bias", "down_bias"):
            a, b = getattr(ours, part), getattr(theirs, part)
            assert (a is None) == (b is None), part
            assert a is None or torch.equal(a, b), f"{family}: chunk {ours.start} {part}"


def test_raw_config_is_a_config_json_that_parses_to_the_same_model(f32_model):
    from moed.models.families import parse_model_config

    _, path, hf_dir = f32_model
    gg = GgufCheckpoint(path)
    assert parse_model_config(dict(gg.raw_config)) == HfCheckpoint(hf_dir).config
    assert gg.source_files() == [path]


def test_tokenizer_files_rebuild_the_hugging_face_tokenizer(f32_model):
    _, path, hf_dir = f32_model
    files = GgufCheckpoint(path).tokenizer_files()
    ours, theirs = Tokenizer.from_files(files, where=str(path)), Tokenizer(hf_dir)
    texts = ["The model reads the weights quickly.", "Un café à Paris — 日本語 🙂",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "  spaces\n\nand 12345 digits\t!"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text)), text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert theirs.eos_token_ids <= ours.eos_token_ids
    assert ours.chat_template == theirs.chat_template
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)


@pytest.mark.parametrize("family, expert_type, bank_dtype", [
    ("qwen3_moe", T.Q8_0, "q8"), ("gpt_oss", T.MXFP4, "mxfp4"), ("qwen2_moe", T.Q4_0, "int4"),
    ("qwen3_moe", T.Q4_1, "int4")])
def test_quantised_experts_repack_into_their_bank_dtype(tmp_path, family, expert_type, bank_dtype):
    path, _, _ = write_tiny_gguf(family, tmp_path, expert_type=expert_type)
    gg = GgufCheckpoint(path)
    assert gg.default_bank_dtype() == bank_dtype
    ref = reference_tensors(path)
    want_gu, want_dn = reference_bank(ref, gg.config)
    got_gu, got_dn, chunks = bank_of(gg, chunk_experts=3)
    assert all(c.packed_dtype == bank_dtype for c in chunks)
    for c in chunks:  # the rows are the bank's: bank_rows passes them through untouched
        rows = bank_rows(c, bank_dtype)
        assert all(torch.equal(rows[k], v) for k, v in c.packed.items())
    if bank_dtype == "int4":
        # only the per-group scale and min are rounded to bf16: |err| <= 2**-8 (15 |scale| + |min|)
        for got, want, rows in ((got_gu, want_gu, "gate_up"), (got_dn, want_dn, "down")):
            packed = {k: torch.cat([c.packed[k] for c in chunks]) for k in chunks[0].packed if k.startswith(rows)}
            scale, mn = packed[f"{rows}.scale"].float(), packed[f"{rows}.min"].float()  # [N, K/32, Ncols]
            bound = (2 ** -8 * 1.01 * (15 * scale.abs() + mn.abs())).repeat_interleave(32, dim=1)
            assert bool(((got - want).abs() <= bound).all()), rows
            assert (got - want).abs().max() > 0  # bf16 rounding does show: the bound is what is tested
    else:  # Q8_0 -> q8 and MXFP4 -> mxfp4 keep every bit
        assert torch.equal(got_gu, want_gu) and torch.equal(got_dn, want_dn)
    if gg.config.moe.has_expert_bias:
        bias = torch.cat([c.gate_up_bias for c in chunks])
        b = "blk.0."
        assert torch.equal(bias[:8], torch.cat([ref[b + "ffn_gate_exps.bias"], ref[b + "ffn_up_exps.bias"]], dim=1))


def test_another_bank_dtype_gets_exact_float_rows(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0)
    gg = GgufCheckpoint(path)
    want_gu, want_dn = reference_bank(reference_tensors(path), gg.config)
    got_gu, got_dn, chunks = bank_of(gg, bank_dtype="bf16")
    assert all(c.packed is None for c in chunks)
    assert torch.equal(got_gu, want_gu) and torch.equal(got_dn, want_dn)


def test_k_quant_experts_q4_k_to_int4_with_a_q6_k_down(tmp_path):
    """Q4_K_M's layout: gate/up Q4_K, some layers' down Q6_K. The Q4_K matrices repack into int4
    (codes kept); the Q6_K down is dequantised and quantised to int4 like any float source."""
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                 tensor_types={"blk.0.ffn_down_exps.weight": T.Q6_K}, **K_QUANT_DIMS)
    gg = GgufCheckpoint(path)
    assert gg.default_bank_dtype() == "int4"  # Q4_K holds most expert weights
    want_gu, want_dn = reference_bank(reference_tensors(path), gg.config)
    got_gu, got_dn, chunks = bank_of(gg)
    assert all(c.packed_dtype == "int4" for c in chunks)
    layer0 = [c for c in chunks if c.start < 8]
    q, scale, mn = quantize_int4(want_dn[:8].contiguous())
    assert torch.equal(torch.cat([c.packed["down.q"] for c in layer0]), q)
    assert torch.equal(torch.cat([c.packed["down.scale"] for c in layer0]), scale)
    assert torch.equal(torch.cat([c.packed["down.min"] for c in layer0]), mn)
    gu = {k: torch.cat([c.packed[k] for c in chunks]) for k in ("gate_up.scale", "gate_up.min")}
    bound = (2 ** -8 * 1.01 * (15 * gu["gate_up.scale"].float().abs() + gu["gate_up.min"].float().abs()))
    assert bool(((got_gu - want_gu).abs() <= bound.repeat_interleave(32, dim=1)).all())
    # Q8_0 non-expert weights: dequantised, kept as bf16
    ref = reference_tensors(path)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert gg.weight_dtype(name) == torch.bfloat16
    assert torch.equal(gg.read_weight(name), ref["blk.1.attn_q.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("expert_type", [T.Q6_K, T.Q5_K])
def test_k_quant_experts_without_an_int4_form_come_as_exact_float_rows_for_q8(tmp_path, expert_type):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=expert_type, **K_QUANT_DIMS)
    gg = GgufCheckpoint(path)
    assert gg.default_bank_dtype() == "q8"
    want_gu, want_dn = reference_bank(reference_tensors(path), gg.config)
    got_gu, got_dn, chunks = bank_of(gg)
    assert all(c.packed is None for c in chunks)
    assert torch.equal(got_gu, want_gu) and torch.equal(got_dn, want_dn)
    assert set(bank_rows(chunks[0], "q8")) == {"gate_up.qs", "gate_up.d", "down.qs", "down.d"}


@pytest.mark.parametrize("expert_type, bank_dtype", [(T.Q5_0, "q8"), (T.Q5_1, "q8"), (T.Q2_K, "int4"),
                                                     (T.Q3_K, "int4"), (T.IQ4_NL, "int4"), (T.IQ4_XS, "int4"),
                                                     (T.NVFP4, "int4")])
def test_types_without_a_bank_form_load_re_quantised_and_say_so(tmp_path, expert_type, bank_dtype, caplog):
    """Q5_0/Q5_1, Q2_K/Q3_K and the IQ4 types decode bit for bit as gguf.quants does (test_gguf_quants.py)
    and are re-quantised into the closest bank; the load warns, naming the tensors and both types."""
    weight_type = expert_type if gguf.GGML_QUANT_SIZES[expert_type][0] == 32 else T.Q5_0  # 128-wide attention inputs
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=expert_type, weight_type=weight_type,
                                 **K_QUANT_DIMS)
    gg = GgufCheckpoint(path)
    assert gg.default_bank_dtype() == bank_dtype
    want_gu, want_dn = reference_bank(reference_tensors(path), gg.config)
    got_gu, got_dn, chunks = bank_of(gg)
    assert all(c.packed is None for c in chunks)  # exact float rows, quantised into the bank by the loader
    assert torch.equal(got_gu, want_gu) and torch.equal(got_dn, want_dn)
    name = expert_type.name
    lines = gg.type_changes()
    experts = [line for line in lines if f"into the {bank_dtype} expert bank" in line]
    assert len(experts) == 1 and experts[0].startswith(f"{3 * gg.config.num_moe_layers} tensor(s) stored as {name} ")
    assert "blk.0.ffn_gate_exps.weight" in experts[0] and "--experts-dtype ggml keeps them as stored" in experts[0]
    # the attention projections keep their own type (GGUF rows): not listed
    assert not any(f"stored as {weight_type.name}" in line and "re-quantised to q8" in line for line in lines)
    with caplog.at_level("WARNING", logger="moed.weights"):
        load_model(path)
    assert any(f"stored as {name}" in r.getMessage() and "expert bank" in r.getMessage() for r in caplog.records)


def test_a_q8_0_file_changes_nothing(tmp_path):
    """Experts, linear() weights and the embedding table keep Q8_0's blocks (q8); only an explicit fp32
    weights dtype (no packed forms) decodes the quantised non-expert weights, and says so."""
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0, weight_type=T.Q8_0)
    assert GgufCheckpoint(path).type_changes() == []
    unpacked = GgufCheckpoint(path).type_changes(packed=False)
    assert any("stored as Q8_0" in line and "are decoded to bf16" in line for line in unpacked), unpacked
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path / "f32", expert_type=T.F32, weight_type=T.F32)
    assert GgufCheckpoint(path).type_changes() == []


def test_a_q4_k_m_mix_reports_its_q6_k_down_re_quantised_to_int4(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                 tensor_types={"blk.0.ffn_down_exps.weight": T.Q6_K}, **K_QUANT_DIMS)
    lines = GgufCheckpoint(path).type_changes()
    assert lines[0].startswith("1 tensor(s) stored as Q6_K (blk.0.ffn_down_exps.weight) are re-quantised into the "
                               "int4 expert bank") and len(lines) == 1  # the rest keeps its types


@pytest.mark.parametrize("weight_type, dtype", [(T.F16, torch.float16), (T.BF16, torch.bfloat16)])
def test_half_precision_weights_keep_their_dtype(tmp_path, weight_type, dtype):
    path, _, _ = write_tiny_gguf("gpt_oss", tmp_path, weight_type=weight_type, expert_type=weight_type)
    gg = GgufCheckpoint(path)
    ref = reference_tensors(path)
    for name, gguf_name in gg.weight_keys.items():
        want = ref[gguf_name].reshape(gg.weight_shapes()[name])
        stored = dtype if want.dim() == 2 and "router" not in name else torch.float32  # 1-D and routers stay F32
        assert gg.weight_dtype(name) == stored, name
        assert torch.equal(gg.read_weight(name), want.to(stored)), name
    assert gg.default_bank_dtype() == ("fp32" if weight_type == T.F16 else "bf16")


def test_expert_chunks_read_a_chunk_of_experts_at_a_time(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0)
    gg = GgufCheckpoint(path)
    reads = []
    real_read = gg.file.read
    gg.file.read = lambda name, rows=None: reads.append((name, rows)) or real_read(name, rows)
    list(gg.expert_chunks(chunk_experts=2))
    assert reads and all(rows is not None and rows[1] - rows[0] <= 2 for name, rows in reads if "_exps" in name)
    per_tensor = {}
    for name, (r0, r1) in reads:
        per_tensor.setdefault(name, []).append((r0, r1))
    assert all(spans == [(0, 2), (2, 4), (4, 6), (6, 8)] for spans in per_tensor.values())  # each byte read once


def test_gguf_file_slices_and_metadata(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_0)
    file = GgufFile(path)
    assert is_gguf_file(path) and not is_gguf_file(tmp_path) and not is_gguf_file(tmp_path / "hf" / "config.json")
    assert file.architecture == "qwen3moe" and file.version == 3
    assert file.metadata["qwen3moe.attention.layer_norm_rms_epsilon"] == 1e-06  # float32, shown as written
    assert file.metadata["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>", "<s>"]
    info = file.tensor("blk.2.ffn_up_exps.weight")
    assert info.shape == (8, 64, 64) and info.type_name == "Q4_0" and info.nbytes == 8 * 64 * 2 * 18
    whole = file.read(info.name)
    assert torch.equal(file.read(info.name, (3, 5)), whole[3 * info.nbytes // 8: 5 * info.nbytes // 8])


def test_truncated_file_names_the_first_tensor_past_the_end(tmp_path):
    path, _, _ = write_tiny_gguf("qwen2_moe", tmp_path)
    reader = gguf.GGUFReader(str(path))
    size = path.stat().st_size * 2 // 3
    first = min((t for t in reader.tensors if t.data_offset + t.n_bytes > size), key=lambda t: t.data_offset)
    del reader
    with open(path, "r+b") as f:
        f.truncate(size)
    with pytest.raises(ModelFormatError) as info:
        GgufCheckpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "truncated" in message and "download it again" in message
    assert f"'{first.name}' ends at byte {first.data_offset + first.n_bytes} but the file has {size}" in message


def test_truncated_header_is_one_line(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path)
    with open(path, "r+b") as f:
        f.truncate(1000)  # inside the token list
    with pytest.raises(ModelFormatError, match=r"cut short or corrupt; download it again") as info:
        GgufFile(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_file_without_the_gguf_magic_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUX" + bytes(64))
    assert not is_gguf_file(path)
    with pytest.raises(ModelFormatError, match=r"model\.gguf: not a GGUF file \(it does not start with the GGUF magic"):
        GgufFile(path)
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelFormatError, match=r"GGUF version 9 is not supported"):
        GgufFile(path)


@pytest.mark.parametrize("arch", ["bert", "qwen3"])
def test_an_unsupported_architecture_is_refused(tmp_path, arch):
    path = write_bare_gguf(tmp_path / f"{arch}.gguf", arch, metadata={f"{arch}.block_count": 2})
    with pytest.raises(UnsupportedModelError) as info:
        GgufCheckpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"architecture '{arch}' is not supported" in message
    assert "qwen3moe" in message and "qwen2moe" in message and "gpt-oss" in message and "deepseek2" in message


def test_a_dense_llama_file_is_refused_as_not_moe(tmp_path):
    path = write_bare_gguf(tmp_path / "llama.gguf", "llama", metadata={"llama.block_count": 2})
    with pytest.raises(UnsupportedModelError, match=r"a dense Llama model \(no experts\); moed runs Mixture-of-Experts"):
        GgufCheckpoint(path)


def test_a_type_only_gguf_decodes_is_read_through_it_and_the_load_says_so(tmp_path):
    """IQ1-IQ3 and TQ types have no decoder or kernel of moed's own: the gguf package's reference decodes
    them, the experts go into the nearest bank and every load names the tensors and both types
    (issue #31); the model is transformers' on the gguf-decoded weights."""
    from helpers.gguf_writer import load_dequantised_into
    from helpers.native_switch import without_native_kernels
    from helpers.reference_parity import assert_matches_reference
    from moed.engine.runtime import open_runtime

    name = "blk.1.ffn_down_exps.weight"
    path, _, model = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                     tensor_types={name: T.IQ2_XXS}, **K_QUANT_DIMS)
    checkpoint = GgufCheckpoint(path)
    raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    want = gguf.quants.dequantize(np.asarray(raw.data), T.IQ2_XXS)
    assert np.array_equal(checkpoint._dequantized(name).numpy(), want.reshape(checkpoint._dequantized(name).shape))
    lines = checkpoint.type_changes("int4")
    assert any("stored as IQ2_XXS" in s and name in s and "int4 expert bank" in s for s in lines), lines
    load_dequantised_into(model, "qwen3_moe", path)
    runtime = open_runtime(path, experts_dtype="fp32", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, model.eval(), tol=1e-3, steps=4)
    finally:
        runtime.close()


def test_a_type_nothing_decodes_is_refused(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, tensor_types={"blk.1.ffn_down_exps.weight": T.Q8_K},
                                 **K_QUANT_DIMS)
    with pytest.raises(ModelFormatError) as info:
        GgufCheckpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "'blk.1.ffn_down_exps.weight' is stored as Q8_K" in message and "llama-quantize" in message


def test_a_dense_qwen2moe_layer_is_refused(tmp_path):
    from helpers.gguf_writer import build_gguf_ready_model, write_gguf

    model = build_gguf_ready_model("qwen2_moe", tmp_path / "hf")
    path = write_gguf(model, "qwen2_moe", tmp_path / "model.gguf", tmp_path / "hf", drop=("blk.1.ffn_gate_inp.weight",))
    with pytest.raises(UnsupportedModelError, match=r"layer 1 has no router \(blk\.1\.ffn_gate_inp\.weight\)"):
        GgufCheckpoint(path)


def test_a_missing_tensor_is_named(tmp_path):
    from helpers.gguf_writer import build_gguf_ready_model, write_gguf

    model = build_gguf_ready_model("gpt_oss", tmp_path / "hf")
    path = write_gguf(model, "gpt_oss", tmp_path / "model.gguf", tmp_path / "hf", drop=("blk.2.attn_sinks.weight",))
    with pytest.raises(ModelFormatError, match=r"tensor 'blk\.2\.attn_sinks\.weight' is missing"):
        GgufCheckpoint(path)


def test_without_an_output_tensor_the_embedding_is_tied(tmp_path):
    from helpers.gguf_writer import build_gguf_ready_model, write_gguf

    model = build_gguf_ready_model("qwen3_moe", tmp_path / "hf")
    path = write_gguf(model, "qwen3_moe", tmp_path / "model.gguf", tmp_path / "hf", drop=("output.weight",))
    gg = GgufCheckpoint(path)
    assert gg.config.tie_word_embeddings and gg.raw_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in gg.weight_keys and "model.embed_tokens.weight" in gg.weight_keys


def test_a_split_gguf_reads_as_one_file_from_its_first_part(tmp_path):
    from helpers.gguf_writer import build_gguf_ready_model, write_gguf

    model = build_gguf_ready_model("qwen3_moe", tmp_path / "hf")
    write_gguf(model, "qwen3_moe", tmp_path / "one.gguf", tmp_path / "hf", expert_type=T.Q8_0)
    write_gguf(model, "qwen3_moe", tmp_path / "split.gguf", tmp_path / "hf", expert_type=T.Q8_0, split_max_tensors=15)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3 and parts[0].name == "split-00001-of-00003.gguf"
    whole, split = GgufCheckpoint(tmp_path / "one.gguf"), GgufCheckpoint(parts[0])
    assert split.config == whole.config and split.source_files() == parts
    assert {i.file for i in split.file.tensors.values()} == set(parts)
    for name in whole.weight_keys:
        assert torch.equal(split.read_weight(name), whole.read_weight(name)), name
    for a, b in zip(split.expert_chunks(), whole.expert_chunks(), strict=True):
        assert a.packed.keys() == b.packed.keys() and all(torch.equal(a.packed[k], b.packed[k]) for k in a.packed)
    with pytest.raises(ModelFormatError, match=r"part 2 of a GGUF split into 3 files; point --model at the first part "
                                               r"\(split-00001-of-00003\.gguf\)"):
        GgufFile(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelFormatError, match=r"split-00003-of-00003\.gguf: part 3 of 3 of split-00001-of-00003\.gguf "
                                               r"is missing"):
        GgufFile(parts[0])


def _gemma4_metadata(**changes) -> dict[str, object]:
    """A two-layer Gemma-4 header (one sliding, one full layer) as llama.cpp's converter writes its keys."""
    meta: dict[str, object] = {
        "gemma4.block_count": 2, "gemma4.embedding_length": 32, "gemma4.attention.head_count": 2,
        "gemma4.attention.head_count_kv": [1, 1], "gemma4.attention.key_length": 16,
        "gemma4.attention.key_length_swa": 8, "gemma4.attention.sliding_window_pattern": [True, False],
        "gemma4.attention.sliding_window": 16, "gemma4.context_length": 64,
        "gemma4.attention.layer_norm_rms_epsilon": 1e-6, "gemma4.rope.freq_base": 1e6,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("changes, error, says", [
    ({"gemma4.attention.shared_kv_layers": 1}, UnsupportedModelError, "KV sharing / per-layer embeddings"),
    ({"gemma4.embedding_length_per_layer_input": 8}, UnsupportedModelError, "KV sharing / per-layer embeddings"),
    ({"gemma4.attention.head_count_kv": [1, 2], "gemma4.attention.sliding_window_pattern": [True, True]},
     UnsupportedModelError, r"layers of one kind different KV heads"),
    ({"gemma4.attention.head_count_kv": [1, 0]}, UnsupportedModelError, "layers of one kind different KV heads"),
    ({"gemma4.attention.head_count_kv": [1]}, ModelFormatError, "should hold a count for each of the 2"),
    ({"gemma4.attention.value_length_swa": 16}, UnsupportedModelError, "key and value head sizes differ"),
    ({"gemma4.attention.sliding_window_pattern": [True]}, ModelFormatError, "one boolean per layer"),
])
def test_gemma4_headers_moed_cannot_run_are_refused_with_the_reason(tmp_path, changes, error, says):
    path = write_bare_gguf(tmp_path / "gemma4.gguf", "gemma4", metadata=_gemma4_metadata(**changes))
    with pytest.raises(error, match=says) as info:
        GgufCheckpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("factors", [
    np.array([1, 1, 1, 1, 1, 1, 1, 1, 1], np.float32),   # one too many
    np.array([1, 1, 1e30, 1, 1e30, 1e30, 1e30, 1e30], np.float32),  # a rotated pair after the first unrotated
    np.array([1, 1, 2, 2, 1e30, 1e30, 1e30, 1e30], np.float32),  # a factor llama.cpp never writes
])
def test_gemma4_rope_freqs_that_are_not_the_proportional_rotary_are_refused(tmp_path, factors):
    tensors = {"token_embd.weight": (np.zeros((4, 32), np.float32), None), "rope_freqs.weight": (factors, None)}
    path = write_bare_gguf(tmp_path / "gemma4.gguf", "gemma4", tensors=tensors, metadata=_gemma4_metadata())
    with pytest.raises(ModelFormatError, match=r"rope_freqs\.weight should hold 8 F32 factors"):
        GgufCheckpoint(path)


def test_rows_split_out_of_a_fused_tensor_are_checked_against_it(tmp_path):
    """Gemma-4's ffn_gate_up_exps [E, 2I, D] is read as two row slices; slices the tensor does not hold, names
    already taken and tensors that are not stored 3-D ones are refused (a corrupt or foreign file)."""
    fused = np.arange(2 * 6 * 32, dtype=np.float32).reshape(2, 6, 32)
    tensors = {"token_embd.weight": (np.zeros((4, 32), np.float32), None), "blk.0.ffn_gate_up_exps.weight": (fused, None)}
    path = write_bare_gguf(tmp_path / "fused.gguf", "gemma4", tensors=tensors)
    name = "blk.0.ffn_gate_up_exps.weight"
    for parts, says in (({"gate": (0, 7)}, r"rows 0\.\.7 .* \(6 rows\)"), ({"gate": (3, 3)}, r"rows 3\.\.3"),
                        ({"token_embd.weight": (0, 3)}, "cannot be read as 'token_embd.weight'")):
        with pytest.raises(ModelFormatError, match=says):
            GgufFile(path).split_rows(name, parts)
    with pytest.raises(ModelFormatError, match="is not a stored 3-D tensor"):
        GgufFile(path).split_rows("token_embd.weight", {"a": (0, 1)})
    file = GgufFile(path)
    file.split_rows(name, {"gate": (0, 3), "up": (3, 6)})
    with pytest.raises(ModelFormatError, match="is not a stored 3-D tensor"):  # a slice is not split again
        file.split_rows("gate", {"g2": (0, 1)})
    up = file.read("up").view(torch.float32).reshape(2, 3, 32)
    assert torch.equal(up, torch.from_numpy(fused[:, 3:6]))


def test_a_kimi_linear_header_without_an_mla_layer_is_refused(tmp_path):
    """Kimi-Linear's KDA layers are those with attention.head_count_kv 0; a file where every layer is one has
    no MLA layer (not a Kimi-Linear llama.cpp writes). The header alone says it: expert_feed_forward_length is read
    without looking for an expert tensor."""
    a = "kimi-linear"
    meta = {f"{a}.block_count": 2, f"{a}.embedding_length": 32, f"{a}.attention.head_count": 2,
            f"{a}.attention.head_count_kv": [0, 0], f"{a}.rope.dimension_count": 8,
            f"{a}.attention.key_length_mla": 24, f"{a}.attention.value_length_mla": 16,
            f"{a}.attention.kv_lora_rank": 16, f"{a}.context_length": 64,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.expert_count": 4, f"{a}.expert_used_count": 2,
            f"{a}.expert_feed_forward_length": 16, f"{a}.expert_gating_func": 2}
    tensors = {"token_embd.weight": (np.zeros((4, 32), np.float32), None),
               **{f"blk.{i}.ffn_gate_inp.weight": (np.zeros((4, 32), np.float32), None) for i in range(2)}}
    path = write_bare_gguf(tmp_path / "kimi.gguf", a, tensors=tensors, metadata=meta)
    with pytest.raises(ModelFormatError, match=r"head_count_kv is 0 for every layer \(no MLA layer\)"):
        GgufCheckpoint(path)
