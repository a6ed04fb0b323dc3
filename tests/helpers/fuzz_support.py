"""Helpers for the daemon's fuzz and fault tests: odd model directories, raw gRPC calls, RSS.

Every gRPC call here goes through a generic channel method with no serializer, so a test can send
bytes that no generated stub would produce (invalid UTF-8, truncated varints, random frames).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

# Placeholder for a string that goes on the wire as invalid UTF-8: set it in a message, serialize,
# then replace its bytes by BAD_UTF8 (the same length, so every length prefix stays right).
UTF8_MARKER = "@@BAD-UTF-8@@"
# a lone continuation byte, an overlong '/', a truncated 3-byte sequence, an encoded surrogate, 0xff
BAD_UTF8 = b"\x80\xc0\xaf\xe2\x28\xed\xa0\x80\xff\xfe\xc3\x28\xf8"
assert len(BAD_UTF8) == len(UTF8_MARKER.encode())

# what a client sees when the call never got a real answer from the daemon
TRANSPORT_MARKERS = ("Stream removed", "metadata size exceeds", "Socket closed", "Connection reset",
                     "failed to connect", "Broken pipe", "Connection refused", "GOAWAY", "RST_STREAM")

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")


def corrupt_utf8(payload: bytes) -> bytes:
    """The serialized message with every UTF8_MARKER string replaced by invalid UTF-8 bytes."""
    return payload.replace(UTF8_MARKER.encode(), BAD_UTF8)


def derive_long_context_model(src: Path, dst: Path, max_positions: int) -> Path:
    """A copy of the HF model dir `src` that claims `max_positions` positions (rotary models do
    not store per-position weights, so only config.json changes): a KV cache as big as a user asks."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def make_fifo_model(src: Path, dst: Path) -> Path:
    """A model dir whose model.safetensors is a FIFO: a naive open() blocks until someone writes."""
    dst.mkdir(parents=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    os.mkfifo(dst / "model.safetensors")
    return dst


def release_fifo(path: Path) -> None:
    """Unblock a reader stuck opening the FIFO: open its write end and close it (the reader sees EOF)."""
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ENOENT):  # no reader waiting (or gone): nothing to release
                return
            raise
        os.close(fd)
        time.sleep(0.05)


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@dataclass
class CallResult:
    code: str  # grpc.StatusCode name, or "OK"
    details: str
    messages: list[bytes]
    elapsed: float


class RawCaller:
    """Calls any method of the daemon with raw request bytes; answers come back undecoded."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self._unary: dict[str, object] = {}
        self._stream: dict[str, object] = {}

    def call(self, path: str, payload: bytes, *, stream: bool, timeout: float,
             max_messages: int | None = None) -> CallResult:
        """One call; `max_messages` cancels a stream after that many answers (e.g. WatchStatus)."""
        cache = self._stream if stream else self._unary
        if path not in cache:
            make = self.channel.unary_stream if stream else self.channel.unary_unary
            cache[path] = make(path, request_serializer=None, response_deserializer=None)
        method = cache[path]
        start = time.monotonic()
        messages: list[bytes] = []
        try:
            if not stream:
                messages.append(method(payload, timeout=timeout))
            else:
                answers = method(payload, timeout=timeout)
                for answer in answers:
                    messages.append(answer)
                    if max_messages is not None and len(messages) >= max_messages:
                        answers.cancel()
                        break
            return CallResult("OK", "", messages, time.monotonic() - start)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and max_messages is not None and len(messages) >= max_messages:
                return CallResult("OK", "", messages, time.monotonic() - start)  # our own cancel
            return CallResult(exc.code().name, exc.details() or "", messages, time.monotonic() - start)
