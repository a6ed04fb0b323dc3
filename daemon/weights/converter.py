"""`moed convert`: a Hugging Face checkpoint or GGUF file, merged once into expert banks, written as FTW, streaming.

Nothing is held whole: the FTW layout is reserved from the tensors' shapes, then non-expert
weights are read and written one at a time and routed experts a chunk at a time (read, stacked
k-major, converted to the bank dtype, written into their rows of the bank). Peak memory is one
chunk plus the largest non-expert tensor, whatever the number of layers. The source is read
with pread, not mmap, so its pages do not count against the process (see safetensors_files.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from moed.cache.bank_builder import bank_tensor_specs
from moed.errors import ModelFormatError
from moed.weights.ftw_format import source_fingerprint_of
from moed.weights.ftw_writer import FtwStreamWriter, StaleReport, TensorSpec
from moed.weights.expert_chunk import bank_rows
from moed.weights.checkpoint import open_checkpoint
from moed.weights.model_loader import BANK_PREFIX, bank_metadata_for, check_bank_dtype, is_ftw_dir

log = logging.getLogger("moed.weights")

# Copied verbatim so an FTW directory is self-contained (tokenizer and templates included).
EXTRA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "special_tokens_map.json", "chat_template.jinja", "tiktoken.model")


def convert_model(src: str | Path, dst: str | Path, *, experts_dtype: str | None = None, overwrite: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  on_stale_removed: StaleReport | None = None) -> Path:
    """Write ``src`` as an FTW directory at ``dst``. The write goes to a hidden temp directory beside
    ``dst`` first; temp directories that earlier, killed conversions to ``dst`` left there are removed
    (each passed to ``on_stale_removed``), those of conversions still running are left alone."""
    src, dst = Path(src), Path(dst)
    if is_ftw_dir(src):
        raise ModelFormatError(f"{src} is already an FTW model; convert from the Hugging Face directory or GGUF file")
    checkpoint = open_checkpoint(src)
    config = checkpoint.config
    experts_dtype = experts_dtype or checkpoint.default_bank_dtype()
    check_bank_dtype(config, experts_dtype)
    for line in checkpoint.type_changes(experts_dtype, packed=False):
        log.warning("%s: %s", src.name, line)
    if checkpoint.prefers_ggml():
        log.warning("%s: FTW holds moed's own expert banks; to keep this checkpoint's types, run it itself "
                    "(`moed generate --model %s`: on a CPU-only machine its experts load as stored)", src.name, src)
    moe = config.moe
    # non-expert weights keep the checkpoint's dtype (a bf16 model's FTW holds bf16 attention weights).
    # A GGUF's quantised weights, which a load keeps packed (PackedLinear), are written dequantised to
    # bf16 (read_weight / weight_dtype): FTW has no packed format for non-expert weights.
    weight_specs = [TensorSpec(name, "weight", checkpoint.weight_dtype(name), shape)
                    for name, shape in checkpoint.weight_shapes().items()]
    bank_specs = [TensorSpec(BANK_PREFIX + name, "expert_bank", dtype, shape)
                  for name, (shape, dtype) in bank_tensor_specs(experts_dtype, checkpoint.num_bank_rows,
                                                                config.hidden_size, moe.intermediate_size,
                                                                moe.has_expert_bias).items()]
    if src.is_dir():
        extra = {name: src / name for name in EXTRA_FILES if (src / name).is_file()}
        sources = sorted(src.glob("*.safetensors")) + [src / "config.json"]
    else:  # GGUF: config.json and the tokenizer files are made from its metadata
        extra = {"config.json": json.dumps(checkpoint.raw_config, indent=2).encode(),
                 **{name: text.encode() for name, text in checkpoint.tokenizer_files().items()}}
        sources = [src]
    metadata = {"config": checkpoint.raw_config,
                "bank": bank_metadata_for(config, experts_dtype)}
    with FtwStreamWriter(dst, weight_specs + bank_specs, overwrite=overwrite, progress=progress,
                         metadata_check=metadata, on_stale_removed=on_stale_removed) as writer:
        for spec in weight_specs:
            writer.write(spec.name, checkpoint.read_weight(spec.name))
        for chunk in checkpoint.expert_chunks(bank_dtype=experts_dtype):
            rows = bank_rows(chunk, experts_dtype)
            for name, tensor in rows.items():
                writer.write_rows(BANK_PREFIX + name, chunk.start, tensor)
        return writer.finish(metadata=metadata, source_fingerprint=source_fingerprint_of(sources), extra_files=extra)
