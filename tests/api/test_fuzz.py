"""Malformed requests to every RPC of a real daemon: each one gets a clean status in time, and afterwards
the daemon still serves the same tokens as a fresh one, without having grown.

One module-scoped `moed serve` with the tiny model loaded (plus an emulated-device copy, for Calibrate)
takes a fixed-seed stream of requests: random field values (NaN, inf, subnormals, huge and negative
numbers, 100 KB strings, invalid UTF-8, unknown device/policy/dtype/role names), hand-made wire bytes,
random byte frames sent through a generic channel, and garbage written straight to the unix socket; plus
fixed regression cases for issue #9. A call passes when it ends within CALL_TIMEOUT with a status other
than INTERNAL/UNKNOWN, or with a clean INTERNAL (one line, no traceback, at most MAX_DETAILS_CHARS);
every error's details must be such a line, and must be the daemon's own answer (not a transport error
such as "Stream removed" for metadata the daemon made too large).

Set MOED_FUZZ_REPORT=path.json to keep the figures (requests, statuses by code, RSS before/after).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket as socketlib
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.daemon_process import start_daemon
from helpers.fuzz_support import (TRANSPORT_MARKERS, UTF8_MARKER, RawCaller, corrupt_utf8,
                                  derive_long_context_model, make_fifo_model, release_fifo, rss)
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.v1 import control_pb2 as cpb
from moed.v1 import inference_pb2 as ipb

SEED = 909
RANDOM_CASES = 1500
CALL_TIMEOUT = 10.0  # a call that has not ended by then is a hang
MAX_DETAILS_CHARS = 1000  # what the daemon may put in a status' details (daemon/api/errors.py: MAX_DETAILS_CHARS)
RSS_GROWTH_LIMIT = 0.10
MAIN, EMU = "tiny", "emu"  # the daemon's models: --model tiny (CPU) and an emulated-device copy
HUGE = "x" * 100_000
VALID_FOR_MARKER = ("é" * 6 + "\x01").encode()  # valid UTF-8 as long as UTF8_MARKER
SERVING = health_pb2.HealthCheckResponse.SERVING

# path -> (request class, streams answers?)
METHODS = {
    "/moed.v1.Inference/Generate": (ipb.GenerateRequest, True),
    "/moed.v1.Inference/Tokenize": (ipb.TokenizeRequest, False),
    "/moed.v1.Inference/Cancel": (ipb.CancelRequest, False),
    "/moed.v1.Control/LoadModel": (cpb.LoadModelRequest, True),
    "/moed.v1.Control/UnloadModel": (cpb.UnloadModelRequest, False),
    "/moed.v1.Control/ListModels": (cpb.ListModelsRequest, False),
    "/moed.v1.Control/SetVramCap": (cpb.SetVramCapRequest, False),
    "/moed.v1.Control/SetServing": (cpb.SetServingRequest, False),
    "/moed.v1.Control/GetStatus": (cpb.GetStatusRequest, False),
    "/moed.v1.Control/WatchStatus": (cpb.WatchStatusRequest, True),
    "/moed.v1.Control/Calibrate": (cpb.CalibrateRequest, False),
    "/moed.v1.Control/Shutdown": (cpb.ShutdownRequest, False),
}
PATH_OF = {cls: path for path, (cls, _) in METHODS.items()}
ALL_RPCS = {path.removeprefix("/moed.v1.") for path in METHODS}

NAN, INF = float("nan"), float("inf")
# float32 fields: 1e-40 and 1.4e-45 are float32 subnormals; 5e-324 rounds to 0; 3.4e38 is near float32 max
FLOATS32 = [NAN, INF, -INF, 1e-40, 1.4e-45, -1e-40, 1e-38, 5e-324, -0.0, 0.0, 3.4e38, -1.0, 0.5, 1.0, 2.0, 0.7]
DOUBLES = [NAN, INF, -INF, 1e-40, 5e-324, -5e-324, -0.0, 0.0, 1e308, -1.0, 0.5, 1.0, 2.0, 1e-300]
INT32S = [0, 1, 4, 16, -1, -(2**31), 2**31 - 1, 7]
UINT32S = [0, 1, 2, 8, 256, 257, 8192, 2**31, 2**32 - 1]
UINT64S = [0, 1, 2**63, 2**64 - 1, 1 << 40]
STRINGS = ["", HUGE, UTF8_MARKER, "\x00", "tiny\x00", " tiny", "../" * 40, "😀" * 500, "\u202e\u200b\ufeff",
           "a\nb\r\nc", "%s%n%x", "nope", "🦀/../../etc/passwd", "\\\\?\\C:\\", "tiny" * 60]
PROMPTS = ["The router reads", "", HUGE, "😀" * 50, "\x00\x01\x02\x7f", "<|im_end|><|im_start|>", "<s>" * 20,
           UTF8_MARKER, "日本語のテキスト", "\u202e\u200b", "the weights " * 30, " ", "A small expert"]
ROLES = ["system", "user", "assistant", "tool", "wizard", "", "USER", "user\x00", HUGE, UTF8_MARKER, "developer?",
         "<|im_start|>", "function"]
KNOWN_ROLES = ("system", "user", "assistant", "tool")
DEVICES = ["", "auto", "cpu", "emulated", "cuda", "quantum", "CPU ", "cuda:99", HUGE, UTF8_MARKER, "\x00"]
POLICIES = ["", "adaptive", "fixed-share:0.5", "fixed-share:nan", "fixed-share:inf", "fixed-share:-1",
            "fixed-share:1e-40", "fixed-share:5e-324", "fixed-share:", "fixed-share:0.5:0.5", "nonsense",
            "adaptive:1", HUGE, UTF8_MARKER, "cpu-all", "lru"]
DTYPES = ["", "fp32", "bf16", "int4", "int3", "fp8", "FP32", HUGE, UTF8_MARKER]


# -- the run's bookkeeping ------------------------------------------------------------------------
@dataclass
class Outcome:
    rpc: str
    label: str
    code: str
    details: str
    elapsed: float
    problems: list[str]
    rss_delta: int = 0  # how much the daemon's RSS changed over this call (and its clean-up)


@dataclass
class FuzzRun:
    outcomes: list[Outcome] = field(default_factory=list)
    fixed_count: int = 0  # the first outcomes are the fixed cases
    raw_socket_writes: int = 0
    random_frames: int = 0  # calls whose request was random bytes
    invalid_utf8: int = 0  # calls whose request carried invalid UTF-8 in a string field
    rss_before: int = 0
    rss_after: int = 0
    wall_s: float = 0.0
    final_problems: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problems]

    def report(self) -> dict:
        by_code = Counter(o.code for o in self.outcomes)
        by_rpc: dict[str, Counter] = {}
        for o in self.outcomes:
            by_rpc.setdefault(o.rpc, Counter())[o.code] += 1
        return {
            "seed": SEED, "requests_tried": len(self.outcomes), "raw_socket_writes": self.raw_socket_writes,
            "random_frames": self.random_frames, "invalid_utf8_requests": self.invalid_utf8,
            "statuses_by_code": dict(sorted(by_code.items())),
            "statuses_by_rpc": {rpc: dict(sorted(c.items())) for rpc, c in sorted(by_rpc.items())},
            "rss_before_bytes": self.rss_before, "rss_after_bytes": self.rss_after,
            "rss_growth": (self.rss_after / self.rss_before - 1) if self.rss_before else None,
            "wall_seconds": round(self.wall_s, 1),
            "internal_details": dict(Counter(o.details[:120] for o in self.outcomes if o.code == "INTERNAL")),
            "largest_rss_increases": [{"rpc": o.rpc, "case": o.label[:200], "bytes": o.rss_delta}
                                      for o in sorted(self.outcomes, key=lambda o: -o.rss_delta)[:8]
                                      if o.rss_delta > 0],
            "fixed_cases": [f"{o.rpc} [{o.label[:90]}] -> {o.code} {o.details[:90]}"
                            for o in self.outcomes[:self.fixed_count]],
            "failures": [{"rpc": o.rpc, "case": o.label[:200], "code": o.code, "details": o.details[:300],
                          "problems": o.problems} for o in self.failures],
            "final_problems": self.final_problems,
        }


def details_problems(code: str, details: str, *, deadline_ok: bool = False) -> list[str]:
    problems = []
    if code == "DEADLINE_EXCEEDED" and not deadline_ok:
        problems.append(f"no answer within {CALL_TIMEOUT:g} s (a hang)")
    if code == "UNKNOWN":
        problems.append("UNKNOWN: an exception escaped the servicer without being mapped to a status")
    if code not in ("OK", "DEADLINE_EXCEEDED"):  # a deadline's details are the client's own
        if len(details) > MAX_DETAILS_CHARS:
            problems.append(f"details are {len(details)} characters (at most {MAX_DETAILS_CHARS})")
        if "\n" in details or "\r" in details:
            problems.append("details span several lines")
        if "Traceback" in details or 'File "' in details:
            problems.append("details carry traceback text")
        if any(marker in details for marker in TRANSPORT_MARKERS):
            problems.append("the call never got the daemon's answer (transport error)")
    return problems


class Fuzzer:
    def __init__(self, daemon, run: FuzzRun, fifo_dir: Path, long_dir: Path) -> None:
        self.daemon, self.run = daemon, run
        self.fifo_dir, self.long_dir = fifo_dir, long_dir
        self.channel = grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.raw = RawCaller(self.channel)
        self.baseline_models = {MAIN, EMU}
        self.dead = False

    def close(self) -> None:
        self.channel.close()

    # one call, checked ------------------------------------------------------------------------
    def call(self, path: str, payload, label: str, *, expect: set[str] | None = None, deadline_ok: bool = False,
             timeout: float = CALL_TIMEOUT, max_messages: int | None = None, record: bool = True):
        if self.dead:
            return None
        if not isinstance(payload, bytes):
            payload = payload.SerializeToString()
        if UTF8_MARKER.encode() in payload:
            payload = corrupt_utf8(payload)
            self.run.invalid_utf8 += record
            if expect is not None:  # grpc's own answer to a request protobuf cannot parse
                expect = expect | {"INTERNAL"}
        stream = METHODS[path][1] if path in METHODS else False
        if path == "/moed.v1.Control/WatchStatus" and max_messages is None:
            max_messages = 1  # the first status comes at once; the next only after the interval (up to 1 h)
        result = self.raw.call(path, payload, stream=stream, timeout=timeout, max_messages=max_messages)
        problems = details_problems(result.code, result.details, deadline_ok=deadline_ok)
        if expect is not None and result.code not in expect:
            problems.append(f"expected {' or '.join(sorted(expect))}")
        if self.daemon.proc.poll() is not None:
            self.dead = True
            problems.append(f"the daemon exited ({self.daemon.proc.returncode}) on this call")
        if record:
            self.run.outcomes.append(Outcome(path.removeprefix("/moed.v1."), label, result.code, result.details,
                                             result.elapsed, problems))
        return result

    # state kept sane between cases ----------------------------------------------------------------
    def loaded_names(self) -> set[str]:
        result = self.raw.call("/moed.v1.Control/GetStatus", b"", stream=False, timeout=CALL_TIMEOUT)
        if result.code != "OK":
            return set()
        return {m.name for m in cpb.Status.FromString(result.messages[0]).models}

    def after_load(self, result, label: str) -> None:
        """A load the daemon accepted must serve: one short greedy request on it, then unload it."""
        if result is None or result.code != "OK" or not result.messages:
            return
        final = cpb.LoadModelProgress.FromString(result.messages[-1])
        name = final.model.name
        if name and name not in self.baseline_models:
            # a context too small for this prompt is refused, rightly
            expect = {"OK"} if final.model.context_length >= 16 else {"OK", "INVALID_ARGUMENT"}
            self.call("/moed.v1.Inference/Generate",
                      ipb.GenerateRequest(model=name, prompt="The router reads", sampling=ipb.SamplingParams(max_tokens=2)),
                      f"serve the model the daemon just accepted ({label})", expect=expect)
            if final.model.device == "emulated":  # and a device model can be calibrated
                self.call("/moed.v1.Control/Calibrate", cpb.CalibrateRequest(model=name, seconds=0.001),
                          f"calibrate the model the daemon just accepted ({label})", expect={"OK"})
        self.unload_extras()

    def unload_extras(self) -> None:
        for name in self.loaded_names() - self.baseline_models:
            self.raw.call("/moed.v1.Control/UnloadModel", cpb.UnloadModelRequest(model=name).SerializeToString(),
                          stream=False, timeout=CALL_TIMEOUT)

    def restore_cap(self) -> None:
        self.raw.call("/moed.v1.Control/SetVramCap", b"", stream=False, timeout=CALL_TIMEOUT)  # 0 = auto

    def rss(self) -> int:
        try:
            return rss(self.daemon.proc.pid)
        except Exception:  # it died: the next check says so
            return 0

    def dispatch(self, path: str, payload, label: str, **kw):
        before = self.rss()
        count = len(self.run.outcomes)
        result = self.call(path, payload, label, **kw)
        if path == "/moed.v1.Control/LoadModel":
            self.after_load(result, label)
        elif path == "/moed.v1.Control/SetVramCap":
            self.restore_cap()
        if not self.dead and len(self.run.outcomes) > count:
            self.run.outcomes[count].rss_delta = self.rss() - before
        return result


# -- request generators ---------------------------------------------------------------------------------
def some(rng: random.Random, pool):
    return rng.choice(pool)


def random_sampling(rng: random.Random) -> ipb.SamplingParams:
    s = ipb.SamplingParams()
    if rng.random() < 0.5:
        s.temperature = some(rng, FLOATS32)
    if rng.random() < 0.3:
        s.top_k = some(rng, INT32S)
    if rng.random() < 0.3:
        s.top_p = some(rng, FLOATS32)
    if rng.random() < 0.25:
        s.min_p = some(rng, FLOATS32)
    if rng.random() < 0.3:
        s.repetition_penalty = some(rng, FLOATS32)
    if rng.random() < 0.3:
        s.seed = some(rng, UINT64S)
    s.max_tokens = some(rng, [1, 2, 4, 8, 16, 0, -1, 2**31 - 1, -(2**31)])  # 0 = the default (256)
    if rng.random() < 0.25:
        s.stop.extend(some(rng, [[], ["."], [""], [HUGE], ["a"] * 17, [UTF8_MARKER], ["\x00"], ["😀", "e"]]))
    s.ignore_eos = rng.random() < 0.3
    return s


def random_chat(rng: random.Random) -> ipb.ChatMessages:
    chat = ipb.ChatMessages()
    for _ in range(some(rng, [0, 1, 1, 2, 3, 40])):
        chat.messages.add(role=some(rng, ROLES), content=some(rng, PROMPTS))
    return chat


def gen_generate(rng):
    req = ipb.GenerateRequest(model=some(rng, [MAIN, MAIN, MAIN, EMU, "", *STRINGS]))
    if rng.random() < 0.25:
        req.request_id = some(rng, STRINGS + ["fuzz-id"])
    pick = rng.random()
    if pick < 0.5:
        req.prompt = some(rng, PROMPTS)
    elif pick < 0.9:
        req.chat.CopyFrom(random_chat(rng))
    if rng.random() < 0.9:
        req.sampling.CopyFrom(random_sampling(rng))
    return req


def gen_tokenize(rng):
    return ipb.TokenizeRequest(model=some(rng, [MAIN, EMU, "", *STRINGS]), text=some(rng, PROMPTS + STRINGS),
                               add_special_tokens=rng.random() < 0.5)


def gen_cancel(rng):
    return ipb.CancelRequest(request_id=some(rng, STRINGS + ["fuzz-id", "*"]))


def gen_load(rng):
    req = cpb.LoadModelRequest(model=some(rng, [MAIN, MAIN, "/nonexistent/model", "", "/", "/proc/self", "/dev/null",
                                                *STRINGS]))
    if rng.random() < 0.7:
        req.name = some(rng, ["fuzz-load", "", *STRINGS])
    if rng.random() < 0.5:
        req.device = some(rng, DEVICES)
    if rng.random() < 0.4:
        req.policy = some(rng, POLICIES)
    if rng.random() < 0.4:
        req.cache_fraction = some(rng, DOUBLES)
    if rng.random() < 0.4:
        req.context_length = some(rng, UINT32S)
    if rng.random() < 0.3:
        req.experts_dtype = some(rng, DTYPES)
    req.verify = rng.random() < 0.2
    if rng.random() < 0.4:
        req.max_batch = some(rng, UINT32S)
    if rng.random() < 0.3:
        req.max_queue = some(rng, UINT32S)
    if rng.random() < 0.4:
        req.emulated_b_p = some(rng, DOUBLES)
    return req


def gen_unload(rng):
    return cpb.UnloadModelRequest(model=some(rng, STRINGS + ["fuzz-load"]))


def gen_set_vram_cap(rng):
    req = cpb.SetVramCapRequest()
    if rng.random() < 0.6:
        req.cap_bytes = some(rng, UINT64S)
    if rng.random() < 0.6:
        req.cap_fraction = some(rng, DOUBLES)
    return req


def gen_set_serving(rng):
    return cpb.SetServingRequest(paused=rng.random() < 0.3)


def gen_watch(rng):
    # valid intervals stay short here: a stream left with a long one is test_abandoned_watch_streams_...'s case
    return cpb.WatchStatusRequest(interval_seconds=some(rng, DOUBLES + [0.05, 0.04, 3601.0]))


def gen_calibrate(rng):
    # never a valid long measurement: at most a few milliseconds a phase when accepted
    return cpb.CalibrateRequest(model=some(rng, [MAIN, EMU, EMU, "", *STRINGS]),
                                seconds=some(rng, [NAN, INF, -INF, -1.0, 1e-40, 5e-324, 61.0, 1e308, 0.001, -0.0]))


GENERATORS = {
    "/moed.v1.Inference/Generate": (gen_generate, 6),
    "/moed.v1.Inference/Tokenize": (gen_tokenize, 2),
    "/moed.v1.Inference/Cancel": (gen_cancel, 1),
    "/moed.v1.Control/LoadModel": (gen_load, 4),
    "/moed.v1.Control/UnloadModel": (gen_unload, 1),
    "/moed.v1.Control/ListModels": (lambda rng: cpb.ListModelsRequest(), 1),
    "/moed.v1.Control/SetVramCap": (gen_set_vram_cap, 2),
    "/moed.v1.Control/SetServing": (gen_set_serving, 1),
    "/moed.v1.Control/GetStatus": (lambda rng: cpb.GetStatusRequest(), 1),
    "/moed.v1.Control/WatchStatus": (gen_watch, 1),
    "/moed.v1.Control/Calibrate": (gen_calibrate, 1),
}


def random_frame(rng: random.Random, path: str) -> bytes | None:
    """Random bytes for `path`; for Shutdown and Calibrate only bytes that cannot parse (never a real
    shutdown, never a long measurement); None when no such frame came up."""
    cls = METHODS[path][0]
    for _ in range(20):
        frame = rng.randbytes(some(rng, [1, 2, 3, 7, 16, 64, 300, 4096]))
        try:
            cls.FromString(frame)
        except Exception:
            return frame
        if path not in ("/moed.v1.Control/Shutdown", "/moed.v1.Control/Calibrate"):
            return frame
    return None


# -- wire-level helpers --------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def ld(number: int, data: bytes) -> bytes:
    return key(number, 2) + varint(len(data)) + data


# frames no ShutdownRequest parser accepts: a truncated varint, lengths past the end, a group never closed
BAD_SHUTDOWN_FRAMES = [b"\x08", b"\x08\xff", b"\x0a\x05ab", b"\xff" * 11, key(1, 3), key(2, 2) + varint(1000) + b"x",
                       b"\x80", key(0, 0) + b"\x01", key(1, 2) + b"\xff\xff\xff\xff\x0f"]


# -- the run --------------------------------------------------------------------------------------------
def fixed_cases(f: Fuzzer) -> None:
    """Issue #9's known defects and the other edge cases, each sent on purpose (regression cases)."""
    G, T = "/moed.v1.Inference/Generate", "/moed.v1.Inference/Tokenize"
    C = "/moed.v1.Control/"
    sampling = lambda **kw: ipb.SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw)  # noqa: E731
    clean = {"OK", "INVALID_ARGUMENT"}
    refused = {"INVALID_ARGUMENT", "NOT_FOUND"}

    # subnormal / extreme temperatures: greedy-like or refused, never a failed sampling step
    for t in (1e-40, 1.4e-45, 1e-38, 1e-30, 5e-324, 3.4e38):
        f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads", sampling=sampling(temperature=t)),
                   f"temperature={t!r}", expect=clean)
    for fieldname, values in (("top_p", (1e-40, NAN, 0.0)), ("min_p", (1e-40, 1.0, NAN)),
                              ("repetition_penalty", (1e-40, 3.4e38, INF))):
        for v in values:
            f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads",
                                              sampling=sampling(temperature=1.0, seed=1, **{fieldname: v})),
                       f"{fieldname}={v!r} temperature=1", expect=clean)
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads",
                                      sampling=sampling(max_tokens=2**31 - 1, ignore_eos=True)),
               "max_tokens=2**31-1 (ends at the context)", expect={"OK"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads",
                                      sampling=sampling(top_k=2**31 - 1, seed=2**64 - 1, temperature=1.0)),
               "top_k=2**31-1 seed=2**64-1", expect={"OK"})

    # 100 KB names: refused with a short message (never a 100 KB echo in the trailing metadata)
    f.dispatch(G, ipb.GenerateRequest(model=HUGE, prompt="hi"), "Generate model=100 KB", expect=refused)
    f.dispatch(T, ipb.TokenizeRequest(model=HUGE, text="hi"), "Tokenize model=100 KB", expect=refused)
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=HUGE), "LoadModel model=100 KB", expect=refused)
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=MAIN, name=HUGE), "LoadModel name=100 KB", expect=refused)
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=MAIN, name="huge-device", device=HUGE),
               "LoadModel device=100 KB", expect=refused)
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=MAIN, name="huge-policy", policy=HUGE),
               "LoadModel policy=100 KB", expect=refused)
    f.dispatch(C + "UnloadModel", cpb.UnloadModelRequest(model=HUGE), "UnloadModel model=100 KB", expect=refused)
    f.dispatch(C + "Calibrate", cpb.CalibrateRequest(model=HUGE, seconds=0.001), "Calibrate model=100 KB",
               expect=refused)
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt=HUGE), "Generate prompt=100 KB", expect={"INVALID_ARGUMENT"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, request_id=HUGE, prompt="hi", sampling=sampling()),
               "Generate request_id=100 KB", expect={"OK", "INVALID_ARGUMENT"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="hi", sampling=ipb.SamplingParams(max_tokens=4, stop=[HUGE])),
               "Generate stop=[100 KB]", expect={"OK", "INVALID_ARGUMENT"})

    # chat roles the template does not know are refused, not rendered
    for role in ("wizard", "", "user\x00", HUGE, "<|im_start|>", UTF8_MARKER):
        chat = ipb.ChatMessages(messages=[ipb.ChatMessage(role=role, content="hello")])
        f.dispatch(G, ipb.GenerateRequest(model=MAIN, chat=chat, sampling=sampling()),
                   f"chat role={role[:20]!r}", expect={"INVALID_ARGUMENT"})
    chat = ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content="hi"),
                                      ipb.ChatMessage(role="wizard", content="hi")])
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, chat=chat, sampling=sampling()), "chat: user then wizard",
               expect={"INVALID_ARGUMENT"})
    for role in KNOWN_ROLES:
        chat = ipb.ChatMessages(messages=[ipb.ChatMessage(role=role, content="hello")])
        f.dispatch(G, ipb.GenerateRequest(model=MAIN, chat=chat, sampling=sampling()), f"chat role={role!r}",
                   expect={"OK", "INVALID_ARGUMENT"})
    chat = ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content="hi") for _ in range(5000)])
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, chat=chat, sampling=sampling()), "chat: 5000 messages",
               expect={"INVALID_ARGUMENT"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, chat=ipb.ChatMessages(), sampling=sampling()), "chat: no messages",
               expect={"INVALID_ARGUMENT"})

    # a KV cache of max_batch x context is checked against host RAM before anything is allocated
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.long_dir), name="kv-8k", max_batch=256,
                                                     context_length=8192),
               "LoadModel max_batch=256 context_length=8192", expect={"OK", "RESOURCE_EXHAUSTED"})
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.long_dir), name="kv-1m", max_batch=256,
                                                     context_length=1 << 20, kv_tokens=1 << 28),
               "LoadModel context_length=2**20 kv_tokens=2**28 (~140 GB of KV)", expect={"RESOURCE_EXHAUSTED"})
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.long_dir), name="kv-short", context_length=4096,
                                                     kv_tokens=100),
               "LoadModel kv_tokens below the context", expect={"INVALID_ARGUMENT"})
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.long_dir), name="kv-max", context_length=1 << 20,
                                                     kv_tokens=2**32 - 1),
               "LoadModel kv_tokens=2**32-1", expect={"RESOURCE_EXHAUSTED"})
    f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.long_dir), name="kv-max", max_batch=2**32 - 1,
                                                     context_length=2**32 - 1),
               "LoadModel max_batch=context_length=2**32-1", expect={"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})

    # a FIFO where the weights should be: refused, never a load that blocks forever
    fifo = f.fifo_dir / "model.safetensors"
    try:
        f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=str(f.fifo_dir), name="fifo"),
                   "LoadModel from a dir whose model.safetensors is a FIFO",
                   expect={"FAILED_PRECONDITION", "INVALID_ARGUMENT"})
    finally:
        release_fifo(fifo)  # unblock a stuck reader, if any, so the rest of the run has a usable daemon
        f.unload_extras()

    # two concurrent loads of one name: exactly one wins, the other is refused
    twins: list = [None, None]
    payload = cpb.LoadModelRequest(model=MAIN, name="twin").SerializeToString()
    start = threading.Barrier(2)

    def twin(i: int) -> None:
        start.wait()
        twins[i] = f.raw.call(C + "LoadModel", payload, stream=True, timeout=CALL_TIMEOUT)

    threads = [threading.Thread(target=twin, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT + 5)
    codes = sorted(r.code if r is not None else "DEADLINE_EXCEEDED" for r in twins)
    for i, r in enumerate(twins):
        problems = details_problems(r.code, r.details) if r is not None else ["no answer (a hang)"]
        if codes != ["ALREADY_EXISTS", "OK"] and codes != ["INVALID_ARGUMENT", "OK"]:
            problems.append(f"two concurrent loads of one name ended {codes}: one must load, one be refused")
        f.run.outcomes.append(Outcome("Control/LoadModel", f"concurrent load #{i} of name 'twin'",
                                      r.code if r else "DEADLINE_EXCEEDED", r.details if r else "", 0.0, problems))
    f.unload_extras()

    # other LoadModel options: unknown devices, policies, dtypes; NaN/inf/subnormal numbers
    for kw in (dict(device="quantum"), dict(device="cuda:99"), dict(policy="nonsense"), dict(policy="fixed-share:nan"),
               dict(policy="fixed-share:inf"), dict(policy="fixed-share:-1"), dict(experts_dtype="int3"),
               dict(cache_fraction=NAN), dict(cache_fraction=INF), dict(cache_fraction=-1e-40), dict(max_batch=257),
               dict(max_queue=2**32 - 1), dict(context_length=1), dict(context_length=2**32 - 1),
               dict(emulated_b_p=NAN), dict(emulated_b_p=-INF), dict(device="emulated", emulated_b_p=INF)):
        f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=MAIN, name="opt", **kw), f"LoadModel {kw}",
                   expect={"INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"})
    # accepted or refused, but a model that loads must serve (a 5e-324 B/s bus must not make it unusable)
    for kw in (dict(cache_fraction=5e-324), dict(cache_fraction=1e-40), dict(device="emulated", emulated_b_p=5e-324),
               dict(device="emulated", emulated_b_p=1e-40), dict(device="emulated", emulated_b_p=1e308),
               dict(device="emulated", cache_fraction=0.0), dict(max_batch=256), dict(context_length=2)):
        f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=MAIN, name="opt", **kw), f"LoadModel {kw}",
                   expect={"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"})
    for model in ("", "/", "/proc/self", "/dev/null", "/nonexistent/model", "../" * 40, "tiny\x00", UTF8_MARKER):
        f.dispatch(C + "LoadModel", cpb.LoadModelRequest(model=model, name="path"), f"LoadModel model={model[:30]!r}",
                   expect={"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"})

    # Calibrate: seconds that are no number of seconds, on the emulated model
    for s in (NAN, INF, -1.0, 61.0, 1e308, 1e-40, 5e-324):
        f.dispatch(C + "Calibrate", cpb.CalibrateRequest(model=EMU, seconds=s), f"Calibrate seconds={s!r}",
                   expect={"OK", "INVALID_ARGUMENT"})
    f.dispatch(C + "Calibrate", cpb.CalibrateRequest(model=MAIN, seconds=0.001), "Calibrate a CPU-backend model",
               expect={"INVALID_ARGUMENT", "FAILED_PRECONDITION"})

    # WatchStatus intervals, SetVramCap caps (restored after each), SetServing
    for s in (NAN, INF, -INF, -1.0, 1e-40, 5e-324, 0.04, 3601.0):
        f.dispatch(C + "WatchStatus", cpb.WatchStatusRequest(interval_seconds=s), f"WatchStatus interval={s!r}",
                   expect={"INVALID_ARGUMENT"})
    f.dispatch(C + "WatchStatus", cpb.WatchStatusRequest(interval_seconds=0.05), "WatchStatus interval=0.05",
               expect={"OK"}, max_messages=3)
    for kw in (dict(cap_fraction=NAN), dict(cap_fraction=INF), dict(cap_fraction=-1.0), dict(cap_fraction=0.0),
               dict(cap_fraction=1.0000001), dict(cap_fraction=5e-324), dict(cap_fraction=1e-40),
               dict(cap_bytes=2**64 - 1), dict(cap_bytes=1), dict(cap_bytes=1, cap_fraction=0.5)):
        f.dispatch(C + "SetVramCap", cpb.SetVramCapRequest(**kw), f"SetVramCap {kw}",
                   expect={"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION"})
    f.dispatch(C + "SetServing", cpb.SetServingRequest(paused=True), "SetServing paused", expect={"OK"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="hi", sampling=sampling()), "Generate while paused",
               expect={"UNAVAILABLE"})
    f.dispatch(C + "SetServing", cpb.SetServingRequest(paused=False), "SetServing resumed", expect={"OK"})

    # Cancel and UnloadModel of things that do not exist; unknown methods
    for rid in ("", HUGE, UTF8_MARKER, "no-such-request"):
        f.dispatch("/moed.v1.Inference/Cancel", ipb.CancelRequest(request_id=rid), f"Cancel id={rid[:20]!r}",
                   expect={"OK", "INVALID_ARGUMENT", "NOT_FOUND"})
    for name in ("", "no-such-model", UTF8_MARKER, "tiny\x00"):
        f.dispatch(C + "UnloadModel", cpb.UnloadModelRequest(model=name), f"UnloadModel {name[:20]!r}",
                   expect={"INVALID_ARGUMENT", "NOT_FOUND"})
    for path in ("/moed.v1.Inference/Nope", "/moed.v1.Nope/Generate", "/x"):
        f.call(path, b"\x0a\x02hi", f"unknown method {path}", expect={"UNIMPLEMENTED"})

    # Shutdown, with frames no parser accepts only (the daemon must stay up)
    for frame in BAD_SHUTDOWN_FRAMES:
        with pytest.raises(Exception):
            cpb.ShutdownRequest.FromString(frame)  # guard: never send a frame that is a real shutdown
        f.dispatch(C + "Shutdown", frame, f"Shutdown frame {frame[:12]!r}", expect={"INTERNAL", "INVALID_ARGUMENT"})

    # hand-made wire bytes: overlong/overflowing varints, wrong wire types, unknown fields
    wire = [
        (G, ld(2, b"tiny") + ld(3, b"The router") + ld(5, key(7, 0) + b"\xff" * 9 + b"\x01"),
         "max_tokens as a 10-byte varint (2**64-1 -> -1)", {"INVALID_ARGUMENT"}),
        (G, ld(2, b"tiny") + ld(3, b"hi") + ld(5, key(7, 0) + b"\xff" * 10 + b"\x01"), "an 11-byte varint", None),
        (G, key(2, 0) + varint(5) + ld(3, b"hi"), "model sent as a varint", None),
        (G, ld(2, b"tiny") + ld(3, b"hi") + ld(4, ld(1, ld(1, b"wizard") + ld(2, b"x"))) + ld(3, b"hi again")
         + ld(5, key(7, 0) + varint(2)), "oneof set three times (prompt wins)", {"OK"}),
        (G, ld(2, b"tiny") + ld(3, b"hi") + ld(5, key(1, 5) + struct.pack("<I", 0x7FC00001)
                                               + key(7, 0) + varint(2)), "temperature = a NaN payload",
         {"INVALID_ARGUMENT"}),
        (G, ld(2, b"tiny") + ld(3, b"hi") + ld(5, key(1, 5) + struct.pack("<I", 1) + key(7, 0) + varint(2)),
         "temperature = the smallest float32 subnormal", {"OK", "INVALID_ARGUMENT"}),
        (C + "LoadModel", ld(1, b"tiny") + ld(2, b"wire") + key(6, 0) + varint(2**64 - 1),
         "context_length 2**64-1 (uint32 truncation)", {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
        (C + "LoadModel", ld(1, b"tiny") + ld(2, b"wire-mb") + key(9, 0) + varint(2**40),
         "max_batch 2**40 (truncates to 0 = default)", None),
        (C + "GetStatus", ld(99, HUGE.encode()), "GetStatus with a 100 KB unknown field", {"OK"}),
        (C + "ListModels", key(5, 3), "ListModels with a group never closed", None),
        (C + "WatchStatus", key(1, 1) + struct.pack("<Q", 0x7FF0000000000001), "interval = a signalling NaN",
         {"INVALID_ARGUMENT"}),
        (C + "SetVramCap", key(2, 1) + struct.pack("<Q", 0x8000000000000000), "cap_fraction = -0.0",
         {"INVALID_ARGUMENT", "OK"}),
        (T, ld(1, b"tiny") + ld(2, b"\xf4\x90\x80\x80"), "text = a code point past U+10FFFF", None),
        (T, ld(1, b"tiny") + ld(2, b"\xed\xb2\x80"), "text = an encoded lone surrogate", None),
        (T, b"\x0a\xff\xff\xff\xff\x0f" + b"tiny", "a length prefix of 4 GB", None),
    ]
    for path, payload, label, expect in wire:
        f.dispatch(path, payload, label, expect=expect)

    # deadlines: expiring before the answer, and mid-stream (the request is freed either way)
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads", sampling=sampling(max_tokens=200,
                                                                                              ignore_eos=True)),
               "deadline 1 ms", timeout=0.001, deadline_ok=True, expect={"DEADLINE_EXCEEDED", "OK"})
    f.dispatch(G, ipb.GenerateRequest(model=MAIN, prompt="The router reads", sampling=sampling(max_tokens=250,
                                                                                              ignore_eos=True)),
               "deadline mid-stream", timeout=0.05, deadline_ok=True, expect={"DEADLINE_EXCEEDED", "OK"})

    # Cancel of a stream in flight, from another call
    stream = f.channel.unary_stream(G, request_serializer=None, response_deserializer=None)(
        ipb.GenerateRequest(model=MAIN, request_id="fuzz-inflight", prompt="The router reads",
                            sampling=sampling(max_tokens=250, ignore_eos=True)).SerializeToString(),
        timeout=CALL_TIMEOUT)
    try:
        next(stream)
        result = f.call("/moed.v1.Inference/Cancel", ipb.CancelRequest(request_id="fuzz-inflight"),
                        "Cancel a request in flight", expect={"OK"})
        reasons = [ipb.GenerateResponse.FromString(m).finish_reason for m in stream]
        if result is not None and result.code == "OK":
            cancelled = ipb.CancelResponse.FromString(result.messages[0]).cancelled
            if not cancelled or reasons[-1:] != ["cancelled"]:
                f.run.outcomes[-1].problems.append(f"cancelled={cancelled}, the stream ended {reasons[-1:]}")
    except grpc.RpcError as exc:
        f.run.outcomes.append(Outcome("Inference/Generate", "the stream of a request cancelled in flight",
                                      exc.code().name, exc.details() or "", 0.0,
                                      ["the stream failed instead of ending with finish_reason 'cancelled'"]))


