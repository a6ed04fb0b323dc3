"""A full-depth Qwen3-30B-A3B-shaped Q4_K_M GGUF, moed and llama.cpp side by side from a cold page cache (issue #31).

    .venv/bin/python benchmarks/bench_real_size.py --llama-python /tmp/llvenv/bin/python \
        [--gguf /tmp/bench-vs-llamacpp/qwen3moe-48-q4_k_m.gguf] [--src SRC.gguf] [--layers 48] \
        [--prompts 512] [--decode-tokens 32] [--engines llama.cpp,moed] [--moed-experts-dtype ggml]

The file: `build_real_size_gguf.py SRC OUT --layers 48` (llama.cpp's Q4_K_M tensor types, random valid
blocks, ~17 GiB; SRC a 2-layer GGUF llama.cpp's converter wrote, as bench_vs_llamacpp.py makes), built
here when --gguf does not exist. For each engine, in a fresh process after the page cache is dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`: needs root, else the row says the cache was warm): the
time from process start to the first generated token of a 16-token prompt (load + prefill + one
token), then for each --prompts length the prefill rate and the decode rate after it, and the peak
RSS. moed loads as a user's `moed generate` would (on a CPU-only machine a Q4_K_M file keeps its
types: the ggml bank), or with --moed-experts-dtype. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOED_PY = REPO / ".venv/bin/python"

LLAMA_CHILD = r"""
import json, resource, sys, time
t_start = float(sys.argv[1])
from llama_cpp import Llama
path, threads, prompts, decode_n = sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4].split(",")], int(sys.argv[5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=max(prompts) + decode_n + 64,
            n_batch=512, verbose=False, seed=0)
vocab = llm.n_vocab()
llm.eval([(7 * i + 11) % (vocab - 100) + 50 for i in range(16)])
out = {"first_token_s": time.time() - t_start}
for n in prompts:
    llm.reset()
    prompt = [(5 * i + 13) % (vocab - 100) + 50 for i in range(n)]
    t0 = time.perf_counter(); llm.eval(prompt); prefill = time.perf_counter() - t0
    tok, t0 = 100, time.perf_counter()
    for _ in range(decode_n):
        tok = (tok * 7 + 3) % (vocab - 100) + 50
        llm.eval([tok])
    out[str(n)] = {"prefill_tok_s": n / prefill, "decode_tok_s": decode_n / (time.perf_counter() - t0)}
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
"""

MOED_CHILD = r"""
import json, os, resource, sys, time
t_start = float(sys.argv[1])
from moed.engine.memory_release import limit_malloc_arenas
limit_malloc_arenas()
from moed.kernels.numba_runtime import configure_threads
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
path, threads, prompts, decode_n = sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4].split(",")], int(sys.argv[5])
configure_threads(threads)
rt = open_runtime(path, experts_dtype=sys.argv[6] or None)
vocab = rt.model.config.vocab_size
run_offline(rt, [[(7 * i + 11) % (vocab - 100) + 50 for i in range(16)]], [SamplingParams(max_tokens=1, ignore_eos=True)],
            context_length=64)
out = {"first_token_s": time.time() - t_start, "bank": rt.loaded.bank.dtype}
for n in prompts:
    prompt = [(5 * i + 13) % (vocab - 100) + 50 for i in range(n)]
    (done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=decode_n + 1, ignore_eos=True)],
                          context_length=n + decode_n + 16)
    out[str(n)] = {"prefill_tok_s": n / done.usage.ttft_s, "decode_tok_s": done.usage.decode_tok_s}
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
rt.close()
"""


def drop_page_cache() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(python: str, code: str, *args: str) -> dict:
    done = subprocess.run([python, "-c", code, str(time.time()), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--gguf", default="/tmp/bench-vs-llamacpp/qwen3moe-48-q4_k_m.gguf")
    ap.add_argument("--src", default="/tmp/bench-vs-llamacpp/model-hf-2-q8_0.gguf",
                    help="the shallow GGUF build_real_size_gguf.py widens when --gguf does not exist")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompts", default="512")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llama.cpp,moed")
    ap.add_argument("--moed-experts-dtype", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    gguf = Path(args.gguf)
    if not gguf.exists():
        subprocess.run([str(MOED_PY), str(REPO / "benchmarks/build_real_size_gguf.py"), args.src, str(gguf),
                        "--layers", str(args.layers)], check=True)
    rows = {}
    for engine in args.engines.split(","):
        cold = drop_page_cache()
        common = (str(gguf), str(args.threads), args.prompts, str(args.decode_tokens))
        if engine == "llama.cpp":
            rows[engine] = run(args.llama_python, LLAMA_CHILD, *common)
        else:
            rows[engine] = run(str(MOED_PY), MOED_CHILD, *common, args.moed_experts_dtype)
        rows[engine]["cold_cache"] = cold
        print(f"{engine}: {json.dumps(rows[engine])}", file=sys.stderr, flush=True)
    print(f"\n{gguf.name}: {gguf.stat().st_size / 1e9:.2f} GB, {args.threads} threads\n")
    print("| engine | page cache | first token (cold start) | prefill tok/s | decode tok/s | peak RSS GiB |")
    print("|---|---|---:|---:|---:|---:|")
    for engine, r in rows.items():
        for n in args.prompts.split(","):
            label = engine + (f" ({r['bank']} bank)" if "bank" in r else "")
            print(f"| {label} | {'dropped' if r['cold_cache'] else 'warm'} | {r['first_token_s']:.1f} s "
                  f"| {r[n]['prefill_tok_s']:.1f} ({n} tokens) | {r[n]['decode_tok_s']:.2f} | {r['peak_rss_gib']:.2f} |")
    if "moed" in rows and "llama.cpp" in rows:
        mo, ll = rows["moed"], rows["llama.cpp"]
        n = args.prompts.split(",")[0]
        print(f"\nratios moed / llama.cpp: first token {ll['first_token_s'] / mo['first_token_s']:.2f}x faster, "
              f"prefill {mo[n]['prefill_tok_s'] / ll[n]['prefill_tok_s']:.2f}x, "
              f"decode {mo[n]['decode_tok_s'] / ll[n]['decode_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
