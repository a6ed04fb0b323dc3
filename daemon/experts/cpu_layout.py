"""A ggml bank laid out for the CPU kernels: row groups interleaved where that runs faster (x8).

The bank loads with each matrix as its GGUF file stores it. When only the CPU runs the experts, the
types that have an x8 layout (kernels/ggml_x8_format.py) faster than their rows at this machine's ISA
are permuted in place into it (a group of eight rows at a time, on the pool); the device path keeps the GGUF rows (its
slots and kernels read them). ``MOED_GGML_X8=0`` keeps the rows (A/B measurements, a suspected kernel).
"""

from __future__ import annotations

import logging
import os

from moed.cache.host_bank import GGML_BANK, ExpertBank
from moed.kernels.ggml_x8_format import is_x8, type_name
from moed.kernels.native_cpu import native

X8_ENV = "MOED_GGML_X8"
log = logging.getLogger(__name__)


def interleave_for_cpu(bank: ExpertBank) -> dict[str, int]:
    """Each ggml bank matrix whose type the CPU kernels run faster as x8 -> converted in place (its tensor's
    bytes permuted, ``row_types`` updated); returns ``{name: x8 type}`` of those converted (empty: none, no
    native kernels, or ``MOED_GGML_X8=0``)."""
    lib = native()
    if bank.dtype != GGML_BANK or lib is None or os.environ.get(X8_ENV, "1") == "0":
        return {}
    converted: dict[str, int] = {}
    done: dict[int, int] = {}  # id(tensor) -> its x8 type (relu^2 experts: one tensor under two names)
    for name, ggml_type in list(bank.row_types.items()):
        t = bank.tensors[name]
        if id(t) in done:
            bank.row_types[name] = converted[name] = done[id(t)]
            continue
        x8 = 0 if is_x8(ggml_type) else lib.ggml_x8_preferred(ggml_type)
        if not x8 or t.dim() != 3 or t.shape[1] % 8 or not t.is_contiguous():
            continue
        k = bank.hidden_size if name.split(".")[0] in ("gate", "up") else bank.intermediate_size
        lib.ggml_x8_convert(t, ggml_type, k, pack=True, out=t)  # in place, a group at a time
        done[id(t)] = bank.row_types[name] = converted[name] = x8
    if converted:
        kinds = sorted({type_name(v) for v in converted.values()})
        log.info("ggml bank: %d expert matrices interleaved for the CPU kernels (%s)", len(converted), ", ".join(kinds))
    return converted
