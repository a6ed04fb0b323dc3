"""Page-lock (register for DMA) the filled host expert bank, pinning what the OS allows and leaving the rest pageable.

Pinning happens after the bank is filled: pinning first would fault in and zero pages that the
loader overwrites at once. Registration is tried per tensor, then in page-aligned chunks for the
tensors that fail as a whole; when the OS runs out of lockable memory (``RLIMIT_MEMLOCK``,
Windows/WSL budgets) the rest stays pageable. Nothing here raises for a refusal: the report says
how much was pinned and why not more, and the caller decides (e.g. nothing pinned -> CPU-only
backend).
"""

from __future__ import annotations

import itertools
import mmap
import threading
from dataclasses import dataclass
from typing import Callable

import torch

PIN_CHUNK_BYTES = 64 << 20  # retry grain for a tensor that cannot be registered whole
PIN_MAX_FAILED_CHUNKS = 8  # consecutive chunk refusals after which the OS budget is taken as spent
_PAGE = mmap.PAGESIZE

# register(ptr, nbytes) -> True when the range is now pinned; unregister(ptr) undoes one register
Register = Callable[[int, int], bool]
Unregister = Callable[[int], None]

_registered_lock = threading.Lock()
_registered: dict[int, int] = {}  # report token -> its pinned bytes, not yet unpinned, in this process
_tokens = itertools.count(1)


def pinned_bytes_now() -> int:
    """Host bytes this process has registered (any method) and not yet unpinned."""
    with _registered_lock:
        return sum(_registered.values())


def _book(nbytes: int) -> int:
    """Record a report's registered bytes; its token (0: nothing registered)."""
    if nbytes == 0:
        return 0
    token = next(_tokens)
    with _registered_lock:
        _registered[token] = nbytes
    return token


@dataclass(frozen=True)
class PinReport:
    """How much of the host bank is pinned, how, and (when not all) why."""

    pinned_bytes: int
    pageable_bytes: int
    method: str  # "cudaHostRegister", "none" (no CUDA), or "custom" (an injected register)
    reason: str  # empty when everything was pinned
    regions: tuple[tuple[int, int], ...] = ()  # (ptr, nbytes) registered: what unpin() undoes
    token: int = 0  # its entry in this process's ledger of registered bytes (pinned_bytes_now)

    @property
    def total_bytes(self) -> int:
        return self.pinned_bytes + self.pageable_bytes

    @property
    def is_fully_pinned(self) -> bool:
        return self.pageable_bytes == 0

    def summary(self) -> str:
        """One sentence for status output."""
        gib = 1 << 30
        if self.total_bytes == 0:
            return "host expert bank is empty: nothing to pin"
        if self.is_fully_pinned:
            return f"host expert bank pinned: {self.pinned_bytes / gib:.2f} GiB ({self.method})"
        pct = 100.0 * self.pinned_bytes / self.total_bytes
        return (
            f"host expert bank {pct:.0f}% pinned ({self.pinned_bytes / gib:.2f} of {self.total_bytes / gib:.2f} GiB, "
            f"{self.method}); the rest is pageable and copies from it are slower: {self.reason}"
        )


