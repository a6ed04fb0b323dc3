"""moed vs llama.cpp at agent-sized prompts: TTFT, prefill and decode tok/s at depth, peak RSS (issue #30).

    .venv/bin/python benchmarks/bench_long_context.py --llama-python /tmp/llvenv/bin/python \
        --llama-cpp-dir /tmp/llamacpp-gguf/llama_cpp_python-0.3.36/vendor/llama.cpp \
        [--layers 2] [--type q8_0] [--prompts 8192,16384,32768] [--decode-tokens 16] [--threads 2] \
        [--kv-type default|q8_0] \
        [--workdir /tmp/bench-vs-llamacpp] [--json OUT]

The model is bench_vs_llamacpp.py's: a random Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts
x 768, top-8, 32 q / 4 kv heads x 128, vocab 49152) with ``--layers`` layers and SmolLM2's tokenizer,
converted by llama.cpp's converter and quantised by llama.cpp's quantiser; both engines read the same
GGUF file (``--type``; q8_0: moed's q8 bank is the same bits). For each prompt length, each engine runs
in a fresh process: a prompt of that many tokens (TTFT = the whole prefill), then ``--decode-tokens``
greedy tokens at that depth; the process's peak RSS (ru_maxrss) is read at the end. moed runs its
engine loop (run_offline: the daemon's scheduler, 512-token chunks, paged KV pool sized to the prompt);
llama.cpp evaluates the prompt with n_batch 512 and a context of prompt + 64. Set up llama.cpp as
bench_vs_llamacpp.py says. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import MOED_PY, build_checkpoint, run_json, to_gguf  # noqa: E402

LLAMA_RUN = r"""
import json, resource, sys, time
from llama_cpp import Llama
path, threads, prompt_n, decode_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kv = {} if sys.argv[5] == "default" else {"type_k": 8, "type_v": 8, "flash_attn": True}  # GGML_TYPE_Q8_0
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prompt_n + 64, n_batch=512,
            verbose=False, seed=0, **kv)
vocab = llm.n_vocab()
prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(prompt_n)]
t0 = time.perf_counter(); llm.eval(prompt); ttft = time.perf_counter() - t0
tok, t0 = 100, time.perf_counter()
for _ in range(decode_n):  # the tokens do not matter to the time (llama-cpp-python keeps only the last batch's logits)
    tok = (tok * 7 + 3) % (vocab - 100) + 50
    llm.eval([tok])
decode_s = time.perf_counter() - t0
print(json.dumps({"ttft_s": ttft, "prefill_tok_s": prompt_n / ttft, "decode_tok_s": decode_n / decode_s,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""

MOED_RUN = r"""
import json, resource, sys, time
from moed.kernels.numba_runtime import configure_threads
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
path, threads, prompt_n, decode_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configure_threads(threads)
rt = open_runtime(path)
if sys.argv[5] != "default":  # what moed load --kv-type sets
    from moed.cache.kv_cache import KV_TYPES
    rt.model.kv_dtype = KV_TYPES[sys.argv[5]]
vocab = rt.model.config.vocab_size
prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(prompt_n)]
run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=2, ignore_eos=True)], context_length=64)  # warm-up
(done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=decode_n + 1, ignore_eos=True)],
                      context_length=prompt_n + decode_n + 16)
print(json.dumps({"ttft_s": done.usage.ttft_s, "prefill_tok_s": prompt_n / done.usage.ttft_s,
                  "decode_tok_s": done.usage.decode_tok_s,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
rt.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--llama-cpp-dir", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--prompts", default="8192,16384,32768")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--kv-type", default="default", choices=("default", "q8_0"),
                    help="K/V type of both engines: their defaults (moed bf16, llama.cpp f16), or q8_0 for both "
                         "(llama.cpp with flash attention, which its quantised V cache needs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/bench-vs-llamacpp")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf = build_checkpoint(work, args.layers)
    config = json.loads((hf / "config.json").read_text())
    if config.get("max_position_embeddings", 0) < 40960:  # Qwen3-30B-A3B's own limit; the synthetic one has 4096
        config["max_position_embeddings"] = 40960
        (hf / "config.json").write_text(json.dumps(config, indent=2))
        for old in work.glob(f"model-{hf.name}-*.gguf"):
            old.unlink()
    gguf = to_gguf(args, hf, work, args.type)
    rows = []
    for n in (int(p) for p in args.prompts.split(",")):
        row = {"prompt": n}
        for engine, python, code in (("llama.cpp", args.llama_python, LLAMA_RUN), ("moed", str(MOED_PY), MOED_RUN)):
            env = {"MOED_CPU_THREADS": str(args.threads)} if engine == "moed" else None
            row[engine] = run_json(python, code, gguf, args.threads, n, args.decode_tokens, args.kv_type, env=env)
            print(f"{n} {engine}: {json.dumps(row[engine])}", file=sys.stderr, flush=True)
        rows.append(row)
    print(f"\n{args.layers} layers of Qwen3-30B-A3B's shape, {args.type} GGUF ({gguf.stat().st_size / 1e9:.2f} GB), "
          f"{args.threads} threads, {args.decode_tokens} decode tokens at depth, K/V {args.kv_type}\n")
    print("| prompt | TTFT llama.cpp | moed | prefill ratio | decode tok/s llama.cpp | moed | ratio "
          "| peak RSS GiB llama.cpp | moed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ll, mo = r["llama.cpp"], r["moed"]
        print(f"| {r['prompt']:,} | {ll['ttft_s']:.1f} s | {mo['ttft_s']:.1f} s | {ll['ttft_s'] / mo['ttft_s']:.2f}x "
              f"| {ll['decode_tok_s']:.1f} | {mo['decode_tok_s']:.1f} | {mo['decode_tok_s'] / ll['decode_tok_s']:.2f}x "
              f"| {ll['peak_rss_gib']:.2f} | {mo['peak_rss_gib']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