def batch_isolation(f: Fuzzer) -> None:
    """A greedy request that shares the batch with fuzzed ones gives the same text as alone."""
    G = "/moed.v1.Inference/Generate"
    normal = ipb.GenerateRequest(model=MAIN, prompt="The scheduler finds",
                                 sampling=ipb.SamplingParams(max_tokens=24, ignore_eos=True)).SerializeToString()
    alone = f.raw.call(G, normal, stream=True, timeout=CALL_TIMEOUT)
    weird = [dict(temperature=1e-40), dict(temperature=1e-38), dict(temperature=3.4e38), dict(temperature=1.0, top_p=1e-40),
             dict(temperature=1.0, min_p=1.0), dict(temperature=1.0, repetition_penalty=3.4e38),
             dict(temperature=1.0, repetition_penalty=1e-40)]
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(weird) + 1)

    def run(i: int, payload: bytes) -> None:
        barrier.wait()
        results[i] = f.raw.call(G, payload, stream=True, timeout=CALL_TIMEOUT)

    payloads = [normal] + [ipb.GenerateRequest(model=MAIN, prompt="The router reads", sampling=ipb.SamplingParams(
        max_tokens=24, ignore_eos=True, seed=3, **kw)).SerializeToString() for kw in weird]
    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(payloads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT + 5)
    text = lambda r: "".join(ipb.GenerateResponse.FromString(m).text for m in r.messages)  # noqa: E731
    for i, kw in enumerate([{}] + weird):
        r = results.get(i)
        if r is None:
            f.run.outcomes.append(Outcome("Inference/Generate", f"batched with fuzzed requests: {kw}",
                                          "DEADLINE_EXCEEDED", "", CALL_TIMEOUT, ["no answer (a hang)"]))
            continue
        problems = details_problems(r.code, r.details)
        if i == 0 and (r.code != "OK" or text(r) != text(alone)):
            problems.append(f"the greedy request in the batch ended {r.code} {r.details[:100]!r} and its text "
                            f"{'differs from' if r.code == 'OK' else 'is not'} its text alone")
        if i > 0 and r.code not in ("OK", "INVALID_ARGUMENT"):
            problems.append("expected OK or INVALID_ARGUMENT")
        f.run.outcomes.append(Outcome("Inference/Generate", f"batched with fuzzed requests: {kw or 'greedy'}",
                                      r.code, r.details, r.elapsed, problems))


