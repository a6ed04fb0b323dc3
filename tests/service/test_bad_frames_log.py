"""A request that does not deserialize (invalid UTF-8 in a string field, a truncated or garbage protobuf
frame) fails for its client with INTERNAL; the daemon keeps serving and logs one line, not a traceback."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.daemon_process import start_daemon

SERVING = health_pb2.HealthCheckResponse.SERVING
BAD_FRAMES = {
    "garbage": b"\xff\xff\xff",
    "invalid-utf8": b"\x0a\x02\xff\xfe",  # GenerateRequest.request_id (field 1, string) = bytes ff fe
    "truncated": b"\x1a\x10only five",  # prompt (field 3) says 16 bytes, 9 follow
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("frames"))
    yield d
    assert d.stop() == 0, (d.home / "daemon.out").read_text()


def _log_text(d) -> str:
    return (d.home / "logs" / "moed.log").read_text() + (d.home / "daemon.out").read_text()


def test_bad_frames_fail_with_internal_and_log_one_line_each(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        generate = channel.unary_stream("/moed.v1.Inference/Generate", request_serializer=None,
                                        response_deserializer=None)
        tokenize = channel.unary_unary("/moed.v1.Inference/Tokenize", request_serializer=None,
                                       response_deserializer=None)
        for name, frame in BAD_FRAMES.items():
            with pytest.raises(grpc.RpcError) as info:
                list(generate(frame, timeout=10))
            assert info.value.code() == grpc.StatusCode.INTERNAL, name
            with pytest.raises(grpc.RpcError) as info:
                tokenize(frame, timeout=10)
            assert info.value.code() == grpc.StatusCode.INTERNAL, name
    assert daemon.health() == SERVING
    assert daemon.client().status().state  # still answers real calls
    logs = _log_text(daemon)
    assert "Traceback" not in logs, logs
    lines = [line for line in logs.splitlines() if "deserializ" in line]
    assert len(lines) == 2 * len(BAD_FRAMES), logs
    assert all("grpc._common" in line and "WARNING" in line for line in lines), lines


def test_filter_keeps_other_grpc_records_and_is_installed_once():
    from moed.api.server import OneLineDeserializeErrors, install_grpc_log_filter

    install_grpc_log_filter()
    install_grpc_log_filter()
    common = logging.getLogger("grpc._common")
    assert sum(isinstance(f, OneLineDeserializeErrors) for f in common.filters) == 1
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    other = logging.LogRecord("grpc._common", logging.ERROR, __file__, 1, "Exception serializing message!",
                              (), exc_info)
    assert OneLineDeserializeErrors().filter(other) and other.exc_info is exc_info  # our bug: keep the traceback
    bad = logging.LogRecord("grpc._common", logging.ERROR, __file__, 1, "Exception deserializing message!",
                            (), exc_info)
    assert OneLineDeserializeErrors().filter(bad)
    assert bad.exc_info is None and bad.levelno == logging.WARNING and "ValueError: boom" in bad.getMessage()
    assert "\n" not in bad.getMessage()