def memlock_limit_bytes() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, or None when unlimited or not available (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _drain_cuda_error() -> None:
    """Consume the thread's pending CUDA runtime error left by a failed cudaHostRegister/Unregister.

    torch's cudart binding returns the error code but leaves it set (its ``C10_CUDA_ERROR_HANDLED``
    is a no-op marker), and torch has no cudaGetLastError binding: the next checked CUDA call on
    this thread, typically an unrelated kernel launch, would fail with the stale error. A tiny
    kernel launch reads it through torch's launch check, which raises; that exception is the
    drain. (Not verified on hardware in the change that added it: see tests/devices/test_pinning.py's
    test_real_refusal_is_reported_pageable_and_leaves_cuda_usable.)
    """
    try:
        torch.ones(1, device="cuda")
    except Exception:
        pass


def _cuda_register(ptr: int, nbytes: int) -> bool:
    ok = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0
    if not ok:
        _drain_cuda_error()
    return ok


def _cuda_unregister(ptr: int) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _drain_cuda_error()


def _has_cuda() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver install reads as "no CUDA"
        return False


def can_pin() -> bool:
    """True when this machine can page-lock host memory for DMA (tries one page-aligned buffer)."""
    if not _has_cuda():
        return False
    buf = mmap.mmap(-1, _PAGE)  # page-aligned, its own pages: cannot overlap a registered range
    arr = torch.frombuffer(buf, dtype=torch.uint8)
    try:
        ok = _cuda_register(arr.data_ptr(), _PAGE)
        if ok:
            _cuda_unregister(arr.data_ptr())
        return ok
    except Exception:
        return False
    finally:
        del arr
        buf.close()


def _chunks(ptr: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """Split ``[ptr, ptr+nbytes)`` at absolute multiples of ``chunk`` (a page multiple): no page is in two chunks."""
    out = []
    end = ptr + nbytes
    start = ptr
    while start < end:
        stop = min((start // chunk + 1) * chunk, end)
        out.append((start, stop - start))
        start = stop
    return out


def pin_host_tensors(
    tensors: list[torch.Tensor],
    *,
    limit_bytes: int | None = None,
    register: Register | None = None,
    unregister: Unregister | None = None,
    chunk_bytes: int = PIN_CHUNK_BYTES,
    method: str = "custom",
) -> PinReport:
    """Pin as much of ``tensors`` (CPU, contiguous) as the OS allows; never raises for a refusal.

    ``limit_bytes`` caps what is pinned (a budget of our own); ``register`` / ``unregister``
    replace the CUDA calls (tests simulate refusals with them; the emulated device books with
    them), ``method`` names them in the report. Without CUDA and without an injected
    ``register`` nothing is pinned and the report says why.
    """
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            raise ValueError(f"pin_host_tensors: tensor {i} is on {t.device}; only host tensors can be pinned")
        if not t.is_contiguous():
            raise ValueError(f"pin_host_tensors: tensor {i} {tuple(t.shape)} is not contiguous")
    if chunk_bytes < _PAGE or chunk_bytes % _PAGE:
        raise ValueError(f"pin_host_tensors: chunk_bytes must be a multiple of the page size {_PAGE}, got {chunk_bytes}")
    if limit_bytes is not None and limit_bytes < 0:
        raise ValueError(f"pin_host_tensors: limit_bytes must be >= 0 or None, got {limit_bytes}")

    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    if register is not None:
        pass
    elif _has_cuda():
        method, register = "cudaHostRegister", _cuda_register
    else:
        return PinReport(0, total, "none", "CUDA is not available, so host memory is not registered for DMA")

    budget = total if limit_bytes is None else min(limit_bytes, total)
    regions: list[tuple[int, int]] = []
    covered: list[tuple[int, int]] = []  # page-aligned [start, end) of the registered regions
    pinned = 0
    failed_chunks = 0
    refused = False  # the OS refused something (as opposed to our own limit stopping us)
    errors: list[str] = []

    def try_register(ptr: int, nbytes: int) -> bool:
        nonlocal pinned
        try:
            ok = bool(register(ptr, nbytes))
        except Exception as exc:  # a refusal, whatever form the binding gives it
            if len(errors) < 3:
                errors.append(f"{type(exc).__name__}: {exc}")
            ok = False
        if ok:
            regions.append((ptr, nbytes))
            covered.append((ptr // _PAGE * _PAGE, -(-(ptr + nbytes) // _PAGE) * _PAGE))
            pinned += nbytes
        return ok

    def uncovered(lo: int, hi: int) -> list[tuple[int, int]]:
        # [lo, hi) minus pages already registered (two small tensors can share a page, and
        # registering a page twice is refused): those bytes are pinned already
        pieces, cur = [], lo
        for a, b in sorted(covered):
            if b <= cur or a >= hi:
                continue
            if a > cur:
                pieces.append((cur, a))
            cur = max(cur, b)
        if cur < hi:
            pieces.append((cur, hi))
        return pieces

    limited = False  # our own limit_bytes stopped us somewhere
    for t, nbytes in zip(tensors, sizes):
        if nbytes == 0:
            continue
        lo = t.data_ptr()
        pieces = uncovered(lo, lo + nbytes)
        pinned += nbytes - sum(e - s for s, e in pieces)
        for s_ptr, e_ptr in pieces:
            size = e_ptr - s_ptr
            if failed_chunks >= PIN_MAX_FAILED_CHUNKS:
                break
            if pinned + size <= budget:
                if try_register(s_ptr, size):
                    continue
                refused = True
            for cptr, cbytes in _chunks(s_ptr, size, chunk_bytes):
                if failed_chunks >= PIN_MAX_FAILED_CHUNKS:
                    break
                take = min(cbytes, budget - pinned)
                if take < cbytes:  # the limit ends inside this chunk: stop at a page boundary
                    limited = True
                    take = ((cptr + take) // _PAGE) * _PAGE - cptr
                    if take <= 0:
                        break
                if try_register(cptr, take):
                    failed_chunks = 0
                else:
                    refused = True
                    failed_chunks += 1

    reason = ""
    if pinned < total:
        parts = []
        if refused:
            memlock = memlock_limit_bytes()
            lim = "unlimited" if memlock is None else f"{memlock} bytes"
            parts.append(
                f"the OS refused to lock more host memory (free host RAM, or raise the locked-memory limit: "
                f"RLIMIT_MEMLOCK is {lim}, see `ulimit -l` or LimitMEMLOCK= in the service unit; Windows/WSL "
                f"drivers cap pinned memory on their own)"
            )
            if errors:
                parts.append("errors: " + "; ".join(errors))
        if limited:
            parts.append(f"the pinning limit is {limit_bytes} bytes")
        reason = "; ".join(parts) or "part of the bank could not be registered"
    return PinReport(pinned, total - pinned, method, reason, tuple(regions), _book(pinned))


def unpin(report: PinReport, *, unregister: Unregister | None = None) -> None:
    """Undo ``pin_host_tensors`` (before the bank's memory is freed). Refusals are ignored."""
    if not report.regions:
        return
    if unregister is None:
        if report.method != "cudaHostRegister":
            raise ValueError(f"unpin: a {report.method!r} pin report needs the matching unregister callable")
        unregister = _cuda_unregister
    for ptr, nbytes in report.regions:
        try:
            unregister(ptr)
        except Exception:
            pass  # already unregistered, or the context is gone at exit: nothing left to undo
    with _registered_lock:
        _registered.pop(report.token, None)
