"""The names of the host expert bank's storage dtypes (torch-free: the CLI offers them without importing torch)."""

from __future__ import annotations

EXPERT_DTYPES = ("fp32", "bf16", "int4", "q8", "mxfp4")  # layouts: cache/host_bank.py
PACKED_DTYPES = ("int4", "q8", "mxfp4")  # grouped along K by 32: D and I must be multiples of 32
# A GGUF file's expert tensors kept block for block in their own types (kernels/ggml_rows_format.py):
# a bank only a GGUF source can fill, so it is not among the dtypes a bank can be converted into.
GGML_BANK = "ggml"
LOAD_DTYPES = (*EXPERT_DTYPES, GGML_BANK)  # what --experts-dtype accepts when loading