def random_cases(f: Fuzzer, rng: random.Random) -> None:
    paths = [p for p, (_, w) in GENERATORS.items() for _ in range(w)]
    for i in range(RANDOM_CASES):
        path = rng.choice(paths)
        if rng.random() < 0.12:
            frame = random_frame(rng, path)
            if frame is not None:
                f.run.random_frames += 1
                f.dispatch(path, frame, f"random #{i}: {len(frame)} random bytes")
                continue
        request = GENERATORS[path][0](rng)
        payload = request.SerializeToString()
        label = f"random #{i}: {short(request)}"
        if UTF8_MARKER.encode() in payload and rng.random() < 0.6:  # else most requests would stop at parsing
            payload = payload.replace(UTF8_MARKER.encode(), VALID_FOR_MARKER)
            label += f" [{UTF8_MARKER} sent as valid UTF-8]"
        f.dispatch(path, payload, label)
        if path == "/moed.v1.Control/SetServing":  # resume: "Generate while paused" is a fixed case
            f.raw.call(path, b"", stream=False, timeout=CALL_TIMEOUT)
        if f.dead:
            return
    for _ in range(4):  # Shutdown too, with random frames that cannot parse
        frame = random_frame(rng, "/moed.v1.Control/Shutdown")
        if frame is not None:
            f.run.random_frames += 1
            f.dispatch("/moed.v1.Control/Shutdown", frame, f"Shutdown: {len(frame)} random bytes that do not parse",
                       expect={"INTERNAL", "INVALID_ARGUMENT"})


