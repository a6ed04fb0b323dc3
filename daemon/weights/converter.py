"""`moed convert`: a Hugging Face checkpoint, merged once into expert banks, written as FTW."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from moed.errors import ModelFormatError
from moed.weights.ftw_format import source_fingerprint_of
from moed.weights.ftw_writer import StaleReport, write_ftw
from moed.weights.hf_checkpoint import load_hf_checkpoint
from moed.weights.model_loader import BANK_PREFIX, bank_from_checkpoint, bank_metadata, is_ftw_dir

# Copied verbatim so an FTW directory is self-contained (tokenizer and templates included).
EXTRA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def convert_model(src: str | Path, dst: str | Path, *, experts_dtype: str = "fp32", overwrite: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  on_stale_removed: StaleReport | None = None) -> Path:
    """Write ``src`` as an FTW directory at ``dst``. The write goes to a hidden temp directory beside
    ``dst`` first; temp directories that earlier, killed conversions to ``dst`` left there are removed
    (each passed to ``on_stale_removed``), those of conversions still running are left alone."""
    src, dst = Path(src), Path(dst)
    if is_ftw_dir(src):
        raise ModelFormatError(f"{src} is already an FTW model; convert from the Hugging Face directory")
    checkpoint = load_hf_checkpoint(src)
    bank = bank_from_checkpoint(checkpoint, experts_dtype)
    tensors = {name: ("weight", t.contiguous()) for name, t in checkpoint.weights.items()}
    tensors.update({BANK_PREFIX + name: ("expert_bank", t.contiguous()) for name, t in bank.tensors.items()})
    extra = {name: src / name for name in EXTRA_FILES if (src / name).is_file()}
    sources = sorted(src.glob("*.safetensors")) + [src / "config.json"]
    return write_ftw(dst, tensors, metadata={"config": checkpoint.raw_config, "bank": bank_metadata(bank)},
                     source_fingerprint=source_fingerprint_of(sources), extra_files=extra,
                     overwrite=overwrite, progress=progress, on_stale_removed=on_stale_removed)