def short(message) -> str:
    text = " ".join(f"{fd.name}={_short_value(v)}" for fd, v in message.ListFields())
    return f"{type(message).__name__}({text})"


def _short_value(value) -> str:
    if hasattr(value, "ListFields"):
        return short(value)
    if isinstance(value, str):
        return repr(value[:24]) + (f"..({len(value)})" if len(value) > 24 else "")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = repr(value)
    return text if len(text) < 80 else text[:80] + "..."


def raw_socket_garbage(f: Fuzzer, rng: random.Random) -> None:
    """Bytes straight onto the unix socket: not HTTP/2, half a connection preface, bad frames, floods."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    payloads = [rng.randbytes(4096), b"\x00" * 1024, preface + rng.randbytes(512), preface[:10],
                preface + b"\xff\xff\xff\x04\x00\x00\x00\x00\x00" + rng.randbytes(64),  # a 16 MB SETTINGS frame
                preface + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x10\x01\x05\x00\x00\x00\x01"
                + rng.randbytes(16),  # a HEADERS frame with random HPACK
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", UTF8_MARKER.encode() * 100]
    for payload in payloads:
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect(str(f.daemon.socket))
            try:
                raw.sendall(corrupt_utf8(payload))
            except OSError:  # the daemon may hang up first: fine
                pass
        f.run.raw_socket_writes += 1
    # a slow client holding a half-open connection while others are served, and a flood of connections
    idle = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    idle.connect(str(f.daemon.socket))
    idle.sendall(preface[:5])
    flood = []
    for _ in range(50):
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        s.connect(str(f.daemon.socket))
        s.sendall(b"\x00")
        flood.append(s)
    f.run.raw_socket_writes += 51
    f.dispatch("/moed.v1.Inference/Generate",
               ipb.GenerateRequest(model=MAIN, prompt="The router reads", sampling=ipb.SamplingParams(max_tokens=4)),
               "Generate while 51 garbage connections are open", expect={"OK"})
    for s in flood:
        s.close()
    idle.close()
    f.dispatch("/moed.v1.Control/GetStatus", cpb.GetStatusRequest(), "GetStatus after the garbage connections",
               expect={"OK"})


# -- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-models")
    build_tiny_model("mixtral", root / "models" / MAIN)
    write_tiny_tokenizer(root / "models" / MAIN)
    long_dir = derive_long_context_model(root / "models" / MAIN, root / "extra" / "long-context", 1 << 20)
    fifo_dir = make_fifo_model(root / "models" / MAIN, root / "extra" / "fifo-weights")
    return root / "models", long_dir, fifo_dir


def start_serving(home: Path, models_dir: Path):
    d = start_daemon(home, "--model", MAIN, models_dir=models_dir)
    deadline = time.monotonic() + 60
    while d.health() != SERVING:  # SERVING once the initial --model load is done
        assert time.monotonic() < deadline, (home / "daemon.out").read_text()
        time.sleep(0.05)
    return d


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models):
    d = start_serving(tmp_path_factory.mktemp("fuzz-home"), models[0])
    yield d
    assert d.stop() == 0, (d.home / "daemon.out").read_text()[-5000:]


def greedy(d, prompt: str, model: str = MAIN) -> tuple[str, list[int]]:
    text, ids = [], []
    with d.client() as client:
        for part in client.generate(prompt=prompt, model=model, max_tokens=32, ignore_eos=True):
            text.append(part.text)
            ids.extend(part.token_ids)
    return "".join(text), ids


@pytest.fixture(scope="module")
def fuzz(daemon, models):
    models_dir, long_dir, fifo_dir = models
    run = FuzzRun()
    f = Fuzzer(daemon, run, fifo_dir, long_dir)
    started = time.monotonic()
    try:
        with daemon.client() as client:
            for _ in client.load(MAIN, name=EMU, device="emulated"):
                pass
            # warm-up: every code path once (a load and unload, an error, a stream, the largest requests:
            # their first time sets buffers and caches of ~40 MB that later ones reuse), then measure
            greedy(daemon, "The router reads")
            greedy(daemon, "The router reads", EMU)
            client.tokenize("warm up", MAIN)
            for _ in client.load(MAIN, name="warm-up"):
                pass
            greedy(daemon, "The GPU", "warm-up")
            client.unload("warm-up")
            client.calibrate(EMU, seconds=0.001)
            client.list_models()
        f.call("/moed.v1.Control/LoadModel", cpb.LoadModelRequest(model="/nonexistent"), "warm-up", record=False)
        f.call("/moed.v1.Control/WatchStatus", cpb.WatchStatusRequest(interval_seconds=0.05), "warm-up", record=False)
        f.call("/moed.v1.Inference/Generate", ipb.GenerateRequest(model=MAIN, prompt=HUGE), "warm-up", record=False)
        chat = ipb.ChatMessages(messages=[ipb.ChatMessage(role="user", content="hi") for _ in range(5000)])
        f.call("/moed.v1.Inference/Generate", ipb.GenerateRequest(model=MAIN, chat=chat), "warm-up", record=False)
        run.rss_before = rss(daemon.proc.pid)

        rng = random.Random(SEED)
        fixed_cases(f)
        batch_isolation(f)
        run.fixed_count = len(run.outcomes)
        random_cases(f, rng)
        if not f.dead:
            f.raw.call("/moed.v1.Control/SetServing", b"", stream=False, timeout=CALL_TIMEOUT)  # random ones paused it
            raw_socket_garbage(f, rng)

        if not f.dead:  # leave the daemon as it was: serving, no cap, only its own models
            f.raw.call("/moed.v1.Control/SetServing", b"", stream=False, timeout=CALL_TIMEOUT)
            f.restore_cap()
            f.unload_extras()
            deadline = time.monotonic() + 15
            with daemon.client() as client:
                while client.status().active_requests or client.status().queued_requests:
                    if time.monotonic() > deadline:
                        run.final_problems.append(f"requests still active after the run: {client.status()}")
                        break
                    time.sleep(0.05)
            run.rss_after = rss(daemon.proc.pid)
    finally:
        f.close()
        run.wall_s = time.monotonic() - started
        report = run.report()
        print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
        for failure in report["failures"]:
            print("FAIL", json.dumps(failure))
        if os.environ.get("MOED_FUZZ_REPORT"):
            Path(os.environ["MOED_FUZZ_REPORT"]).write_text(json.dumps(report, indent=1) + "\n")
    return run


# -- the checks ---------------------------------------------------------------------------------------------
def test_every_malformed_request_gets_a_clean_status_in_time(fuzz):
    assert len(fuzz.outcomes) >= 200
    covered = {o.rpc for o in fuzz.outcomes}
    assert ALL_RPCS <= covered, f"not fuzzed: {sorted(ALL_RPCS - covered)}"
    lines = [f"{o.rpc} [{o.label[:120]}] -> {o.code} {o.details[:160]!r}: {'; '.join(o.problems)}"
             for o in fuzz.failures]
    assert not lines, f"{len(lines)} of {len(fuzz.outcomes)} calls failed:\n" + "\n".join(lines)


def test_after_the_fuzz_the_daemon_serves_what_a_fresh_one_serves(fuzz, daemon, models, tmp_path):
    assert daemon.proc.poll() is None, "the daemon died during the fuzz"
    assert not fuzz.final_problems, fuzz.final_problems
    assert daemon.health() == SERVING
    with daemon.client() as client:
        status = client.status()
        assert status.state == "idle" and {m.name for m in status.models} == {MAIN, EMU}, status
    fresh = start_serving(tmp_path / "fresh", models[0])
    try:
        for prompt in ("The router reads", "A small expert"):
            assert greedy(daemon, prompt) == greedy(fresh, prompt), prompt
    finally:
        assert fresh.stop() == 0


def test_the_daemon_did_not_grow(fuzz):
    assert fuzz.rss_before and fuzz.rss_after, "RSS not measured (the daemon died?)"
    growth = fuzz.rss_after / fuzz.rss_before - 1
    assert growth < RSS_GROWTH_LIMIT, (f"RSS grew {growth:.1%}: {fuzz.rss_before / 2**20:.0f} MiB -> "
                                       f"{fuzz.rss_after / 2**20:.0f} MiB")


def test_last_a_real_shutdown_request_stops_the_daemon_cleanly(fuzz, daemon):
    """The controlled last case: after all the malformed Shutdown frames, a well-formed one works."""
    with daemon.client() as client:
        client.shutdown(cancel_inflight=True)
    assert daemon.proc.wait(30) == 0
    assert not daemon.socket.exists()


def test_abandoned_watch_streams_do_not_pin_the_daemon(tmp_path):
    """A status watcher that asks for a long interval and goes away must not keep a server thread
    asleep for that interval: 70 of them would take every worker (the daemon answers nothing) and
    a shutdown would wait for the sleeps to end."""
    d = start_daemon(tmp_path / "watch")
    try:
        with grpc.insecure_channel(d.address) as channel:
            raw = RawCaller(channel)
            watch = cpb.WatchStatusRequest(interval_seconds=3600).SerializeToString()
            for i in range(70):
                result = raw.call("/moed.v1.Control/WatchStatus", watch, stream=True, timeout=CALL_TIMEOUT,
                                  max_messages=1)  # the first status, then the client cancels
                assert result.code == "OK", f"watch stream #{i}: {result.code} {result.details}"
            status = raw.call("/moed.v1.Control/GetStatus", b"", stream=False, timeout=CALL_TIMEOUT)
            assert status.code == "OK", f"after 70 abandoned watch streams GetStatus got {status.code}"
        started = time.monotonic()
        assert d.stop(timeout=15) == 0, "the daemon did not stop on SIGTERM (sleeping watch streams?)"
        assert time.monotonic() - started < 15
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
